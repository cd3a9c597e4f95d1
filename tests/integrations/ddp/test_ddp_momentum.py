"""What the hook does once it finds the optimizer (``optimizer="auto"``, the default).

The watch is torch's global optimizer step pre-hook: the first ``step()`` of an optimizer
holding a parameter the hook reduced decides momentum correction (topk, randomk, onebit
with SGD) and TernGrad's error feedback (kept with SGD, dropped with anything else).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from gradcomm.comm import run_ranks  # noqa: E402
from gradcomm.integrations.ddp import make_comm_hook  # noqa: E402


def _found(codec: str, make_opt, watched: bool = True, **kw):
    def fn(t):
        w = torch.nn.Parameter(torch.ones(4))
        other = torch.nn.Parameter(torch.ones(4))
        state, _ = make_comm_hook(codec, transport=t, **kw)
        try:
            if state._watch is not None and watched:
                state._watch.params.add(id(w))       # comm_hook adds a bucket's params
            for p in (w, other):
                p.grad = torch.ones(4)
            torch.optim.SGD([other], lr=0.1, momentum=0.9).step()   # not the hook's
            before = state.routes.momentum
            make_opt([w]).step()
            mc = state.routes.momentum
            return (before is None, None if mc is None else (mc.momentum, mc.undo),
                    state.residuals.enabled,
                    state._watch is not None and state._watch.watching)
        finally:
            state.close()
    return run_ranks(1, fn, timeout=30)[0]


def test_sgd_turns_on_momentum_correction_for_the_sparsifiers_and_onebit():
    sgd = lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)   # noqa: E731
    for codec in ("topk", "randomk", "onebit"):
        assert _found(codec, sgd) == (True, (0.9, 0.9), True, False), codec
    assert _found("int8", sgd) == (True, None, True, False)      # no watch at all
    assert _found("topk", sgd, optimizer=None) == (True, None, True, False)
    assert _found("topk", sgd, watched=False) == (True, None, True, True)   # still waits


def test_terngrad_keeps_error_feedback_with_sgd_only():
    sgd = lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)   # noqa: E731
    rmsprop = lambda ps: torch.optim.RMSprop(ps, lr=1e-3)         # noqa: E731
    assert _found("terngrad", sgd) == (True, None, True, False)
    with pytest.warns(UserWarning, match="error feedback is off"):
        assert _found("terngrad", rmsprop) == (True, None, False, False)
    with pytest.warns(UserWarning, match="not RMSprop"):
        assert _found("topk", rmsprop) == (True, None, True, False)


def test_adam_takes_the_adam_route_silently_for_the_codecs_that_need_it():
    # tests/integrations/ddp/test_ddp_adam.py checks the route itself
    import warnings

    adamw = lambda ps: torch.optim.AdamW(ps, lr=1e-3)             # noqa: E731
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for codec in ("topk", "randomk", "onebit", "terngrad"):
            assert _found(codec, adamw) == (True, None, True, False), codec


def test_an_optimizer_the_hook_cannot_undo_warns_inside_step():
    nesterov = lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True)  # noqa
    with pytest.warns(UserWarning, match="stays off"):
        assert _found("topk", nesterov) == (True, None, True, False)


def test_the_optimizers_momentum_is_undone_step_after_step_in_reused_buffers():
    """``after`` over several steps: out_t - m_opt * out_{t-1} bitwise (float32, as
    formed before buffers were reused), the previous result the last one, for two keys,
    across a reset and a key whose length changes."""
    import numpy as np

    from gradcomm.integrations.ddp.momentum import MomentumCorrection

    rng = np.random.default_rng(3)
    mc = MomentumCorrection(0.9, optimizer_momentum=0.9)
    keys, prev = ["w", "b"], {}
    for step in range(6):
        n = 5 if step < 4 else 3                 # "b" changes length at step 4
        lengths = [7, n]
        out = (rng.standard_normal(7 + n) * 10 ** rng.uniform(-3, 3, 7 + n)).astype(np.float32)
        raw = out.copy()
        if step == 2:
            mc.reset(["w"])
            prev.pop("w")
        mc.after(keys, lengths, out)
        want = raw.copy()
        for k, a, b in (("w", 0, 7), ("b", 7, 7 + n)):
            p = prev.get(k)
            if p is not None and p.size == b - a:
                want[a:b] = raw[a:b] - np.float32(0.9) * p
            prev[k] = raw[a:b].copy()
        assert out.tobytes() == want.tobytes(), step
        state = mc.local_state()["previous"]
        assert {k: v.tobytes() for k, v in state.items()} == \
            {k: v.tobytes() for k, v in prev.items()}, step


def _clip(make_opt, **kw):
    def fn(t):
        w = torch.nn.Parameter(torch.ones(4))
        state, _ = make_comm_hook("randomk", transport=t, **kw)
        try:
            before = state.routes.guard.clip
            if state._watch is not None:
                state._watch.params.add(id(w))
            w.grad = torch.ones(4)
            make_opt([w]).step()
            state.flush()
            return before, state.routes.guard.clip
        finally:
            state.close()
    return run_ranks(1, fn, timeout=30)[0]


def test_random_k_is_clipped_hard_until_no_sgd_momentum_can_amplify_it():
    # ratio 0.25 (the hook's default): 0.1 while an SGD momentum may act on stale mass,
    # 1 once the hook corrects it or finds a non-SGD optimizer
    sgd = lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)   # noqa: E731
    rmsprop = lambda ps: torch.optim.RMSprop(ps, lr=1e-3)         # noqa: E731
    assert _clip(sgd) == (0.1, 1.0)
    with pytest.warns(UserWarning, match="not RMSprop"):
        assert _clip(rmsprop) == (0.1, 1.0)
    assert _clip(sgd, optimizer=None) == (0.1, 0.1)
    assert _clip(sgd, clip=0.3) == (0.3, 0.3)
    assert _clip(sgd, ratio=0.01) == (0.1, 0.1)                 # sqrt(ratio) below 25 %
