"""``algorithm="auto"``, the cost model and profiles, the argument check's modes.

- the model's formulas against what the algorithms actually do (messages, bytes and
  reduced bytes on the critical path, counted by the transport and a counting reducer);
- profiles: file round trip, validation, the fingerprint;
- the same choice on every rank even when the ranks' local profiles differ (rank 0's is
  adopted at the first checked ``auto`` call; unchecked calls before that use the table);
- ``check="first"`` and the native form of the check (``fast_native``) on in-process ranks.
"""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
import pytest

import gradcomm
from gradcomm.collectives import algorithm, auto, dense_allreduce
from gradcomm.collectives._check import NATIVE_FIELDS, agree
from gradcomm.ops import Reducer
from gradcomm.collectives.costmodel import CHUNK_BYTES, Profile
from gradcomm.comm import run_ranks
from gradcomm.comm.state import NATIVE_BELOW
from gradcomm.errors import ConfigError, DeadlineError, MismatchError, TransportError
from tests._cases import expected, make_input


def unit(**kw: float) -> Profile:
    """A profile whose model counts one kind of cost: alpha=1 counts messages, etc."""
    base = {"alpha": 0.0, "beta": 0.0, "gamma": 0.0, "delta": 0.0, **kw}
    return Profile("threads", 1, base["alpha"], base["beta"], {"float32": base["gamma"]},
                   base["delta"])


class Counting(Reducer):
    """A reducer that counts the bytes it combines and how often it is called."""

    def __init__(self) -> None:
        super().__init__("sum", "float32")
        self.bytes = self.calls = 0

    def combine(self, a: Any, b: Any, out: Any) -> None:
        self.bytes += out.nbytes
        self.calls += 1
        super().combine(a, b, out)


def critical_path(alg: str, p: int, n: int) -> tuple[int, int, int, int]:
    """(messages, bytes, reduced bytes, reduce calls) on the critical path, from counts
    measured on every rank: the rank that does the most (ring, recursive doubling and
    Rabenseifner exchange in both directions at once, so a step costs one message each
    way; the binomial tree's root receives, then sends, one child at a time; a folded
    pair adds the fold-in before and the hand-back after the exchanges)."""

    def fn(t: Any) -> tuple[int, int, int, int]:
        buf = make_input(t.rank, n, "float32", "sum")
        red = Counting()
        t.stats.reset()
        algorithm(alg)(t, buf, red)
        assert buf.tobytes() == expected(p, n, "float32", "sum").tobytes()
        s = t.stats
        if alg == "tree":
            return (s.messages_sent + s.messages_received, s.bytes_sent + s.bytes_received,
                    red.bytes, red.calls)
        folded = (alg != "ring" and p & (p - 1) != 0
                  and t.rank < 2 * (p - (1 << (p.bit_length() - 1))))
        extra = int(folded and t.rank % 2 == 1)         # the odd rank of a folded pair
        return (s.messages_sent + extra, s.bytes_sent + extra * n * 4, red.bytes, red.calls)

    res = run_ranks(p, fn, timeout=60)
    return tuple(max(r[i] for r in res) for i in range(4))   # type: ignore[return-value]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("p", [2, 3, 4, 6, 8])
@pytest.mark.parametrize("alg", ["ring", "recursive_doubling", "rabenseifner", "tree"])
def test_formulas_match_the_counted_traffic(alg: str, p: int) -> None:
    """alpha/beta/gamma/delta = 1 turn the model into counts of messages, bytes, reduced
    bytes and reduce calls; they equal what the algorithm did (n divisible by p, one and
    two pipeline chunks for ring and tree)."""
    sizes = [p * 6]
    if alg in ("ring", "tree") and p <= 4:
        sizes.append(p * (3 * CHUNK_BYTES // 8))       # ring: 1.5 chunks per segment
    for n in sizes:
        got = critical_path(alg, p, n)
        nbytes = n * 4
        model = tuple(round(unit(**{k: 1.0}).predict(alg, nbytes, p))
                      for k in ("alpha", "beta", "gamma", "delta"))
        if alg == "ring":                               # only p-1 of the 2(p-1) steps reduce
            assert got[3] == (p - 1) * math.ceil(nbytes / p / CHUNK_BYTES)
        assert got == model, (alg, p, n, got, model)


def test_textbook_formulas() -> None:
    """The module table at power-of-two p, n divisible by p, one chunk."""
    a, b, g = 3e-6, 2e-10, 1e-10
    prof = Profile("mpi", 8, a, b, {"float32": g})
    n, p, k = 8 * 1024, 8, 3
    assert prof.predict("ring", n, p) == pytest.approx(2 * (p - 1) * a + 2 * (p - 1) / p * n * b
                                                       + (p - 1) / p * n * g)
    assert prof.predict("recursive_doubling", n, p) == pytest.approx(k * (a + n * b + n * g))
    assert prof.predict("rabenseifner", n, p) == pytest.approx(2 * k * a + 2 * (p - 1) / p * n
                                                               * b + (p - 1) / p * n * g)
    assert prof.predict("tree", n, p) == pytest.approx(2 * k * (a + n * b) + k * n * g)
    assert prof.predict("native", n, p) == math.inf          # not measured
    assert prof.predict("ring", 0, p) == prof.predict("ring", n, 1) == 0.0
    with pytest.raises(ConfigError, match="no cost model"):
        prof.predict("bogus", n, p)


def test_native_is_interpolated_between_measured_sizes() -> None:
    prof = Profile("mpi", 2, 1e-6, 1e-9, {"float32": 1e-10},
                   native=[[8, 2e-6], [4096, 4e-6], [1 << 20, 4e-3]])
    assert prof.predict("native", 4, 2) == 2e-6
    assert prof.predict("native", 4096, 2) == pytest.approx(4e-6)
    assert prof.predict("native", 2052, 2) == pytest.approx(3e-6, rel=1e-3)
    assert prof.predict("native", 2 << 20, 2) == pytest.approx(8e-3, rel=1e-2)  # last slope
    assert prof.best(["recursive_doubling", "native"], 4096, 2) == "native"
    assert prof.best(["recursive_doubling", "native"], 1 << 20, 2) == "recursive_doubling"


def test_beta_follows_the_measured_exchanges() -> None:
    """Where calibrated exchanges are given, beta at m bytes is never below what they
    show there (above the smallest exchange's time)."""
    prof = Profile("mpi", 2, 2e-6, 1e-10, {"float32": 0.0},
                   exchange=[[8, 2e-6], [1 << 20, 2e-6 + 1e-4], [8 << 20, 2e-6 + 4e-3]])
    assert prof.beta_at(4) == prof.beta_at(4096) == 1e-10
    assert prof.beta_at(8 << 20) == pytest.approx(4e-3 / (8 << 20))
    flat = Profile("mpi", 2, 2e-6, 1e-10, {"float32": 0.0})
    assert prof.predict("recursive_doubling", 8 << 20, 2) > \
        flat.predict("recursive_doubling", 8 << 20, 2) + 3e-3
    assert Profile.from_json(prof.to_json()) == prof


def test_profile_round_trip_and_validation(tmp_path) -> None:
    prof = Profile("mpi", 4, 3e-6, 2.5e-10, {"float32": 1e-10, "bfloat16": 2e-9}, 1e-7,
                   [[8, 2e-6], [4096, 4e-6]], overhead=5e-6, check=3e-6, copy=1e-10,
                   codecs={"int8": {"encode": 1e-9, "decode": 5e-10}}, info={"host": "x"},
                   alpha_by_algorithm={"ring": 4e-6})
    path = prof.save(str(tmp_path / "sub" / "p.json"))
    back = Profile.load(path)
    assert back == prof and back.digest() == prof.digest() and back.digest() > 0
    assert Profile.from_json(prof.to_json()) == prof
    changed = Profile.from_dict({**prof.to_dict(), "alpha": 4e-6})
    assert changed.digest() != prof.digest()
    assert prof.predict("ring", 8, 4) > Profile.from_dict(
        {**prof.to_dict(), "alpha_by_algorithm": {}}).predict("ring", 8, 4)   # its own alpha
    good = prof.to_dict()
    for key, value, words in [
            ("schema", 2, "schema"), ("alpha", -1.0, "alpha"), ("beta", float("nan"), "beta"),
            ("gamma", {"complex64": 1.0}, "gamma"), ("gamma", {}, "gamma"),
            ("ranks", 0, "ranks"), ("transport", 7, "transport"),
            ("native", [[8, 1.0], [8, 2.0]], "differ"), ("native", [[8]], "native point"),
            ("codecs", {"x": 3}, "codecs"), ("alpha", True, "alpha"),
            ("alpha_by_algorithm", {"bogus": 1.0}, "alpha_by_algorithm"),
            ("exchange", [[8, -1.0]], "exchange seconds")]:
        with pytest.raises(ConfigError, match=words):
            Profile.from_dict({**good, key: value}, "f.json")
    for text in ("not json", "[]", json.dumps({"schema": 1}), "x" * (2 << 20)):
        with pytest.raises(ConfigError, match="not a gradcomm profile"):
            Profile.from_json(text)
    with pytest.raises(ConfigError, match="cannot read profile"):
        Profile.load(str(tmp_path / "missing.json"))


def favouring(alg: str, p: int) -> Profile:
    """A profile under which ``alg`` is the cheapest for small messages at ``p`` ranks
    (the binomial tree never is: recursive doubling does less of everything)."""
    if alg in ("ring", "rabenseifner"):   # only bytes cost: ring at p=3, Rabenseifner at 4
        return Profile("threads", p, 0.0, 1.0, {"float32": 0.0}, 1e-9, native=[[8, 1e12]])
    if alg == "native":
        return Profile("threads", p, 1e-3, 0.0, {"float32": 0.0}, native=[[8, 0.0]])
    return Profile("threads", p, 1e-6, 0.0, {"float32": 0.0}, native=[[8, 1e12]])


@pytest.mark.timeout(60)
def test_ranks_with_different_local_profiles_choose_alike() -> None:
    """Each rank starts with another local profile; the first checked auto call adopts
    rank 0's everywhere (one broadcast), so every rank picks the same algorithm; an
    unchecked call before that uses the built-in table on every rank."""
    p, n = 4, 64
    mine = [favouring(a, p) for a in ("rabenseifner", "recursive_doubling", "native",
                                      "rabenseifner")]
    assert len({m.digest() for m in mine}) == 3
    assert mine[0].best(auto.HOP + ("native",), n * 4, p) == "rabenseifner"

    def fn(t: Any) -> tuple[Any, ...]:
        auto.use_profile(t, mine[t.rank])
        x = make_input(t.rank, n, "float32", "sum")
        before = (auto.is_agreed(t), auto.select(t, n * 4, native=True))
        y0 = gradcomm.allreduce(x, t, check=False)        # no agreement: the table
        y1 = gradcomm.allreduce(x, t)                      # agreement, then the model
        prof = auto.agreed_profile(t)
        after = auto.select(t, n * 4, "float32", "sum", native=True)
        return before, auto.is_agreed(t), prof.digest(), after, y0.tobytes(), y1.tobytes()

    res = run_ranks(p, fn, timeout=30)
    want = expected(p, n, "float32", "sum").tobytes()
    for before, agreed, digest, after, y0, y1 in res:
        assert before == (False, "recursive_doubling")
        assert agreed and digest == mine[0].digest()
        assert after == mine[0].best(auto.HOP + ("native",), n * 4, p)
        assert y0 == y1 == want
    assert len({r[3] for r in res}) == 1


@pytest.mark.timeout(60)
@pytest.mark.parametrize("alg, p", [("ring", 3), ("rabenseifner", 4), ("native", 4),
                                    ("recursive_doubling", 4)])
def test_auto_follows_the_agreed_profile(alg: str, p: int) -> None:
    n = 10

    def fn(t: Any) -> tuple[str, bytes, int]:
        auto.use_profile(t, favouring(alg, p) if t.rank == 0 else None)
        auto.agree_profile(t)
        t.stats.reset()
        y = gradcomm.allreduce(make_input(t.rank, n, "int32", "sum"), t)
        return auto.select(t, n * 4, "int32", "sum", native=True), y.tobytes(), \
            t.stats.bytes_sent

    res = run_ranks(p, fn, timeout=30)
    want = expected(p, n, "int32", "sum").tobytes()
    picks = {r[0] for r in res}
    assert picks == {alg}, picks
    assert all(r[1] == want for r in res)
    if alg == "native":           # only the check travels point to point: 2 rounds of
        assert all(r[2] == 2 * 2 * NATIVE_FIELDS * 8 for r in res)    # (codes, -codes)


def test_profiles_are_ignored_when_measured_elsewhere(tmp_path, monkeypatch) -> None:
    other = Profile("mpi", 2, 1e-6, 1e-9, {"float32": 1e-10})
    path = other.save(str(tmp_path / "p.json"))
    monkeypatch.setenv("GRADCOMM_PROFILE", path)
    with pytest.warns(RuntimeWarning, match="measured for mpi with 2 ranks"):
        assert run_ranks(2, auto.local_profile)[0] is None
    (tmp_path / "bad.json").write_text("{")
    monkeypatch.setenv("GRADCOMM_PROFILE", str(tmp_path / "bad.json"))
    with pytest.warns(RuntimeWarning, match="invalid JSON"):
        assert run_ranks(2, auto.local_profile)[0] is None
    mine = Profile("threads", 2, 1e-6, 1e-9, {"float32": 1e-10})
    mine.save(str(tmp_path / "threads-2.json"))
    monkeypatch.setenv("GRADCOMM_PROFILE", str(tmp_path / "{transport}-{ranks}.json"))
    assert [p.digest() for p in run_ranks(2, auto.local_profile)] == [mine.digest()] * 2
    monkeypatch.setenv("GRADCOMM_PROFILE", "none")
    assert run_ranks(2, auto.local_profile) == [None, None]


def test_table_without_profile() -> None:
    def fn(t: Any) -> list[str]:
        t.fast_native = True
        return [auto.table(t, 100), auto.table(t, 100, native=True),
                auto.select(t, 100, "float16", "sum", native=True),
                auto.table(t, 1 << 20)]

    assert run_ranks(2, fn)[0] == ["recursive_doubling", "native", "native",
                                   "ring"]   # threads reduce float16 natively
    assert run_ranks(3, fn)[0][3] == "ring" and run_ranks(4, fn)[0][3] == "rabenseifner"


# -- the argument check ------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_check_first_skips_repeated_arguments() -> None:
    """The first call with given arguments checks, later ones skip the exchange; other
    arguments check again."""
    p, n = 3, 100

    def fn(t: Any) -> list[int]:
        sent = []
        for count in (n, n, n + 1, n):
            t.stats.reset()
            dense_allreduce(t, make_input(t.rank, count, "float32", "sum"), "sum", "float32",
                            "ring", check="first")
            sent.append(t.stats.messages_sent)
        return sent

    for sent in run_ranks(p, fn):
        ring = sent[1]
        assert sent[0] > ring and sent[2] > ring and sent[3] == ring
    with pytest.raises(ConfigError, match="check must be True, False or 'first'"):
        run_ranks(2, lambda t: dense_allreduce(t, np.ones(2), "sum", "float64",
                                               check="always"))


@pytest.mark.timeout(60)
def test_check_first_later_mismatch_is_an_error_not_a_hang() -> None:
    """After the first checked call, a rank passing another count is caught by the
    algorithm (receive size or deadline), as documented, within the deadline."""
    def fn(t: Any) -> str:
        gradcomm.allreduce(np.ones(8), t, algorithm="ring", check="first")
        try:
            gradcomm.allreduce(np.ones(8 + (t.rank == 1)), t, algorithm="ring",
                               check="first")
        except (DeadlineError, TransportError) as exc:
            return type(exc).__name__
        return "ok"

    res = run_ranks(2, fn, wait_timeout=0.5, timeout=30)
    assert all(r in ("DeadlineError", "TransportError") for r in res), res


def _native_check(t: Any) -> Any:
    t.fast_native = True            # the check through small_allreduce, as on MPI
    return t


@pytest.mark.timeout(60)
def test_native_check_finds_every_mismatch() -> None:
    p = 3

    def fn(t: Any) -> list[str]:
        _native_check(t)
        out = []
        for call in (
                lambda: gradcomm.allreduce(np.ones(5 + (t.rank == 2)), t),
                lambda: gradcomm.allreduce(np.ones(4, np.float32 if t.rank else np.float64),
                                           t),
                lambda: agree(t, "gossip" if t.rank else "allreduce", count=4),
                lambda: agree(t, "x", **{f"f{i}": i + (t.rank == 1 and i == 20)
                                         for i in range(NATIVE_FIELDS + 5)}),
                lambda: agree(t, "x", count=4, **({"extra": 1} if t.rank else {}))):
            try:
                call()
                out.append("ok")
            except MismatchError as exc:
                out.append(str(exc).split(": ", 2)[-1])
        y = gradcomm.allreduce(np.full(3, t.rank, np.int64), t)
        out.append(y.tolist())
        return out

    res = run_ranks(p, fn, timeout=30)
    for r in res:
        assert "count ranges from 5 to 6" in r[0]
        assert "dtype differs (e.g. float32 vs float64)" in r[1]
        assert "collective differs" in r[2]
        assert "one of f14, f15" in r[3] and "f20" in r[3]
        assert r[4] in ("argument 2 differs (some ranks passed more arguments)",
                        "extra ranges from 0 to 1")
        assert r[5] == [3, 3, 3]


@pytest.mark.timeout(60)
def test_native_check_with_an_absent_rank_is_a_deadline() -> None:
    def fn(t: Any) -> str | None:
        _native_check(t)
        if t.rank == 2:
            return None
        try:
            gradcomm.allreduce(np.ones(4), t)
        except DeadlineError as exc:
            return str(exc)
        return "no error"

    res = run_ranks(3, fn, wait_timeout=0.3, timeout=30)
    assert all("0.3 s" in r for r in res[:2]) and res[2] is None


@pytest.mark.timeout(60)
def test_auto_hands_small_checked_calls_to_a_fast_native_allreduce() -> None:
    """fast_native and the check on: small messages go to the library (no point-to-point
    data); unchecked calls on a transport whose native allreduce cannot time out would
    not (threads' can, so it may be used there)."""
    def fn(t: Any) -> list[Any]:
        _native_check(t)
        out = []
        for check, native_bounded in ((True, False), (False, False), ("first", False),
                                      (False, True)):
            t.native_bounded = native_bounded
            t.stats.reset()
            y = gradcomm.allreduce(make_input(t.rank, 64, "float32", "sum"), t,
                                   check=check)
            assert y.tobytes() == expected(3, 64, "float32", "sum").tobytes()
            out.append(t.stats.bytes_sent)
        return out

    for sent in run_ranks(3, fn):
        assert sent[0] == 0                   # check and data through the library
        assert sent[1] > 0 and sent[2] > 0    # unchecked ("first": verified by call 1),
                                              # unbounded native: recursive doubling
        assert sent[3] == 0                   # unchecked but bounded: native


@pytest.mark.timeout(60)
def test_a_transport_preferring_its_library_gets_checked_calls_from_1_mib() -> None:
    """``native_preferred`` (gloo): ``auto`` hands checked dense calls from 1 MiB to the
    library's allreduce (below, gradcomm's algorithms stay); unchecked calls (``False``,
    and ``"first"`` once the arguments were checked: PowerSGD's rounds and the sparse
    gather, which a replay models, are unchecked) keep gradcomm's algorithms; without the
    flag nothing changes."""
    n = 1 << 18                                         # 1 MiB of float32

    def fn(t: Any) -> list[Any]:
        out: list[Any] = []
        for preferred in (True, False):
            t.native_preferred = preferred
            t.state.choices.clear()
            sent = []
            for check in (True, False, "first"):    # "first": verified by call 1
                t.stats.reset()
                y = gradcomm.allreduce(make_input(t.rank, n, "float32", "sum"), t,
                                       check=check)
                assert y.tobytes() == expected(3, n, "float32", "sum").tobytes()
                sent.append(t.stats.bytes_sent > n)     # the data point to point
            limit = [auto.table(t, b, native=True, checked=True)
                     for b in ((1 << 20) - 1, 1 << 20)]
            out += [sent, limit]
        return out

    assert run_ranks(3, fn) == [[[False, True, True], ["ring", "native"],
                                 [True, True, True], ["ring", "ring"]]] * 3


@pytest.mark.timeout(60)
@pytest.mark.parametrize("below", [[1 << 20] * 3, [1 << 20, 1 << 20, 64 << 10]])
def test_the_native_size_limit_is_agreed_with_the_profile(below: list[int]) -> None:
    """``native_below`` (MPI over shared memory: 1 MiB) moves the table's native limit
    for checked calls; the ranks agree on it with the profile, and where theirs differ
    every rank keeps the default (no rank in MPI_Allreduce while another runs a ring)."""
    n = (256 << 10) // 4

    def fn(t: Any) -> list[Any]:
        _native_check(t).native_below = below[t.rank]
        t.stats.reset()
        y = gradcomm.allreduce(make_input(t.rank, n, "float32", "sum"), t)
        assert y.tobytes() == expected(3, n, "float32", "sum").tobytes()
        return [t.state.native_below, t.stats.bytes_sent,
                auto.table(t, 1 << 20, native=True), auto.table(t, (1 << 20) - 1, native=True)]

    res = run_ranks(3, fn)
    agreed = below[0] if len(set(below)) == 1 else NATIVE_BELOW
    for limit, sent, at, under in res:
        assert limit == agreed
        assert (sent == 0) == (agreed > n * 4)     # 256 KiB: native (nothing point to
        assert at == "ring"                         # point) only under the larger limit
        assert under == ("native" if agreed == 1 << 20 else "ring")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("p", [2, 3])
def test_the_model_follows_the_transports_pipeline(p: int, monkeypatch) -> None:
    """With ``transport=``, ring and tree are modelled with that transport's messages
    (``chunk_bytes``) and ring's receive window: bytes, reduced bytes and reduce calls
    still equal what the ring did with those settings, and the messages' latency is
    paid once per window (``w - 1`` messages) instead of once per message."""
    from gradcomm.comm.threads import ThreadTransport
    from gradcomm.collectives.costmodel import pipeline

    monkeypatch.setattr(ThreadTransport, "max_chunk_bytes", 4 * CHUNK_BYTES)
    monkeypatch.setattr(ThreadTransport, "chunks_per_segment", 4)
    monkeypatch.setattr(ThreadTransport, "window_bytes", 8 * CHUNK_BYTES)
    n = p * 3 * CHUNK_BYTES                         # 12 MiB segments: 4 messages of 3 MiB
    nbytes = n * 4
    got = critical_path("ring", p, n)
    t = run_ranks(1, lambda t: t)[0]
    c, w = pipeline(t, nbytes // p)
    assert (c, w) == (3 * CHUNK_BYTES, 1 + 8 // 3)
    m = math.ceil(nbytes / p / c)
    model = tuple(round(unit(**{k: 1.0}).predict("ring", nbytes, p, transport=t))
                  for k in ("alpha", "beta", "gamma", "delta"))
    assert got[1:] == model[1:], (got, model)
    assert got[3] == (p - 1) * m
    assert got[0] == 2 * (p - 1) * m                # messages on the wire ...
    assert model[0] == 2 * (p - 1) * math.ceil(m / (w - 1))   # ... latencies paid
    assert unit(alpha=1.0).predict("ring", nbytes, p) == 2 * (p - 1) * \
        math.ceil(nbytes / p / CHUNK_BYTES)         # without: 512 KiB, double buffered
