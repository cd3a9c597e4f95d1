"""The hook's Adam route (:mod:`gradcomm.integrations.ddp.adam`) on real gloo ranks.

With Adam/AdamW found (or given), ``make_comm_hook(codec)`` for topk, randomk, onebit and
terngrad runs the user's optimizer as 1-bit Adam: dense steps first, then each rank's
local gradient into Adam's momentum, the variance frozen (never below ``(1 - b2) g**2``)
and the preconditioned momentum averaged through the codec at ``step()``. Checked here,
step by step: every rank holds the same parameters; no bucket is reduced in backward
after the warm-up; ``exp_avg_sq`` is exactly ``max(v, (1 - b2) g**2)``; the optimizer's
own step counter goes on; a run resumed from the hook's and the optimizer's state dicts
is bitwise the unbroken one (the momentum codec's residual is in the hook's checkpoint).
"""

from __future__ import annotations

import copy
import hashlib
import warnings

import pytest

torch = pytest.importorskip("torch")

from gradcomm.comm import run_ranks  # noqa: E402
from gradcomm.integrations.ddp import make_comm_hook  # noqa: E402
from tests._launch import torch_call  # noqa: E402

WARMUP, STEPS, SAVE_AT = 3, 9, 5


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))


def _batch(step: int, rank: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(16, 8, generator=g), torch.randint(0, 3, (16,), generator=g)


def _digest(model) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
    return h.hexdigest()


def _setup(codec: str):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = _model()
    ddp = DDP(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=0.01, weight_decay=0.01)
    state, hook = make_comm_hook(codec, model=ddp, start_iter=WARMUP)
    ddp.register_comm_hook(state, hook)
    return dist.get_rank(), model, ddp, opt, state


def _step(step, rank, model, ddp, opt):
    x, y = _batch(step, rank)
    opt.zero_grad(set_to_none=True)
    torch.nn.functional.cross_entropy(ddp(x), y).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    v = [opt.state[p]["exp_avg_sq"].clone() if p in opt.state else None
         for p in model.parameters()]
    opt.step()
    return grads, v


def train(codec: str) -> dict:
    """Run STEPS steps, checking each; then resume from the state dicts taken after
    SAVE_AT steps and return both ends' digests."""
    rank, model, ddp, opt, state = _setup(codec)
    out = {"digests": [], "buckets": [], "sent": [], "frozen": [], "steps": [],
           "grads_kept": []}
    saved = None
    try:
        for step in range(STEPS):
            buckets, sent = state.stats["buckets"], state.stats["bytes_sent"]
            grads, v = _step(step, rank, model, ddp, opt)
            b2 = opt.param_groups[0]["betas"][1]
            out["buckets"].append(state.stats["buckets"] - buckets)
            out["sent"].append(state.stats["bytes_sent"] - sent)
            out["frozen"].append(step >= WARMUP and all(
                torch.equal(opt.state[p]["exp_avg_sq"],
                            torch.maximum(v0, torch.mul(g, g).mul_(1 - b2)))
                for p, g, v0 in zip(model.parameters(), grads, v)))
            out["steps"].append(int(opt.state[next(model.parameters())]["step"]))
            out["grads_kept"].append(all(torch.equal(p.grad, g)
                                         for p, g in zip(model.parameters(), grads)))
            out["digests"].append(_digest(model))
            if step + 1 == SAVE_AT:
                saved = ({k: v.clone() for k, v in model.state_dict().items()},
                         copy.deepcopy(opt.state_dict()), state.state_dict())
        out["route"] = state.adam.route is not None
    finally:
        state.close()
    params, opt_sd, hook_sd = saved
    rank, model, ddp, opt, state = _setup(codec)
    try:
        model.load_state_dict(params)
        opt.load_state_dict(opt_sd)
        state.load_state_dict(hook_sd)
        for step in range(SAVE_AT, STEPS):
            _step(step, rank, model, ddp, opt)
        out["resumed"] = _digest(model)
    finally:
        state.close()
    return out


@pytest.mark.timeout(240)
@pytest.mark.parametrize("codec", ["onebit", "topk", "randomk", "terngrad"])
def test_adam_route_step_by_step_and_resumed_bitwise(codec):
    a, b = torch_call(train, 2, codec, timeout=200)
    assert a["route"] and b["route"]
    assert a["digests"] == b["digests"]                      # the same model everywhere
    for r in (a, b):
        assert r["resumed"] == r["digests"][-1]              # resumed == unbroken
        assert r["steps"] == list(range(1, STEPS + 1))       # Adam's own counter goes on
        assert all(r["grads_kept"])                          # .grad is back after step()
        # dense warm-up: buckets reduced in backward; then none, the momentum is sent
        assert all(n > 0 for n in r["buckets"][:WARMUP]), r["buckets"]
        assert r["buckets"][WARMUP:] == [0] * (STEPS - WARMUP), r["buckets"]
        assert all(n > 0 for n in r["sent"][WARMUP:]), r["sent"]
        assert r["frozen"] == [False] * WARMUP + [True] * (STEPS - WARMUP)
    # the run is not the dense one: the codec changed the updates after the warm-up
    assert len(set(a["digests"])) == STEPS


def _made(codec: str, make_opt):
    def fn(t):
        w = torch.nn.Parameter(torch.ones(4))
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            state, _ = make_comm_hook(codec, transport=t, optimizer=make_opt([w]))
        try:
            return state.adam.route is not None, [str(x.message) for x in seen]
        finally:
            state.close()
    return run_ranks(1, fn, timeout=30)[0]


def test_the_route_is_taken_for_adam_given_and_refused_where_it_cannot_continue_adam():
    adamw = lambda ps: torch.optim.AdamW(ps, lr=1e-3)                   # noqa: E731
    adam = lambda ps: torch.optim.Adam(ps, lr=1e-3, weight_decay=0.1)   # noqa: E731
    for codec in ("onebit", "topk", "randomk", "terngrad"):
        assert _made(codec, adamw) == (True, []), codec
    assert _made("onebit", adam) == (True, [])
    assert _made("int8", adamw) == (False, [])               # fresh errors: gradients
    taken, said = _made("onebit", lambda ps: torch.optim.Adam(ps, amsgrad=True))
    assert not taken and any("amsgrad" in s for s in said), said


def test_a_checkpoints_adam_group_is_checked_and_redistributed():
    """``checkpoint.restore_adam``: the saved ranks' momentum residuals must agree in
    names, shapes and dtypes (ConfigError, a GradcommError, naming it); at another rank
    count new rank r' takes the sum over the saved ranks r with r mod p' == r' (zeros
    where none), the codec steps rank 0's."""
    import numpy as np

    from gradcomm.errors import ConfigError, GradcommError
    from gradcomm.integrations.ddp.checkpoint import restore_adam

    def entry(vals, step=3):
        return {"adam": {"residual/momentum": torch.tensor(vals, dtype=torch.float32),
                         "step/momentum": torch.tensor([step])}}

    state = {"ranks": [entry([1.0, 2.0]), entry([10.0, 20.0]), entry([100.0, 200.0])]}
    assert restore_adam({"ranks": [{"adam": {}}, {"adam": {}}]}, 2, 0) is None
    same = restore_adam(state, 3, 1)
    assert same["residual/momentum"].tolist() == [10.0, 20.0]
    two = [restore_adam(state, 2, r) for r in (0, 1)]
    assert two[0]["residual/momentum"].tolist() == [101.0, 202.0]
    assert two[1]["residual/momentum"].tolist() == [10.0, 20.0]
    assert int(two[1]["step/momentum"][0]) == 3
    four = restore_adam(state, 4, 3)
    assert four["residual/momentum"].tolist() == [0.0, 0.0]
    assert four["residual/momentum"].dtype == np.float32
    bad = {"ranks": [entry([1.0, 2.0]), entry([1.0, 2.0, 3.0])]}
    with pytest.raises(ConfigError, match="Adam-route residuals differ") as info:
        restore_adam(bad, 2, 0)
    assert isinstance(info.value, GradcommError)
    renamed = {"ranks": [entry([1.0]), {"adam": {"residual/other": torch.ones(1),
                                                  "step/momentum": torch.tensor([3])}}]}
    with pytest.raises(ConfigError, match="differ in names"):
        restore_adam(renamed, 1, 0)
