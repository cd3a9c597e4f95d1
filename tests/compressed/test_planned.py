"""The gathered route planned once per layout (``gradcomm.compressed.planned``): on real
thread ranks, over several error-feedback steps, the same result and residual bytes as the
exact replay of the allgather route, for int8 and onebit, counts 1, < p, not divisible
by the codec's bucket, and p = 2, 3, 5; a peer frame laid out otherwise goes through the validated
reading (a corrupt one is a PayloadError on every rank); what does not plan."""

from __future__ import annotations

import numpy as np
import pytest

from gradcomm import compressors
from gradcomm.bench.data import gaussian_input
from gradcomm.bench.replay import replay
from gradcomm.comm import run_ranks
from gradcomm.compressed import planned
from gradcomm.error_feedback import ErrorFeedback
from gradcomm.errors import PayloadError

STEPS = 3


def _planned(p: int, n: int, name: str, options: dict, fused: bool = False) -> list:
    """Every rank's results and final residual over STEPS steps; ``fused``: from the
    second step the residual is handed to the plan (``residual=``, the codec's fused
    pass, or its step-by-step twin on the numpy path) instead of compensate/update."""
    def fn(t):
        codec = compressors.get(name, **options)
        g = planned.plan_gather(t, codec, n, "w", seed=3, feedback=True)
        assert g is not None
        state, outs = ErrorFeedback(), []
        for s in range(STEPS):
            x = gaussian_input(t.rank + 7 * s, n, "float32")
            e = state._residuals["w"] if fused and s else None
            outs.append(g.run(t, x, s, state, residual=e)[0].copy())
        return outs, state._residuals["w"].copy()

    return run_ranks(p, fn, timeout=120)


@pytest.mark.parametrize("fused", [False, True], ids=["update", "fused"])
@pytest.mark.parametrize("p,n,name,options", [
    (2, 1, "int8", {}), (3, 2, "int8", {}), (3, 1000, "int8", {"bucket_size": 64}),
    (5, 777, "int8", {"bucket_size": 128}),
    (2, 3000, "int8", {"bits": 4, "rounding": "stochastic", "bucket_size": 256}),
    (3, 513, "int8", {"bits": 2, "rounding": "stochastic", "bucket_size": 64}),
    (2, 70001, "int8", {"rounding": "stochastic"}), (3, 70001, "int8", {}),
    (2, 1, "onebit", {}), (3, 1001, "onebit", {"bucket_size": 64}),
    (2, 70001, "onebit", {})])
def test_planned_gather_is_the_replay(p: int, n: int, name: str, options: dict,
                                      fused: bool) -> None:
    """70001 elements run the numba kernels (the fused pass), the others numpy's."""
    got = _planned(p, n, name, options, fused)
    stores = [ErrorFeedback() for _ in range(p)]
    for s in range(STEPS):
        ref = replay([gaussian_input(r + 7 * s, n, "float32") for r in range(p)],
                     dtype="float32", op="sum", algorithm="allgather", compressor=name,
                     residuals=stores, key="w", seed=3, step=s, **options)
        for r in range(p):
            assert got[r][0][s].tobytes() == ref.tobytes(), (s, r)
    for r in range(p):
        assert got[r][1].tobytes() == stores[r]._residuals["w"].tobytes(), r


def test_a_peer_frame_laid_out_otherwise_is_read_and_checked() -> None:
    """Rank 1's frame differs from the plan in its prefix: every rank reads it through
    Frames. A valid frame (the plan's own bytes, a header byte changed back) decodes to
    the same sum; a corrupt one (the codec name) is a PayloadError on every rank."""
    n = 300

    def fn(t, corrupt):
        codec = compressors.get("int8", bucket_size=64)
        g = planned.plan_gather(t, codec, n, "w", seed=0, feedback=False)
        if t.rank == 1:
            g.prefix = g.prefix.copy()
            at = bytes(g.prefix).find(b"int8")
            g.prefix[at] = ord("x") if corrupt else ord("i")
        x = gaussian_input(t.rank, n, "float32")
        try:
            return g.run(t, x, 0, None)[0].copy()
        except PayloadError as exc:
            return str(exc)

    ref = replay([gaussian_input(r, n, "float32") for r in range(2)], dtype="float32",
                 op="sum", algorithm="allgather", compressor="int8", bucket_size=64)
    for y in run_ranks(2, lambda t: fn(t, False), timeout=60):
        assert y.tobytes() == ref.tobytes()
    for y in run_ranks(2, lambda t: fn(t, True), timeout=60):
        assert isinstance(y, str) and "rank 1's payload" in y, y


def test_what_does_not_plan() -> None:
    def fn(t):
        get = compressors.get
        return [planned.plan_gather(t, get(name, **opts), n, "w", seed=0, feedback=True)
                is None for name, opts, n in (("fp16", {}, 10), ("int8", {"scale": 1.0}, 10),
                                              ("int8", {}, 0), ("int8", {}, 10))]

    assert run_ranks(2, fn) == [[True, True, True, False]] * 2
    assert run_ranks(1, lambda t: planned.plan_gather(
        t, compressors.get("int8"), 10, "w", seed=0, feedback=True)) == [None]


@pytest.mark.filterwarnings("ignore::gradcomm.compressed.guard.GuardWarning")
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # the planted sum
@pytest.mark.parametrize("p", [2, 3])
@pytest.mark.parametrize("name, plant, reason", [
    *((c, plant, why) for c in ("int8", "onebit") for plant, why in (
        ("nan_input", "nonfinite"), ("nan_residual", "nonfinite"),
        ("big_input", "over_bound"), ("", None))),
    ("int8", "sum_overflows", "nonfinite")])
@pytest.mark.parametrize("fused", [False, True], ids=["update", "fused"])
def test_the_guard_rides_on_the_frames_and_every_rank_decides_alike(p, name, plant,
                                                                    reason, fused) -> None:
    """The guard's flags travel in each frame's last bytes: rank 1's non-finite input or
    residual, or its input 10^4 times the last (a residual past the bound), gives the same
    decision on every rank, with no message of the guard's own; so does a sum that
    overflows float32 from finite inputs and residuals (int8: every rank's element 5 at
    3e38, decoded about as it is); a clean step, None. ``fused``: the second step hands
    the residual to the codec's pass (its tally gives the residual's norm)."""
    from gradcomm.compressed.guard import Guard

    n = 300

    def fn(t):
        codec = compressors.get(name)
        g = planned.plan_gather(t, codec, n, "w", seed=3, feedback=True)
        guard, state, reasons = Guard(bound=10.0), ErrorFeedback(), []
        for s in range(2):
            x = gaussian_input(t.rank + 7 * s, n, "float32")
            if s == 1 and t.rank == 1:
                if plant == "nan_input":
                    x[7] = np.nan
                elif plant == "nan_residual":
                    state._residuals["w"][3] = np.inf
                elif plant == "big_input":
                    x *= 1e4
            if s == 1 and plant == "sum_overflows":
                x[5] = 3e38
            guard.observe("w", x)
            sent = t.stats.bytes_sent
            e = state._residuals["w"] if fused and s else None    # the fused pass's tally
            out, why = g.run(t, x, s, state, guard=guard, residual=e)
            reasons.append((why, t.stats.bytes_sent - sent))
        sent = t.stats.bytes_sent
        g.run(t, gaussian_input(t.rank, n, "float32"), 2, state)      # unguarded
        return reasons, guard.stats["guard_resets"], t.stats.bytes_sent - sent

    for reasons, resets, unguarded in run_ranks(p, fn, timeout=60):
        assert [why for why, _ in reasons] == [None, reason]
        assert resets == (reason is not None)
        assert [b for _, b in reasons] == [unguarded] * 2     # no message of its own


@pytest.mark.parametrize("spent, want", [(((2.0, 1.0), (2.0, 1.0)), True),
                                         (((2.0, 1.0), (1.0, 2.0)), False)])
def test_the_ranks_vote_in_the_frames_whether_pieces_pay(spent, want) -> None:
    """At run VOTE_AT each rank votes (its exchange took longer than its codec) in its
    frame's last byte; every rank reads every vote, so all decide alike: pieces pay only
    if every rank waited on the wire. The runs before are timed (not the first)."""
    n = 3000

    def fn(t):
        g = planned.plan_gather(t, compressors.get("int8"), n, "w", seed=0, feedback=False)
        x = gaussian_input(t.rank, n, "float32")
        for _ in range(planned.VOTE_AT):
            g.run(t, x.copy(), 0, None)
        timed = g.spent[0] > 0 and g.spent[1] > 0 and g.pieces_pay is None
        g.spent = list(spent[t.rank])                      # planted timings
        y = g.run(t, x.copy(), 0, None)[0]
        return timed, g.pieces_pay, y.tobytes()

    res = run_ranks(2, fn)
    assert [r[:2] for r in res] == [(True, want)] * 2
    assert res[0][2] == res[1][2]


@pytest.mark.timeout(120)
def test_the_compressed_allreduce_plans_its_gathered_route_per_layout() -> None:
    """``compressed_allreduce`` on host float32 keeps one plan per (key, count, codec,
    seed, feedback) on the transport and runs it from the first call: every step is the replay of the allgather route, residuals
    included; once the ranks vote that pieces pay (planted timings), the layout is cut
    into pieces, with the same bytes."""
    from gradcomm.compressed import compressed_allreduce
    from gradcomm.compressed.planned_pipeline import PipelinedGather

    sizes, steps = {"w": 600_000, "b": 777}, planned.VOTE_AT + 3

    def fn(t):
        state, outs = ErrorFeedback(), []
        for s in range(steps):
            for key, n in sizes.items():
                x = gaussian_input(t.rank + 7 * s, n, "float32")
                outs.append(compressed_allreduce(t, x, "float32", op="sum", algorithm="allgather",
                                                 compressor="int8", residuals=state,
                                                 key=key).copy())
            if s == planned.VOTE_AT - 1:
                for sig, g in t.state.plans.items():
                    if sig[0] == "w":
                        g.spent = [1.0, 0.5]            # the wire took longer than the codec
        kinds = {sig[0]: type(g).__name__ for sig, g in t.state.plans.items()}
        return outs, kinds, {k: state._residuals[k].copy() for k in sizes}

    got = run_ranks(2, fn, timeout=100)
    stores = [ErrorFeedback() for _ in range(2)]
    i = 0
    for s in range(steps):
        for key, n in sizes.items():
            want = replay([gaussian_input(r + 7 * s, n, "float32") for r in range(2)],
                          dtype="float32", op="sum", algorithm="allgather",
                          compressor="int8", residuals=stores, key=key)
            for r in range(2):
                assert got[r][0][i].tobytes() == want.tobytes(), (s, key, r)
            i += 1
    for r in range(2):
        assert got[r][1] == {"w": PipelinedGather.__name__, "b": "PlannedGather"}
        for key in sizes:
            assert got[r][2][key].tobytes() == stores[r]._residuals[key].tobytes()
