"""gradcomm.comm.torch_teardown on real gloo processes: once ``destroy_process_group`` (or
``end_process_group``) has run, nothing holds the group any more, so gloo's threads have
ended before the interpreter shuts down (bench/RESULTS.md, "Exit aborts").
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests._launch import gloo_threads, require_torch, torch_call, torchrun

SCRIPT = Path(__file__).resolve().parent / "scripts" / "teardown_exit.py"


def _destroyed_after_ddp_and_a_cached_transport(how: str) -> dict:
    """A DDP model (its constructor imports torch._dynamo, and with it
    torch.distributed.nn.functional, whose defaults then name the group) and a
    ``gradcomm.allreduce`` over the default group (a cached transport). The model is left
    in a reference cycle, as a trainer object often holds it, so only the garbage
    collector frees it (switched off here, so that no automatic collection runs before
    the group ends). Then the group is ended ``how``: 'end' (end_process_group) or
    'destroy' (destroy_process_group)."""
    import gc
    import sys

    import numpy as np
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import gradcomm
    from gradcomm.integrations.ddp.lifecycle import end_process_group

    model = DDP(torch.nn.Linear(4, 4))
    total = gradcomm.allreduce(np.arange(5.0) + dist.get_rank())
    functional = sys.modules["torch.distributed.nn.functional"]
    held = functional.broadcast.__defaults__[0] is dist.group.WORLD
    before = gloo_threads()
    gc.disable()
    trainer: list = [model]
    trainer.append(trainer)
    del model, trainer
    if how == "end":
        end_process_group()
    else:
        dist.destroy_process_group()
    after = gloo_threads()
    gc.enable()
    return {"held": held, "before": before, "after": after, "total": total.tolist(),
            "defaults": repr(functional.broadcast.__defaults__)}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["end", "destroy"])
def test_gloo_threads_end_when_the_group_is_destroyed(how: str) -> None:
    require_torch()
    results = torch_call(_destroyed_after_ddp_and_a_cached_transport, 2, how, timeout=100)
    for r in results:
        assert r["total"] == [1.0, 3.0, 5.0, 7.0, 9.0]
        # the two references this module drops were there (torch's default argument)
        assert r["held"], "torch.distributed.nn.functional no longer keeps the group"
        assert "pt_gloo_runloop" in r["before"], r["before"]
        assert not r["after"], r["after"]
        assert r["defaults"] == "(None,)"


@pytest.mark.timeout(120)
def test_a_model_freed_only_by_the_collector_lets_gloo_end_before_shutdown() -> None:
    """The model holds the group past ``end_process_group`` and is cyclic garbage only
    once ``main`` returns: gradcomm's exit handler collects it while Python still runs,
    so no gloo thread is left when the interpreter shuts down."""
    require_torch()
    run = torchrun(SCRIPT, 2, timeout=100)
    at_exit = sorted((json.loads(line[len("AT_EXIT "):]) for line in run.stdout.splitlines()
                      if line.startswith("AT_EXIT ")), key=lambda r: r["rank"])
    assert [r["rank"] for r in at_exit] == [0, 1], run.describe()
    for r, end in zip(run.results(2), at_exit):
        assert r["total"] == [0.0, 2.0, 4.0]
        assert r["before"] and r["after"], r     # the model held the group
        assert not end["threads"], end


def _destroy_a_subgroup() -> dict:
    """Transports over a subgroup and over the default group; the subgroup destroyed:
    only what names the subgroup is let go of."""
    import torch.distributed as dist
    import torch.distributed.nn.functional as functional

    from gradcomm.comm import _CACHE, get_transport

    world = dist.group.WORLD
    functional.broadcast.__defaults__ = (world,)    # as if imported after init
    sub = dist.new_group([0, 1])
    get_transport(sub), get_transport(None)
    before = [c is sub for c, _ in _CACHE.values()], [c is world for c, _ in _CACHE.values()]
    dist.destroy_process_group(sub)
    after = [c is sub for c, _ in _CACHE.values()], [c is world for c, _ in _CACHE.values()]
    return {"before": [any(b) for b in before], "after": [any(a) for a in after],
            "default_kept": functional.broadcast.__defaults__[0] is world}


@pytest.mark.timeout(120)
def test_destroying_a_subgroup_lets_go_of_that_group_only() -> None:
    require_torch()
    for r in torch_call(_destroy_a_subgroup, 2, timeout=100):
        assert r == {"before": [True, True], "after": [False, True], "default_kept": True}


def _destroyed_after_fully_shard() -> dict:
    """Two steps of a ``fully_shard``-ed model with momentum SGD on a cpu mesh, the model
    freed, then the group destroyed. ``fully_shard`` makes its parameters
    ``torch.nn.Parameter``s of DTensors, which leave their device mesh, and the mesh's
    group, in torch's native DTensor sharding cache; the optimizer's steps leave it in
    the redistribution planners and in ``MeshTopoInfo.build_from_mesh``'s cache. Ended
    as gradcomm's scripts end (``end_process_group``), since no gradcomm transport was
    made."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from gradcomm.integrations.ddp.lifecycle import end_process_group

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for _ in range(2):
        model(torch.ones(3, 4)).sum().backward()
        opt.step()
    before = gloo_threads()
    del model, mesh, opt
    end_process_group()
    return {"before": before, "after": gloo_threads()}


@pytest.mark.timeout(120)
def test_gloo_threads_end_after_fully_shard() -> None:
    require_torch()
    for r in torch_call(_destroyed_after_fully_shard, 2, timeout=100):
        assert r["before"] and not r["after"], r
