"""The divergence guard in gradcomm.Allreduce: a planted NaN on one rank, then clean steps.

Issue 14 item 1: without the guard, one non-finite step on one rank makes every later step
non-finite on every rank (the residuals, hop residuals and PowerSGD's ``Q`` keep it). With
it, the step after is finite on every rank, every rank counted the same reset, and the
ranks still hold the same bytes. ``guard=False`` is the planted fault: the same test body
must then see the poison, so these checks can fail.
"""

from __future__ import annotations

import numpy as np
import pytest

import gradcomm
from gradcomm.comm import run_ranks
from gradcomm.compressed.guard import Guard, GuardWarning, sq_norm
from gradcomm.errors import ConfigError

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.filterwarnings("ignore::gradcomm.compressed.guard.GuardWarning")]

CODECS = {"topk": {"ratio": 0.1}, "fp16": {}, "randomk": {"ratio": 0.1}, "int8": {},
          "onebit": {}, "powersgd": {"rank": 1}}


def _run(codec: str, algorithm: str, p: int, guard: bool, bad=np.nan, bad_rank: int = 0):
    def fn(t):
        ar = gradcomm.Allreduce(t, compressor=codec, algorithm=algorithm, guard=guard,
                                **CODECS[codec])
        rng = np.random.default_rng(t.rank)
        finite, outs = [], []
        for s in range(5):
            x = rng.standard_normal((8, 9)).astype(np.float32)
            if s == 1 and t.rank == bad_rank:
                x[2, 3] = bad
            y = ar(x, key="w")
            finite.append(bool(np.isfinite(y).all()))
            outs.append(y.tobytes())
        stats = dict(ar.guard.stats) if ar.guard is not None else {}
        return finite, outs, stats
    return run_ranks(p, fn)


@pytest.mark.parametrize("codec", sorted(CODECS))
@pytest.mark.parametrize("algorithm, p", [("auto", 3), ("ring", 3), ("allgather", 2),
                                          ("recursive_doubling", 5)])
def test_one_nan_on_one_rank_then_finite_steps_on_every_rank(codec, algorithm, p):
    if codec == "powersgd" and algorithm == "allgather":
        pytest.skip("powersgd has no allgather route")   # its rounds are dense sums
    results = _run(codec, algorithm, p, guard=True)
    for finite, _, stats in results:
        assert finite[0] and all(finite[2:]), finite       # the NaN step itself may be NaN
        assert stats["guard_resets"] == stats["guard_nonfinite"] >= 1, stats
    assert len({str(s) for *_, s in results}) == 1          # the same decision everywhere
    assert len({tuple(o) for _, o, _ in results}) == 1      # the same bytes everywhere


@pytest.mark.parametrize("codec", sorted(CODECS))
def test_without_the_guard_the_nan_poisons_every_later_step(codec):
    """The planted fault: the test above, guard off, sees every later step non-finite."""
    for finite, _, _ in _run(codec, "ring", 3, guard=False):
        assert not any(finite[1:]), finite


def test_inf_and_a_residual_past_the_bound_reset_too():
    for finite, _, stats in _run("topk", "auto", 2, guard=True, bad=np.inf):
        assert all(finite[2:]) and stats["guard_nonfinite"] >= 1
    # a huge but finite spike that onebit cannot carry: the residual passes the bound
    # (1000 x the largest input norm of the earlier steps) and is reset on every rank,
    # rank 0 included
    results = _run("onebit", "auto", 2, guard=True, bad=1e12, bad_rank=1)
    for finite, _, stats in results:
        assert all(finite) and stats["guard_over_bound"] == 1, stats


@pytest.mark.parametrize("codec", ["fp16", "int8", "onebit", "topk"])
def test_on_the_ring_the_residuals_show_a_result_that_overflows(codec, monkeypatch):
    """On the ring with error feedback the guard reads no result (``shown``: each result
    element is a last encode's decoded value, with a residual beside it), yet a result
    that overflows from finite inputs is still caught on every rank: fp16 sums of 40000
    from three ranks pass 65504, the others' of 3e38 pass float32. The step after is
    finite everywhere, and the ring with ``shown`` was really taken (the spy), while
    allgather reads its result."""
    from gradcomm.compressed import guard as guard_mod

    big = 40000.0 if codec == "fp16" else 3e38
    seen = []
    check = guard_mod.Guard.check

    def spy(self, *a, shown=False, **kw):
        seen.append(shown)
        return check(self, *a, shown=shown, **kw)

    monkeypatch.setattr(guard_mod.Guard, "check", spy)

    def fn(t):
        ar = gradcomm.Allreduce(t, op="sum", compressor=codec, algorithm="ring",
                                **CODECS[codec])
        rng = np.random.default_rng(t.rank)
        finite = []
        for s in range(4):
            x = rng.standard_normal(3001).astype(np.float32)
            if s == 1:
                x[1500:1600] = big                 # every rank: finite, the sum is not
            y = ar(x, key="w")
            finite.append(bool(np.isfinite(y).all()))
        return finite, dict(ar.guard.stats)

    res = run_ranks(3, fn)
    for finite, stats in res:
        assert finite[0] and all(finite[2:]), finite
        assert stats["guard_nonfinite"] >= 1, stats
    assert all(seen) and len(seen) == 12, seen
    seen.clear()
    run_ranks(2, lambda t: gradcomm.Allreduce(t, compressor=codec, algorithm="allgather",
                                              **CODECS[codec])(np.ones(5, np.float32)))
    assert seen == [False, False]


def test_guard_warns():
    with pytest.warns(GuardWarning, match="reset on every rank"):
        _run("fp16", "auto", 1, guard=True)


def test_guard_off_paths_and_validation():
    with pytest.raises(ConfigError):
        Guard(bound=0)
    with pytest.raises(ConfigError):
        gradcomm.Allreduce(None, compressor="topk", residual_bound=-1.0)
    assert gradcomm.Allreduce(None, compressor="topk", error_feedback=False).guard is None
    assert gradcomm.Allreduce(None, compressor="powersgd",
                              error_feedback=False).guard is not None   # Q is state
    assert gradcomm.Allreduce(None, compressor="topk", guard=False).guard is None
    assert sq_norm(np.array([3.0, 4.0], np.float32)) == 25.0
    assert sq_norm(np.zeros(0, np.float32)) == 0.0


def test_a_clean_run_is_unchanged_by_the_guard():
    """No reset in a clean run: the same bytes as guard=False, step by step."""
    on = _run("topk", "ring", 3, guard=True, bad=0.5)
    off = _run("topk", "ring", 3, guard=False, bad=0.5)
    assert [o for _, o, _ in on] == [o for _, o, _ in off]
    assert all(s["guard_resets"] == 0 for *_, s in on)


@pytest.mark.parametrize("p", [2, 3])
def test_a_shared_result_is_checked_in_shards_that_cover_it(p):
    """``check(..., same=True)``: each rank looks at its own part of the (identical)
    result; a NaN at any position, with finite residuals everywhere, is still a reset on
    every rank, and no rank lets that step into its scale."""
    n = 7

    def fn(t):
        seen = []
        for i in range(n):
            g = Guard()
            g.observe("w", np.ones(3, np.float32))
            out = np.ones(n, np.float32)
            out[i] = np.nan
            seen.append((g.check(t, "w", [np.zeros(3, np.float32)], out, same=True),
                         dict(g._scale)))
        g = Guard()
        g.observe("w", np.ones(3, np.float32))
        seen.append((g.check(t, "w", [np.zeros(3, np.float32)], np.ones(n, np.float32),
                             same=True), dict(g._scale)))
        return seen

    for seen in run_ranks(p, fn):
        assert seen[:n] == [("nonfinite", {})] * n, seen
        assert seen[n] == (None, {"w": 3.0})


def _tallies(codec: str, algorithm: str, p: int, n: int, kernels: str, monkeypatch,
             bad: float | None = None):
    """(e2 the guard was handed, its own sum over the residuals, result bytes, stats) of
    every step on every rank, kernels ``kernels``."""
    monkeypatch.setenv("GRADCOMM_KERNELS", kernels)

    def fn(t):
        ar = gradcomm.Allreduce(t, compressor=codec, algorithm=algorithm, op="sum",
                                **CODECS[codec])
        seen = []
        check = ar.guard.check

        def spy(t_, key, residuals, out, **kw):
            seen.append((kw.get("e2"), sum(sq_norm(e) for e in residuals)))
            return check(t_, key, residuals, out, **kw)
        ar.guard.check = spy
        rng = np.random.default_rng(t.rank)
        outs = []
        for s in range(3):
            x = rng.standard_normal(n).astype(np.float32)
            if bad is not None and s == 1 and t.rank == 1:
                x[n // 3] = bad
            outs.append(ar(x, key="w").tobytes())
        return seen, outs, dict(ar.guard.stats)
    return run_ranks(p, fn)


@pytest.mark.parametrize("codec, algorithm", [("onebit", "ring"), ("int8", "ring"),
                                              ("fp16", "ring"), ("onebit", "allgather"),
                                              ("topk", "allgather")])
def test_the_codecs_tally_is_the_residual_norm_on_every_kernel_path(codec, algorithm,
                                                                     monkeypatch):
    """Allreduce hands the guard the residuals' norm its codecs tallied in their fused
    pass (numba, arrays of >= FAST_MIN elements) or step by step (numpy): the same value
    on both paths, bit for bit, and the guard's own sum over the residuals up to the
    order of the float64 additions."""
    n = 3 * 70001
    fast = _tallies(codec, algorithm, 2, n, "auto", monkeypatch)
    ref = _tallies(codec, algorithm, 2, n, "numpy", monkeypatch)
    for (seen, outs, _), (seen_ref, outs_ref, _) in zip(fast, ref):
        assert outs == outs_ref
        for (e2, direct), (e2_ref, _) in zip(seen, seen_ref):
            assert e2 is not None and e2 == e2_ref and e2 > 0
            assert e2 == pytest.approx(direct, rel=1e-12)


def test_a_residual_past_the_bound_resets_on_the_fused_path(monkeypatch):
    """The spike test above at a size the numba kernels take (their tally decides)."""
    for seen, _, stats in _tallies("onebit", "ring", 2, 70001 * 2, "auto", monkeypatch,
                                   bad=1e12):
        assert stats["guard_over_bound"] == 1, stats
        assert all(e2 is not None for e2, _ in seen)


@pytest.mark.parametrize("n", [0, 1, 63, 64, 65, 1000, (1 << 16) + 77, 300_001])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("slice_elements", [64, 192, 1 << 16])
def test_the_sliced_norm_is_sq_norm_bit_for_bit(n, dtype, slice_elements):
    """SqNorm (the norm a transport wait takes in slices) gives sq_norm's bits on both
    host kernel paths (numpy below FAST_MIN elements, numba from it), for any slicing, a
    NaN and an inf included; where sq_norm takes another path it is not offered."""
    from gradcomm.compressed.guard import SqNorm

    rng = np.random.default_rng(n)
    a = (rng.standard_normal(n) * np.exp(rng.standard_normal(n) * 4)).astype(dtype)
    for poison in (None, np.nan, np.inf):
        b = a.copy()
        if poison is not None and n:
            b[n // 2] = poison
        job = SqNorm.over(b, slice_elements)
        steps = 0
        while job.step():
            steps += 1
        want = sq_norm(b)
        assert steps == max(0, -(-n // slice_elements) - 1)
        got = job.value()
        assert np.array(got).tobytes() == np.array(want).tobytes(), (got, want)
        alone = SqNorm.over(b, slice_elements).value()     # no slice run before
        assert np.array(alone).tobytes() == np.array(want).tobytes(), (alone, want)
    assert SqNorm.over(np.zeros(3, np.float16)) is None
    assert SqNorm.over(np.zeros((4, 4), dtype).T) is None


def test_a_deferred_norm_gives_the_guard_the_same_state():
    """gradcomm.Allreduce on the sparse route takes the input's norm and the tally of the
    residual while the pairs are exchanged: the guard's scale is each step's exact
    sq_norm of the input, and its tally the residual's exact sq_norm."""
    from gradcomm.compressed import routes

    n = 3 * 70001
    seen = []
    check = Guard.check

    def spy(self, t, key, residuals, out, **kw):
        seen.append((kw.get("e2"), sq_norm(residuals[0])))
        return check(self, t, key, residuals, out, **kw)

    def fn(t):
        ar = gradcomm.Allreduce(t, op="sum", compressor="topk", ratio=0.01)
        inputs = [np.random.default_rng([t.rank, s]).standard_normal(n).astype(np.float32)
                  for s in range(3)]
        for x in inputs:
            ar(x, key="w")
        return ar.guard._scale["w"] == max(sq_norm(x) for x in inputs)

    Guard.check = spy
    try:
        assert run_ranks(2, fn) == [True, True]
    finally:
        Guard.check = check
    assert routes.reads_src(gradcomm.compressors.get("topk", ratio=0.01), "sum",
                            "sparse_allgather")
    assert len(seen) == 6 and all(e2 == want for e2, want in seen), seen
