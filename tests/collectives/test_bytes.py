"""Bytes and messages per rank match each algorithm's alpha-beta model exactly.

The algorithm functions are called directly (no cross-rank check), so ``t.stats`` counts
the algorithm's own traffic. For each algorithm the expected count per rank is written out
here, for any n (divisible by p or not, below p, zero) and any p (power of two or not),
followed by the textbook figures for the cases they cover.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from gradcomm.collectives._check import NATIVE_FIELDS
from gradcomm.collectives import algorithm, dense_allreduce
from gradcomm.ops import Reducer
from gradcomm.comm import run_ranks
from tests._cases import expected, make_input

Cost = tuple[int, int, int, int]   # bytes sent, messages sent, bytes received, received


def segments(n: int, parts: int) -> list[int]:
    """Segment sizes: n split in ``parts``, the first n % parts one element larger."""
    return [n // parts + (1 if i < n % parts else 0) for i in range(parts)]


def messages(m: int, chunk: int) -> int:
    """Messages for m elements in chunks of at most ``chunk`` elements."""
    return -(-m // chunk)


def ring_cost(p: int, r: int, n: int, b: int, chunk_bytes: int) -> Cost:
    """Reduce-scatter sends every segment but r+1 and receives every one but r; the
    allgather sends every segment but r+2 and receives every one but r+1."""
    if p == 1 or n == 0:
        return (0, 0, 0, 0)
    m, c = segments(n, p), max(1, chunk_bytes // b)
    sent = [i for i in range(p) if i != (r + 1) % p] + [i for i in range(p) if i != (r + 2) % p]
    got = [i for i in range(p) if i != r] + [i for i in range(p) if i != (r + 1) % p]
    return (b * sum(m[i] for i in sent), sum(messages(m[i], c) for i in sent),
            b * sum(m[i] for i in got), sum(messages(m[i], c) for i in got))


def tree_cost(p: int, r: int, n: int, b: int, chunk_bytes: int) -> Cost:
    """n bytes up to the parent (r > 0) and down to every child, received likewise."""
    if p == 1 or n == 0:
        return (0, 0, 0, 0)
    low = r & -r if r else p
    kids = sum(1 for k in range(p.bit_length()) if 2 ** k < low and r + 2 ** k < p)
    links = kids + (r > 0)
    k = messages(n, max(1, chunk_bytes // b))
    return (links * n * b, links * k, links * n * b, links * k)


def rd_cost(p: int, r: int, n: int, b: int) -> Cost:
    """log2(2^k) whole-buffer exchanges among 2^k ranks; the 2(p - 2^k) folded ranks add
    one send and one receive of the buffer per pair."""
    if p == 1 or n == 0:
        return (0, 0, 0, 0)
    pof2 = 1 << (p.bit_length() - 1)
    rem = p - pof2
    msgs = 1 if (r < 2 * rem and r % 2 == 0) else int(math.log2(pof2)) + (r < 2 * rem)
    return (msgs * n * b, msgs, msgs * n * b, msgs)


def rabenseifner_cost(p: int, r: int, n: int, b: int) -> Cost:
    """Among 2^k ranks, at distance d = 2^(k-1)..1 send the partner's half (d segments) and
    receive one's own; then at d = 1..2^(k-1) send one's d-segment block and receive the
    partner's. Folded pairs as in recursive doubling. Empty blocks send nothing."""
    if p == 1 or n == 0:
        return (0, 0, 0, 0)
    pof2 = 1 << (p.bit_length() - 1)
    rem = p - pof2
    if r < 2 * rem and r % 2 == 0:
        return (n * b, 1, n * b, 1)
    v = r // 2 if r < 2 * rem else r - rem
    m = segments(n, pof2)

    def block(u: int, d: int) -> int:
        first = u - u % d
        return sum(m[first:first + d])

    out, back = [], []
    d = pof2 // 2
    while d:
        out.append(block(v ^ d, d))
        back.append(block(v, d))
        d //= 2
    d = 1
    while d < pof2:
        out.append(block(v, d))
        back.append(block(v ^ d, d))
        d *= 2
    if r < 2 * rem:                         # odd folded rank: receive, later send back
        out.append(n)
        back.append(n)
    return (b * sum(out), sum(1 for x in out if x), b * sum(back), sum(1 for x in back if x))


def counts(p: int) -> list[int]:
    return sorted({0, 1, max(p - 1, 0), p + 1, 2 * p + 3, 8 * p, 1000, 4099})


SMALL_CHUNK = 96     # bytes: several chunks per segment, uneven ones


def chunkings(alg: str, n: int) -> list[dict[str, int]]:
    """Default chunks; small uneven ones; one element per message (small n only)."""
    if alg not in ("ring", "tree"):
        return [{}]
    return [{}, {"chunk_bytes": SMALL_CHUNK}] + ([{"chunk_bytes": 1}] if n < 30 else [])


def model(alg: str, p: int, r: int, n: int, b: int, chunk_bytes: int) -> Cost:
    if alg == "ring":
        return ring_cost(p, r, n, b, chunk_bytes)
    if alg == "tree":
        return tree_cost(p, r, n, b, chunk_bytes)
    if alg == "recursive_doubling":
        return rd_cost(p, r, n, b)
    return rabenseifner_cost(p, r, n, b)


def measure(t, alg: str, n: int, dtype: str, **kw) -> Cost:
    """Run ``alg`` once on this rank's case input; check the result; return the counts."""
    buf = make_input(t.rank, n, dtype, "sum")
    t.stats.reset()
    algorithm(alg)(t, buf, Reducer("sum", dtype), **kw)
    s = t.stats
    assert buf.tobytes() == expected(t.size, n, dtype, "sum").tobytes(), (alg, n, kw)
    return (s.bytes_sent, s.messages_sent, s.bytes_received, s.messages_received)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("p", range(1, 9))
def test_counts_match_the_model(p: int) -> None:
    runs = [(alg, n, dt, kw) for alg in ("ring", "tree", "recursive_doubling", "rabenseifner")
            for n in counts(p) for dt in ("float32", "int8")
            for kw in chunkings(alg, n)]

    def fn(t) -> list:
        wrong = []
        for alg, n, dt, kw in runs:
            got = measure(t, alg, n, dt, **kw)
            b = np.dtype(dt).itemsize
            want = model(alg, p, t.rank, n, b, kw.get("chunk_bytes", 512 * 1024))
            if got != want:
                wrong.append(f"{alg} p={p} rank={t.rank} n={n} {dt} {kw}: got {got}, "
                             f"model {want}")
        return wrong

    wrong = [w for r in run_ranks(p, fn, timeout=100) for w in r]
    assert not wrong, "\n".join(wrong[:20])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("p", range(2, 9))
def test_ring_textbook(p: int) -> None:
    """p | n, one chunk per segment: 2(p-1)/p·n bytes in 2(p-1) messages, each way."""
    n = 6 * p

    def fn(t) -> Cost:
        return measure(t, "ring", n, "float64")

    for c in run_ranks(p, fn, timeout=30):
        assert c == (2 * (p - 1) * n // p * 8, 2 * (p - 1)) * 2


@pytest.mark.timeout(60)
@pytest.mark.parametrize("p", [2, 4, 8])
def test_power_of_two_textbook(p: int) -> None:
    """Recursive doubling: log2(p) messages of n bytes. Rabenseifner: 2·log2(p) messages,
    2(p-1)/p·n bytes. Binomial tree: rank 0 sends log2(p)·n bytes."""
    n, k = 4 * p, int(math.log2(p))

    def fn(t) -> tuple[Cost, Cost, Cost]:
        return (measure(t, "recursive_doubling", n, "int64"),
                measure(t, "rabenseifner", n, "int64"), measure(t, "tree", n, "int64"))

    res = run_ranks(p, fn, timeout=30)
    for rd, rab, _ in res:
        assert rd == (k * n * 8, k) * 2
        assert rab == (2 * (p - 1) * n // p * 8, 2 * k) * 2
    assert res[0][2][:2] == (k * n * 8, k)


@pytest.mark.timeout(60)
def test_check_costs_one_small_recursive_doubling() -> None:
    """``check=True`` adds exactly one recursive doubling over 2 x NATIVE_FIELDS int64
    fields (the fixed size of the check, so that different collectives still compare)."""
    p, n = 6, 1000

    def fn(t) -> tuple[int, int]:
        for check in (False, True):
            buf = make_input(t.rank, n, "float32", "sum")
            t.stats.reset()
            dense_allreduce(t, buf, "sum", "float32", "ring", check=check)
            if not check:
                base = (t.stats.bytes_sent, t.stats.messages_sent)
        return (t.stats.bytes_sent - base[0], t.stats.messages_sent - base[1])

    for r, extra in enumerate(run_ranks(p, fn, timeout=30)):
        assert extra == rd_cost(p, r, 2 * NATIVE_FIELDS, 8)[:2]
