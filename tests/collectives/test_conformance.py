"""The conformance matrix on in-process ranks: algorithm x op x dtype x count, p = 1..8.

One ``run_ranks`` per (algorithm, p); inside, every rank loops over the cases (thread
start-up is the cost, not the cases). Each rank compares its result with the exact
expected bytes from ``tests/_cases.py``, so equal results prove identical bytes on every
rank; the per-rank CRCs are compared as well. The cases rotate through four ways in:
the flat buffer (``dense_allreduce``), ``allreduce`` out of place on a non-contiguous view,
``allreduce_`` in place on a contiguous 2-D array and on a non-contiguous view.
"""

from __future__ import annotations

import zlib
from functools import lru_cache

import numpy as np
import pytest
import torch

import gradcomm
from gradcomm.collectives import DENSE, algorithm, dense_allreduce
from gradcomm.ops import Reducer
from gradcomm.collectives._wire import DenseWire
from gradcomm.comm import run_ranks
from gradcomm.errors import ConfigError
from tests._cases import DTYPES, LARGE, OPS, expected, make_input, op_applies, small_counts

#: op x dtype pairs that also run at the two large counts
LARGE_CASES = (("sum", "float32"), ("max", "int8"), ("mean", "bfloat16"), ("prod", "int64"),
               ("sum", "float16"))
MODES = ("flat", "out_strided", "inplace_2d", "inplace_strided")


def cases(p: int) -> list[tuple[str, str, int]]:
    small = [(op, dt, n) for n in small_counts(p) for op in OPS for dt in DTYPES]
    return small + [(op, dt, n) for n in LARGE for op, dt in LARGE_CASES]


@lru_cache(maxsize=1)
def expectations(p: int) -> dict[tuple[str, str, int], np.ndarray]:
    return {(op, dt, n): expected(p, n, dt, op) for op, dt, n in cases(p)
            if op_applies(op, dt)}


def test_inputs_show_a_misplaced_segment() -> None:
    """No period in the element index, no all-zero sums, ranks' inputs differ: moving,
    repeating or swapping a segment of the result (or of one rank's input) changes it."""
    n = 120
    for op in OPS:
        for dt in DTYPES:
            if not op_applies(op, dt):
                continue
            ins = [make_input(r, n, dt, op).tobytes() for r in range(8)]
            assert len(set(ins)) == 8, (op, dt)
            for p in range(1, 9):
                want = expected(p, n, dt, op)
                assert np.unique(want).size > 1, (op, dt, p)
                for shift in range(1, n // 2 + 1):
                    assert (want[shift:] != want[:-shift]).sum() >= (n - shift) // 10, \
                        (op, dt, p, shift)


def _to_user(x: np.ndarray, dt: str) -> object:
    """The storage buffer as the user's array (torch for bfloat16, else numpy)."""
    if dt == "bfloat16":
        return torch.from_numpy(x.view(np.int16)).view(torch.bfloat16)
    return x


def _storage(y: object) -> np.ndarray:
    if isinstance(y, torch.Tensor):
        assert y.dtype == torch.bfloat16
        return y.contiguous().view(torch.int16).numpy().view(np.uint16).reshape(-1)
    assert isinstance(y, np.ndarray)
    return np.ascontiguousarray(y).reshape(-1)


def _strided(x: np.ndarray, dt: str) -> object:
    """A non-contiguous view (every other element of a twice-larger array) holding ``x``."""
    base = np.zeros(2 * x.size, x.dtype)
    base[::2] = x
    user = _to_user(base, dt)
    return user[::2]  # type: ignore[index]


def run_case(t, alg: str, op: str, dt: str, n: int, mode: str) -> np.ndarray:
    """Allreduce ``t.rank``'s input one way and return the result's storage bytes."""
    x = make_input(t.rank, n, dt, op)
    if mode == "flat":
        return dense_allreduce(t, x, op, dt, alg)
    if mode == "out_strided":
        user = _strided(x, dt)
        before = _storage(user).copy()
        y = gradcomm.allreduce(user, t, op=op, algorithm=alg)
        assert _storage(user).tobytes() == before.tobytes(), "input modified"
        assert type(y) is type(user) and y.shape == user.shape and y.dtype == user.dtype
        return _storage(y)
    if mode == "inplace_2d":
        user = _to_user(x.reshape(-1, 2) if n % 2 == 0 else x.reshape(1, -1), dt)
        y = gradcomm.allreduce_(user, t, op=op, algorithm=alg)
        assert y is user
        return _storage(user)
    user = _strided(x, dt)
    y = gradcomm.allreduce_(user, t, op=op, algorithm=alg)
    assert y is user
    return _storage(user)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("alg", DENSE)
@pytest.mark.parametrize("p", range(1, 9))
def test_matrix(p: int, alg: str) -> None:
    todo = cases(p)
    want = expectations(p)

    def fn(t) -> list:
        failures, crcs = [], []
        for i, (op, dt, n) in enumerate(todo):
            mode = MODES[i % len(MODES)]
            where = f"{alg} p={p} rank={t.rank} {op}/{dt} n={n} {mode}"
            if not op_applies(op, dt):
                try:
                    run_case(t, alg, op, dt, n, mode)
                    failures.append(f"{where}: no ConfigError")
                except ConfigError:
                    pass
                continue
            got = run_case(t, alg, op, dt, n, mode)
            exp = want[op, dt, n]
            if got.dtype != exp.dtype or got.tobytes() != exp.tobytes():
                bad = np.flatnonzero(got.view(np.uint8) != exp.view(np.uint8))
                failures.append(f"{where}: wrong bytes (first at byte {bad[:1]})")
            crcs.append(zlib.crc32(got.tobytes()))
        return [failures, crcs]

    results = run_ranks(p, fn, timeout=200)
    failures = [f for r in results for f in r[0]]
    assert not failures, "\n".join(failures[:20])
    assert all(r[1] == results[0][1] for r in results), "ranks hold different bytes"


class ShiftWire:
    """A deterministic lossy wire that is not idempotent: every ``final`` adds 1.

    Partials travel as fresh copies, finished segments land in fresh buffers and decode
    as they are. If an algorithm re-finalised a forwarded segment, or finalised different
    segments a different number of times on different ranks, ranks would disagree.
    """

    lossy = True

    def __init__(self, red: Reducer) -> None:
        self.dense = DenseWire(red)

    def partial_buffer(self, n: int, like: np.ndarray, slot: int = 0) -> np.ndarray:
        return self.dense.partial_buffer(n, like, slot)

    def encode(self, seg: np.ndarray) -> np.ndarray:
        assert seg.size, "empty segments are never encoded"
        return seg.copy()

    def reduce(self, recv: np.ndarray, seg: np.ndarray, recv_first: bool) -> None:
        self.dense.reduce(recv, seg, recv_first)

    def final(self, seg: np.ndarray) -> np.ndarray:
        assert seg.size, "empty segments are never finalised"
        seg += 1
        return seg.copy()

    def final_buffer(self, n: int, seg: np.ndarray) -> np.ndarray:
        return np.empty_like(seg)

    def place(self, recv: np.ndarray, seg: np.ndarray) -> None:
        seg[...] = recv


@pytest.mark.timeout(120)
@pytest.mark.parametrize("alg", ["ring", "tree", "recursive_doubling", "rabenseifner"])
def test_lossy_wire_gives_identical_bytes(alg: str) -> None:
    """Every rank ends with the same bytes whatever the wire does to finished segments."""
    kw = {"chunk_bytes": 40} if alg in ("ring", "tree") else {}
    for p in range(1, 9):
        def fn(t) -> list[bytes]:
            out = []
            for n in [*small_counts(p), 97]:
                buf = make_input(t.rank, n, "float64", "sum")
                red = Reducer("sum", "float64")
                algorithm(alg)(t, buf, red, wire=ShiftWire(red), **kw)
                exact = expected(p, n, "float64", "sum")
                shift = buf - exact                # what the wire added: whole numbers
                assert (shift >= 0).all() and (shift <= 2 * p).all(), (alg, p, n, shift)
                out.append(buf.tobytes())
            return out

        res = run_ranks(p, fn, timeout=60)
        assert all(r == res[0] for r in res), (alg, p)
