"""DGC's sparsity warm-up (``ramp=``): the stages, the defaults, the codec each step uses.

The routes-level check runs real ranks (threads over gradcomm's transport): a ramped
:class:`Routes` must give, step by step, bitwise the results and bytes of plain routes
built with each stage's codec over the same residual store.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from gradcomm import compressors  # noqa: E402
from gradcomm._plan import Reduction  # noqa: E402
from gradcomm.comm import run_ranks  # noqa: E402
from gradcomm.errors import ConfigError  # noqa: E402
from gradcomm.integrations.ddp import make_comm_hook  # noqa: E402
from gradcomm.integrations.ddp.defaults import DENSE_WARMUP, SPARSE_RAMP  # noqa: E402
from gradcomm.integrations.ddp.ramp import DENSITIES, SparsityRamp  # noqa: E402
from gradcomm.integrations.ddp.residuals import ParameterResiduals  # noqa: E402
from gradcomm.integrations.ddp.routes import Routes  # noqa: E402


def test_stages_fall_by_four_from_a_quarter_and_skip_those_not_above_the_target():
    ramp = SparsityRamp(compressors.get("topk", ratio=0.01), stage_steps=3, start=5)
    ratios = [ramp.codec(i).get_config()["ratio"] for i in range(16)]
    assert ratios == [0.01] * 5 + [0.25] * 3 + [0.0625] * 3 + [0.015625] * 3 + [0.01] * 2
    assert ramp.steps == 9 and ramp.codec(10 ** 6) is ramp.target
    tiny = SparsityRamp(compressors.get("randomk", ratio=0.001), stage_steps=1)
    assert [c.get_config()["ratio"] for c in tiny.stages] == list(DENSITIES)
    assert all(c.name == "randomk" for c in tiny.stages)


def test_a_ramp_needs_a_ratio_sparsifier_and_whole_stages():
    for codec, steps in ((compressors.get("int8"), 5), (None, 5),
                         (compressors.get("topk", k=3), 5),
                         (compressors.get("topk"), 0), (compressors.get("topk"), True)):
        with pytest.raises(ConfigError):
            SparsityRamp(codec, steps)


def _resolved(codec, **kw):
    def fn(t):
        state, _ = make_comm_hook(codec, transport=t, **kw)
        try:
            ramp = state.routes.ramp
            return state.start_iter, None if ramp is None else ramp.stage_steps
        finally:
            state.close()
    return run_ranks(1, fn, timeout=30)[0]


def test_top_k_below_one_percent_ramps_after_its_dense_steps_by_default():
    assert DENSE_WARMUP == 150
    assert _resolved("topk", ratio=0.001) == (DENSE_WARMUP, SPARSE_RAMP)
    assert _resolved("topk", ratio=0.001, ramp=None) == (DENSE_WARMUP, None)
    assert _resolved("randomk", ratio=0.001) == (DENSE_WARMUP, None)
    assert _resolved("topk", ratio=0.001, ramp=10, start_iter=7) == (7, 10)
    assert _resolved("topk") == (DENSE_WARMUP, None)
    assert _resolved("randomk") == (DENSE_WARMUP, None)
    assert _resolved("powersgd") == (DENSE_WARMUP, None)
    assert _resolved("int8") == (0, None)
    assert _resolved("onebit") == (0, None)
    with pytest.raises(ConfigError):
        _resolved("int8", ramp=10)


def _reduce_steps(t, ramped: bool, steps: int, n: int = 3001):
    """Per step: the reduced values and bytes sent, through one ramped Routes or through
    a plain Routes per stage sharing one residual store."""
    target = compressors.get("topk", ratio=0.001)
    ramp = SparsityRamp(target, stage_steps=2, start=1)
    residuals = ParameterResiduals(True)

    def routes_for(codec, with_ramp):
        return Routes(t, None, Reduction.configure(algorithm="auto", compressor=codec),
                      residuals, guard=False, ramp=ramp if with_ramp else None)
    one = routes_for(target, True) if ramped else None
    plain: dict[int, Routes] = {}
    rng = np.random.default_rng(11 + t.rank)
    out = []
    for step in range(steps):
        flat = torch.from_numpy(rng.standard_normal(n).astype(np.float32) * (1 + step))
        if ramped:
            r = one
        else:
            codec = ramp.codec(step)
            r = plain.setdefault(id(codec), routes_for(codec, False))
        before = r.stats["bytes_sent"]
        r.reduce(flat, ["a", "b"], [1000, n - 1000], True, step)
        out.append((flat.numpy().tobytes(), r.stats["bytes_sent"] - before))
    return out


def test_a_ramped_hook_reduces_each_step_with_its_stages_codec():
    steps = 11
    for p in (2, 3):
        ramped = run_ranks(p, lambda t: _reduce_steps(t, True, steps), timeout=60)
        plain = run_ranks(p, lambda t: _reduce_steps(t, False, steps), timeout=60)
        for r in range(p):
            assert [v for v, _ in ramped[r]] == [v for v, _ in plain[r]], (p, r)
        # a stage's first step also agrees its shape across the ranks; the second step
        # of each stage: 0.25, 0.0625, 0.015625, 0.0039, then the target 0.001
        sent = [ramped[0][s][1] for s in (2, 4, 6, 8, 10)]
        assert sent == [plain[0][s][1] for s in (2, 4, 6, 8, 10)], p
        assert sent == sorted(sent, reverse=True) and len(set(sent)) == 5, sent
