"""The planned gathered route in pieces (``gradcomm.compressed.planned_pipeline``): on real
thread ranks, over several error-feedback steps (the first updating the store, the later
ones with the residual in the codec's pass), the same result and residual bytes as the
one-piece plan, for int8 and onebit, p = 2, 3, 5, counts that no piece or bucket divides,
numpy and numba kernels; the guard's flags on the last piece decide alike on every rank;
a corrupt piece is a PayloadError on every rank with nothing left in flight; an absent
peer is a DeadlineError; what does not pipeline."""

from __future__ import annotations

import numpy as np
import pytest

from gradcomm import compressors
from gradcomm.bench.data import gaussian_input
from gradcomm.comm import run_ranks
from gradcomm.compressed.guard import Guard
from gradcomm.compressed.planned import plan_gather
from gradcomm.compressed.planned_pipeline import plan_pipeline
from gradcomm.error_feedback import ErrorFeedback
from gradcomm.errors import DeadlineError, PayloadError

STEPS = 3


def _steps(t, g, n: int, guard: Guard | None = None, plant: str = "",
           src: bool = False) -> list:
    """Results, guard decisions and bytes sent per step, and the final residual;
    ``src``: the input handed as ``src=`` (the result then lands in a buffer of NaNs,
    and the input must come back untouched)."""
    state, outs = ErrorFeedback(), []
    for s in range(STEPS):
        x = gaussian_input(t.rank + 7 * s, n, "float32")
        if s == 1 and t.rank == 1 and plant == "nan_input":
            x[n // 2] = np.nan
        if s == 1 and t.rank == 1 and plant == "big_input":
            x *= 1e4
        if guard is not None:
            guard.observe("w", x)
        sent = t.stats.bytes_sent
        e = state._residuals.get("w") if s else None     # fused from step 1 (reset: none)
        if src:
            keep = x.copy()
            y, why = g.run(t, np.full(n, np.nan, np.float32), s, state, guard=guard,
                           residual=e, src=x)
            assert x.tobytes() == keep.tobytes()
        else:
            y, why = g.run(t, x, s, state, guard=guard, residual=e)
        if why is not None:
            state.reset("w")                        # the caller's part of the decision
        outs.append((y.copy(), why, t.stats.bytes_sent - sent))
    return [outs, state._residuals["w"].copy()]


def _both(p: int, n: int, name: str, options: dict, piece: int, guarded: bool = False,
          plant: str = "", src: bool = False) -> list:
    def fn(t):
        codec = compressors.get(name, **options)
        whole = plan_gather(t, codec, n, "w", seed=3, feedback=True)
        cut = plan_pipeline(t, codec, n, "w", seed=3, feedback=True, piece=piece)
        assert whole is not None and cut is not None and len(cut.pieces) > 2
        g1, g2 = (Guard(bound=10.0), Guard(bound=10.0)) if guarded else (None, None)
        return _steps(t, whole, n, g1, plant), _steps(t, cut, n, g2, plant, src)

    return run_ranks(p, fn, timeout=120)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("p,n,name,options,piece", [
    (2, 1000, "int8", {"bucket_size": 64}, 128), (3, 777, "int8", {"bucket_size": 64}, 200),
    (5, 1001, "onebit", {"bucket_size": 64}, 64), (2, 3001, "int8", {"bits": 4,
                                                                     "bucket_size": 16}, 500),
    (2, 200_003, "onebit", {}, 1 << 16), (3, 200_003, "int8", {}, 70_000)])
@pytest.mark.parametrize("src", [False, True])
def test_pieces_keep_the_one_piece_bytes(p, n, name, options, piece, src) -> None:
    """200 003 elements in pieces of >= 65 536 run numba's fused kernels. ``src``: the
    pieces read the input where it lies and decode into another buffer."""
    for whole, cut in _both(p, n, name, options, piece, src=src):
        (w, ew), (c, ec) = whole, cut
        for s in range(STEPS):
            assert c[s][0].tobytes() == w[s][0].tobytes(), s
        assert ec.tobytes() == ew.tobytes()


@pytest.mark.timeout(120)
@pytest.mark.filterwarnings("ignore::gradcomm.compressed.guard.GuardWarning")
@pytest.mark.parametrize("plant, reason", [("nan_input", "nonfinite"),
                                           ("big_input", "over_bound"), ("", None)])
def test_the_guard_rides_on_the_last_piece(plant: str, reason: str | None) -> None:
    for p in (2, 3):
        for whole, cut in _both(p, 3000, "int8", {"bucket_size": 64}, 256, guarded=True,
                                plant=plant):
            assert [why for _, why, _ in cut[0]] == [None, reason, None], (p, plant)
            assert [why for _, why, _ in whole[0]] == [None, reason, None]


@pytest.mark.timeout(60)
def test_a_corrupt_piece_raises_on_every_rank_and_leaves_nothing_in_flight() -> None:
    n = 3000

    def fn(t):
        codec = compressors.get("onebit", bucket_size=64)
        cut = plan_pipeline(t, codec, n, "w", seed=0, feedback=False, piece=512)
        mid = cut.pieces[2][2]
        real = mid.write

        def bad(frame, *a, **kw):
            views = real(frame, *a, **kw)
            frame[:mid.head] = 0                  # not the plan's prefix, not a frame
            return views

        if t.rank == 1:
            mid.write = bad
        x = gaussian_input(t.rank, n, "float32")
        try:
            cut.run(t, x.copy(), 0, None)
            first = "none raised"
        except PayloadError as exc:
            first = str(exc)
        mid.write = real
        return first, cut.run(t, x.copy(), 0, None)[0]

    res = run_ranks(2, fn, timeout=50)
    ok = run_ranks(2, lambda t: plan_gather(t, compressors.get("onebit", bucket_size=64), n,
                                            "w", seed=0, feedback=False).run(
        t, gaussian_input(t.rank, n, "float32"), 0, None)[0])
    for (first, y), want in zip(res, ok):
        assert "rank 1's payload" in first, first
        assert y.tobytes() == want.tobytes()


@pytest.mark.timeout(60)
def test_an_absent_peer_is_a_deadline_error() -> None:
    def fn(t):
        t.timeout = 1.0
        if t.rank == 1:
            return "absent"
        cut = plan_pipeline(t, compressors.get("int8"), 5000, "w", seed=0, feedback=False,
                            piece=1024)
        try:
            cut.run(t, gaussian_input(0, 5000, "float32"), 0, None)
        except DeadlineError as exc:
            return type(exc).__name__
        return "no error"

    assert run_ranks(2, fn, timeout=30) == ["DeadlineError", "absent"]


def test_what_does_not_pipeline() -> None:
    def fn(t):
        def cut(name: str, n: int, **opts):
            return plan_pipeline(t, compressors.get(name, **opts), n, "w", seed=0,
                                 feedback=False, piece=1024)
        return [cut("int8", 1024) is None, cut("int8", 5000, rounding="stochastic") is None,
                cut("topk", 5000) is None, len(cut("int8", 5000).pieces)]

    assert run_ranks(2, fn) == [[True, True, True, 5]] * 2
    assert run_ranks(1, lambda t: plan_pipeline(t, compressors.get("int8"), 5000, "w",
                                                seed=0, feedback=False, piece=1024)) == [None]
