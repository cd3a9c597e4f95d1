"""The DDP hook's cast route (gradcomm/integrations/ddp/cast.py): fp16/bf16 payloads summed
by the library's allreduce, in-process and on real gloo processes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from gradcomm import compressors  # noqa: E402
from gradcomm.comm import run_ranks  # noqa: E402
from gradcomm.error_feedback import ErrorFeedback  # noqa: E402
from gradcomm.integrations.ddp import cast  # noqa: E402
from tests._launch import torchrun  # noqa: E402

CHECKS = Path(__file__).parents[1] / "scripts" / "ddp_checks.py"


def _inputs(p: int, n: int) -> list[np.ndarray]:
    """Non-periodic float32 inputs spanning several binades, one per rank."""
    rng = np.random.default_rng(7)
    return [(rng.standard_normal(n) * np.exp(rng.uniform(-6, 6, n))).astype(np.float32)
            for _ in range(p)]


@pytest.mark.parametrize("p, n", [(2, 1), (3, 1001), (5, 4)])
def test_cast_allreduce_is_the_16_bit_sum_and_keeps_the_rounding_as_residual(p, n):
    """In-process ranks (their native sum adds in rank order): the result is the float16
    sum of each rank's rounded input, in rank order, widened; each rank's residual is
    exactly what its rounding lost; every rank holds the same bytes."""
    xs = _inputs(p, n)

    def fn(t):
        ef = ErrorFeedback()
        out, reason = cast.allreduce(t, xs[t.rank].copy(), compressors.get("fp16"), ef, "u")
        assert reason is None
        return out, ef.residual("u", n, np.float32).copy()

    res = run_ranks(p, fn)
    h = [x.astype(np.float16) for x in xs]
    total = h[0]
    for v in h[1:]:
        total = total + v                   # float16 addition, rounded each time
    for r, (out, e) in enumerate(res):
        assert out.tobytes() == total.astype(np.float32).tobytes(), r
        assert e.tobytes() == (xs[r] - h[r].astype(np.float32)).tobytes(), r


def _summed16(xs: list[np.ndarray], codec: str) -> np.ndarray:
    """The rank-order 16-bit sum of ``xs`` (each rounded once), widened: the in-process
    transport's native sum."""
    c = compressors.get(codec)
    h = [c.decompress(c.compress(x)) for x in xs]
    total = c.compress(h[0])
    out = c.decompress(total)
    for v in h[1:]:
        out = c.decompress(c.compress(out + v)) if codec == "bf16" else \
            (out.astype(np.float16) + v.astype(np.float16)).astype(np.float32)
    return out


@pytest.mark.parametrize("codec", ["fp16", "bf16"])
@pytest.mark.parametrize("p, n, piece", [(2, 10, 3), (3, 1001, 100), (5, 7, 1), (2, 0, 4)])
def test_pieces_and_the_fused_residual_give_the_bytes_of_one_piece(codec, p, n, piece):
    """The pipeline's pieces (each its own library allreduce) and a residual added in the
    codec's fused pass give the bytes of the unpipelined, step-by-step route: the sum of
    each rank's ``x + e`` rounded once, and ``e`` left holding what the rounding lost."""
    xs = _inputs(p, n)
    es = [x * np.float32(1e-3) for x in _inputs(p, n)]
    wanted = _summed16([x + e for x, e in zip(xs, es)], codec)

    def fn(t):
        x, e = xs[t.rank].copy(), es[t.rank].copy()
        out, reason = cast.allreduce(t, x, compressors.get(codec), None, "u", residual=e,
                                     piece=piece)
        return out.tobytes(), e.tobytes(), reason

    c = compressors.get(codec)
    for r, (out, e, reason) in enumerate(run_ranks(p, fn)):
        y = xs[r] + es[r]
        assert out == wanted.tobytes() and reason is None, r
        assert e == (y - c.decompress(c.compress(y))).tobytes(), r


def _guarded(p: int, plant: str, at: int = 1) -> list:
    """Two steps of the guarded cast route on ``p`` ranks, rank ``at`` planting ``plant``
    in the second: ``"nan_input"``, ``"nan_residual"`` or ``"big_input"`` (bound 0.01: a
    rounding error of ``|x| / 2^11`` passes it only on an input 100 times the last); or
    every rank ``"sum_overflows"``."""
    from gradcomm.compressed.guard import Guard

    n = 11

    def fn(t):
        guard = Guard(bound=0.01)
        e = np.zeros(n, np.float32)
        reasons = []
        for step in range(2):
            x = _inputs(p, n)[t.rank].copy()
            if step == 1 and t.rank == at:
                if plant == "nan_input":
                    x[3] = np.nan
                elif plant == "nan_residual":
                    e[5] = np.inf
                elif plant == "big_input":       # its rounding error: 100 x the scale's
                    x *= 100
            if step == 1 and plant == "sum_overflows":  # finite inputs and residuals
                x[2] = 60000.0                   # on every rank: float16's sum is inf
            reasons.append(cast.allreduce(t, x, compressors.get("fp16"), None, "u",
                                          residual=e, guard=guard, piece=4)[1])
        return reasons, dict(guard.stats)

    return run_ranks(p, fn)


@pytest.mark.filterwarnings("ignore::gradcomm.compressed.guard.GuardWarning")
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # the planted sum
@pytest.mark.parametrize("p", [2, 3])
@pytest.mark.parametrize("plant, reason", [("nan_input", "nonfinite"),
                                           ("nan_residual", "nonfinite"),
                                           ("big_input", "over_bound"),
                                           ("sum_overflows", "nonfinite"), ("", None)])
def test_the_guard_rides_on_the_payload_and_every_rank_decides_alike(p, plant, reason):
    """The guard's flags travel with the last piece: one rank's non-finite input or
    residual, or its runaway residual, gives the same decision on every rank, counted in
    every rank's stats (each rank warns: GuardWarning); so does a sum that overflows float16
    from finite inputs, which no rank's residual shows; a clean step gives None."""
    for reasons, stats in _guarded(p, plant):
        assert reasons == [None, reason]
        assert stats["guard_resets"] == (reason is not None)


@pytest.mark.parametrize("votes, pieced", [((1.0, 1.0), True), ((0.0, 0.0), False),
                                           ((1.0, 0.0), True), ((0.0, 1.0), True)])
def test_the_cut_is_timed_both_ways_then_voted_alike_on_every_rank(votes, pieced):
    """p = 2: after an untimed run, runs alternate whole / pieced (the same number of
    library calls on both ranks), then each rank's vote (planted here through its
    timings) rides with the payload and both ranks take the same cut for good (a tie
    keeps the pieces); the bytes are the same whichever cut a run takes."""
    n, piece = 10, 4
    xs = _inputs(2, n)
    wanted = _summed16(xs, "fp16")
    runs = 2 * cast.TRIALS + 4

    def fn(t):
        cut, calls, outs = cast.Cut(t.size, n, piece), [], []
        start = t.native_allreduce_start

        def counted(*a, **k):
            calls[-1] += 1
            return start(*a, **k)

        t.native_allreduce_start = counted
        for run in range(runs):
            if run == 2 * cast.TRIALS + 1:          # this rank's timings: its vote
                fast, slow = [1.0] * cast.TRIALS, [2.0] * cast.TRIALS
                cut.trials = [slow, fast] if votes[t.rank] else [fast, slow]
            calls.append(0)
            out, _ = cast.allreduce(t, xs[t.rank].copy(), compressors.get("fp16"), None,
                                    "u", cut=cut)
            outs.append(out.tobytes())
        return calls, cut.pieced, outs

    trials = [3 if r % 2 == 0 else 1 for r in range(1, 2 * cast.TRIALS + 1)]
    after = [3 if pieced else 1] * 2
    for calls, decided, outs in run_ranks(2, fn):
        assert calls == [3, *trials, 3, *after]
        assert decided is pieced
        assert set(outs) == {wanted.tobytes()}


def test_the_cut_is_not_measured_where_it_could_change_the_bytes_or_there_is_one_piece():
    """At p > 2 (the library's order of additions may follow the cut) and for a unit of
    one piece, pieces from the start: no trials, no vote."""
    assert cast.Cut(3, 10, 4).pieced is True and cast.Cut(2, 4, 4).pieced is True
    c = cast.Cut(3, 10, 4)
    sizes = [c.size() for c.runs in range(2 * cast.TRIALS + 3)]
    assert sizes == [4] * (2 * cast.TRIALS + 3) and c.vote() == 0.0


@pytest.mark.parametrize("codec", ["fp16", "bf16"])
def test_the_guard_scale_is_the_input_norm_taken_in_the_codecs_pass(codec):
    """With the residual fused into the encode, the input's norm is taken in the same
    pass: the guard's recorded scale is, bit for bit, the sum over the pieces of their
    ``sq_norm`` (what a separate pass gave), not the residual's or the result's."""
    from gradcomm.compressed.guard import Guard, sq_norm

    n, piece = 10007, 4096
    xs = _inputs(2, n)

    def fn(t):
        guard, e = Guard(), xs[t.rank] * np.float32(1e-3)
        x = xs[t.rank].copy()
        out, reason = cast.allreduce(t, x, compressors.get(codec), None, "u", residual=e,
                                     guard=guard, piece=piece)
        return guard._scale["u"], reason

    for r, (scale, reason) in enumerate(run_ranks(2, fn)):
        want = 0.0
        for a, b in cast.pieces(n, piece):
            want += sq_norm(xs[r][a:b])
        assert reason is None and scale == want, r


def test_cast_allreduce_without_feedback_leaves_no_residual():
    xs = _inputs(2, 33)

    def fn(t):
        ef = ErrorFeedback(enabled=False)
        cast.allreduce(t, xs[t.rank].copy(), compressors.get("bf16"), ef, "u")
        return sorted(ef.names())

    assert run_ranks(2, fn) == [[], []]


def test_the_cast_route_only_where_the_transport_prefers_the_library():
    """Not on the in-process transport as it is (it prefers gradcomm's algorithms); on one
    declared to prefer its library: fp16 and bf16 host float32 units of several ranks
    only, not other codecs, float64 or device units, or one rank."""
    x = np.zeros(4, np.float32)
    fp16, bf16, int8 = (compressors.get(c) for c in ("fp16", "bf16", "int8"))

    def fn(t):
        plain = (cast.wire_dtype(t, fp16, x), cast.wire_dtype(t, int8, x))
        t.native_preferred = True
        return plain, [cast.wire_dtype(t, c, a) for c, a in (
            (fp16, x), (bf16, x), (int8, x), (None, x), (fp16, x.astype(np.float64)),
            (fp16, torch.zeros(4)))]

    assert run_ranks(2, fn) == [((None, None), ["float16", "bfloat16", None, None, None,
                                                None])] * 2

    def one(t):
        t.native_preferred = True
        return cast.wire_dtype(t, fp16, x)

    assert run_ranks(1, one) == [None]


@pytest.mark.timeout(150)
@pytest.mark.parametrize("p", [2, 3])
def test_fp16_and_bf16_hooks_on_gloo_sum_the_payload_with_gloo(p):
    """Real gloo processes: fp16/bf16 with algorithm="auto" take the cast route; results
    bitwise equal to an independent replay of the 16-bit sum at p = 2 (within a rounding
    per addition at p = 3), residuals exact, no gradcomm messages (tests/integrations/
    scripts/ddp_checks.py, check_cast)."""
    run = torchrun(CHECKS, p, "cast", timeout=140)
    info = run.clean_results(p)[0]["info"]
    assert len(info["cast"]) == 2, info
