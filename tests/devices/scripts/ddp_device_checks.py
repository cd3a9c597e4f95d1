"""DDP comm-hook checks of the device path, on every rank of one gloo launch.

``GRADCOMM_CODEC_PLACEMENT=array`` makes the hook treat CPU buckets as device buckets
(codecs on the tensors where they live, residuals as tensors, payload bytes alone
crossing to the host), so the path CUDA buckets take runs on a machine without a GPU.
The variable is read at every bucket, so one process runs both placements:

    python ddp_device_checks.py parity resume groups

Each rank prints ``RESULT {"rank": r, "errors": [...], "info": {...}}``.
"""

from __future__ import annotations

import argparse
import io
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from tests.integrations.scripts.ddp_checks import (CAP, INFO, batch, fail, flat_params,
                                                   loss_of, make_model, run_checks,
                                                   same_everywhere)

import gradcomm
from gradcomm.integrations import ddp as ddp_hook
from gradcomm.integrations.ddp import groups as ddp_groups

#: codecs checked, with options that keep a small model's buckets meaningful
CODECS = {"int8": {"bits": 4}, "onebit": {}, "topk": {"ratio": 0.1, "start_iter": 0}, "fp16": {}}
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def placed(on_device: bool) -> None:
    """Codecs on the tensors (the device path) or staged on the host (the host path)."""
    if on_device:
        os.environ["GRADCOMM_CODEC_PLACEMENT"] = "array"
    else:
        os.environ.pop("GRADCOMM_CODEC_PLACEMENT", None)


def hooked(model, codec: str, algorithm: str, group=None):
    ddp = DDP(model, bucket_cap_mb=CAP, process_group=group)
    state, hook = ddp_hook.make_comm_hook(codec, algorithm=algorithm, model=ddp,
                                          process_group=group, **CODECS.get(codec, {}))
    ddp.register_comm_hook(state, hook)
    return ddp, state


def train(model, opt, steps: int, start: int = 0, dtype=torch.float32) -> None:
    for step in range(start, start + steps):
        opt.zero_grad()
        loss_of(model, batch(step, dtype=dtype)).backward()
        opt.step()


def residual_kinds(state) -> set[str]:
    return {type(v).__module__.split(".")[0] for v in state.residuals._residuals.values()}


def run(codec: str, algorithm: str, on_device: bool, steps: int, dtype=torch.float32):
    """Train ``steps`` steps; (parameters, residual kinds, hook stats)."""
    placed(on_device)
    try:
        model, state = hooked(make_model(dtype), codec, algorithm)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        train(model, opt, steps, dtype=dtype)
        state.flush()
        out = flat_params(model), residual_kinds(state), dict(state.stats)
        state.close()
        return out
    finally:
        placed(False)


# -- checks -------------------------------------------------------------------------------
def check_parity(steps: int = 4) -> None:
    """Device path == host path, bitwise, for each codec: algorithm "allgather" on both,
    and "auto" (the gather route on the device) against the host path's gather route;
    residuals are tensors on the device path; identical parameters on every rank."""
    report = []
    for codec in CODECS:
        gather = "sparse_allgather" if gradcomm.compressors.get(codec).sparse \
            else "allgather"
        pairs = [("allgather", "allgather"), ("auto", gather)]
        if codec in ("int8", "onebit"):          # per hop: hop residuals on the device
            pairs.append(("ring", "ring"))
        for dev_algo, host_algo in pairs:
            dev, kinds, stats = run(codec, dev_algo, True, steps)
            host, host_kinds, _ = run(codec, host_algo, False, steps)
            if not torch.equal(dev, host):
                fail(f"parity {codec}: device {dev_algo} differs from host {host_algo} by "
                     f"{float((dev - host).abs().max()):.3g}")
            if kinds != {"torch"} or host_kinds != {"numpy"}:
                fail(f"parity {codec}/{dev_algo}: residuals {kinds} on the device path, "
                     f"{host_kinds} on the host path (torch / numpy expected)")
            if not same_everywhere(dev):
                fail(f"parity {codec}/{dev_algo}: parameters differ across ranks")
            report.append(f"{codec}/{dev_algo}: {stats['bytes_sent']} B")
    for dt_name, codec in (("float16", "int8"), ("bfloat16", "topk")):
        dt = DTYPES[dt_name]
        dev = run(codec, "auto", True, steps, dt)[0]
        gather = "sparse_allgather" if codec == "topk" else "allgather"
        host = run(codec, gather, False, steps, dt)[0]
        if not torch.equal(dev, host) or not same_everywhere(dev):
            fail(f"parity {dt_name} model {codec}: device and host paths differ, or ranks do")
    INFO["parity"] = report


def check_resume(k: int = 2) -> None:
    """A checkpoint of device residuals (state_dict brings them to the host; torch.save,
    weights_only load) resumes bitwise equal to the unbroken run, on the device path and
    on the host path (the two paths give the same bytes)."""
    # the gathered routes by name: a checkpoint loads only into a hook of its own
    # configuration (algorithm included), and the host path's auto may pick another route
    for codec, algo in (("topk", "sparse_allgather"), ("int8", "allgather"),
                        ("onebit", "allgather")):
        unbroken = run(codec, algo, True, 2 * k)[0]
        placed(True)
        model, state = hooked(make_model(), codec, algo)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        train(model, opt, k)
        buf = io.BytesIO()
        torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                    "hook": state.state_dict()}, buf)
        state.close()
        for on_device in (True, False):
            placed(on_device)
            ck = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
            fresh = make_model(seed=1)
            fresh.load_state_dict(ck["model"])
            model, state = hooked(fresh, codec, algo)
            opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
            opt.load_state_dict(ck["opt"])
            state.load_state_dict(ck["hook"])
            train(model, opt, k, k)
            state.flush()
            kinds = residual_kinds(state)
            state.close()
            got = flat_params(model)
            where = "device" if on_device else "host"
            if not torch.equal(got, unbroken):
                fail(f"resume {codec}/{algo} on the {where} path: differs from the unbroken "
                     f"run by {float((got - unbroken).abs().max()):.3g}")
            if kinds != ({"torch"} if on_device else {"numpy"}):
                fail(f"resume {codec}/{algo} on the {where} path: residuals {kinds}")
    placed(False)


def check_groups() -> None:
    """The NCCL set-up's pieces on gloo: the payload group of a DDP group (the same ranks
    in the same order; a subgroup's made by its members alone) and the library path
    (scale by 1/p, the group's own allreduce in place, bytes counted)."""
    p, me = dist.get_world_size(), dist.get_rank()
    if ddp_groups.payload_backend(str(dist.get_backend())) is not None:
        fail("a gloo group should carry the hook's messages itself")
    groups = [dist.group.WORLD,
              dist.new_group(list(range(p))[::-1], sort_ranks=False)]   # reversed order
    sub = dist.new_group([0, 1]) if p > 2 else None
    if sub is not None and me < 2:
        groups.append(sub)                      # rank 2 never calls host_group for it
    for group in groups:
        h = ddp_groups.host_group(group)
        ranks = dist.get_process_group_ranks(group)
        if str(dist.get_backend(h)) != "gloo" or dist.get_process_group_ranks(h) != ranks \
                or dist.get_rank(h) != dist.get_rank(group):
            fail(f"host group of {ranks}: ranks {dist.get_process_group_ranks(h)}, "
                 f"rank {dist.get_rank(h)} (group rank {dist.get_rank(group)})")
        x = torch.full((3,), 2.0 ** dist.get_rank(group))
        dist.all_reduce(x, group=h)
        if x.tolist() != [2.0 ** len(ranks) - 1] * 3:
            fail(f"host group of {ranks}: all_reduce gave {x.tolist()}")
    state, _ = ddp_hook.make_comm_hook(None)
    state.routes.library = state.transport      # the gloo group stands in for NCCL's
    x = torch.arange(7, dtype=torch.float32) + me
    want = x * (1.0 / p)
    dist.all_reduce(want)
    state._call(lambda: state.routes.library_allreduce(x, "float32", True))
    if not torch.equal(x, want) or state.stats["native_nbytes"] != 28:
        fail(f"library path: {x.tolist()} (expected {want.tolist()}), {state.stats}")
    state.close()


CHECKS = {"parity": check_parity, "resume": check_resume, "groups": check_groups}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("checks", nargs="+", choices=sorted(CHECKS))
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    run_checks(CHECKS, args.checks)


if __name__ == "__main__":
    main()
