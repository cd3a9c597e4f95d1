"""Convergence and divergence-guard checks of the DDP hook, on every rank of one launch.

    torchrun-style (RANK/WORLD_SIZE/MASTER_*):
    python converge_checks.py nan train=120@fp16,topk:opt=1,topk:opt=1;ef=0

Checks (each appends to ``errors`` instead of stopping the others):

* ``nan``: a NaN planted in rank 0's batch at step 2; the loop skips a step whose reduced
  gradients are not finite (as AMP's GradScaler does). With the guard (the default) every
  later step is finite on every rank and every rank counted the same reset; with
  ``guard=False`` (the planted fault) every later step is NaN: both are reported.
* ``train=STEPS@CODEC[:opt=v;...],...``: every codec with its defaults trains a small teacher-student task; the final
  loss of each variant is reported next to the uncompressed one (the test judges it).
* ``adam=STEPS@CODEC,...``: the same task with AdamW: uncompressed, each codec through
  ``OneBitAdam(compressor=CODEC)`` (20 dense steps), through the hook's Adam route
  (``make_comm_hook(CODEC, start_iter=20)``, key ``hook:CODEC``) and through its gradient
  route (``optimizer=None``, key ``gradient:CODEC``); final losses reported.

Each rank prints ``RESULT {"rank": r, "errors": [...], "info": {...}}``.
"""

from __future__ import annotations

import json
import math
import sys
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from gradcomm.compressed.guard import GuardWarning
from gradcomm.integrations.ddp import make_comm_hook

ERRORS: list[str] = []
INFO: dict[str, object] = {}
#: the codecs of issue 14 item 1 (ratios a 2.5 k-parameter model can carry)
#: (compressed from the first step: the NaN comes at step 2)
NAN_CODECS = {"topk": {"ratio": 0.05, "start_iter": 0}, "fp16": {},
              "randomk": {"ratio": 0.05, "start_iter": 0}, "int8": {},
              "onebit": {}, "powersgd": {"rank": 1, "start_iter": 0}}


def fail(msg: str) -> None:
    ERRORS.append(f"rank {dist.get_rank()}: {msg}")


def student(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                         nn.Linear(64, 4))


def teacher_data(n: int = 4096):
    """A fixed teacher network's labels on Gaussian inputs (the same on every rank)."""
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(n, 16, generator=g)
    w1, w2 = torch.randn(16, 32, generator=g), torch.randn(32, 4, generator=g)
    y = (torch.tanh(x @ w1) @ w2).argmax(1)
    return x, y


def train(codec, options: dict, steps: int, lr: float = 0.1, nan_step: int = -1,
          batch: int = 32) -> dict:
    """SGD(momentum=0.9) on the teacher task; returns finite flags per step, the final
    loss on the whole set and the hook's stats."""
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = teacher_data()
    model = student()
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=lr, momentum=0.9)
    options = dict(options)
    if options.pop("opt", False):
        options["optimizer"] = opt
    if not options.pop("mc", True):                      # no watch, no momentum correction
        options["optimizer"] = None
    if "ef" in options:
        options["error_feedback"] = bool(options.pop("ef"))
    state, hook = make_comm_hook(codec, model=ddp, **options)
    ddp.register_comm_hook(state, hook)
    lossf = nn.CrossEntropyLoss()
    g = torch.Generator().manual_seed(7)                 # the same order on every rank
    finite = []
    try:
        for step in range(steps):
            idx = torch.randint(0, len(x), (world, batch), generator=g)[rank]
            xb = x[idx].clone()
            if step == nan_step and rank == 0:
                xb[0, 0] = float("nan")
            opt.zero_grad(set_to_none=True)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", GuardWarning)
                lossf(ddp(xb), y[idx]).backward()
            ok = all(bool(torch.isfinite(p.grad).all()) for p in model.parameters())
            finite.append(ok)
            if ok:                                       # what GradScaler does
                opt.step()
        with torch.no_grad():
            loss = float(lossf(model(x), y))
        stats = dict(state.stats)
    finally:
        state.close()
    return {"finite": finite, "loss": loss,
            "resets": stats.get("guard_resets"), "nonfinite": stats.get("guard_nonfinite")}


def train_adam(codec: str | None, steps: int, route: str = "onebitadam", lr: float = 0.01,
               batch: int = 32, warmup: int = 20) -> float:
    """AdamW on the teacher task: uncompressed (``codec`` None), through ``OneBitAdam``
    (``route="onebitadam"``), through the hook's defaults (``route="hook"``: it finds
    AdamW and takes its Adam route, ``warmup`` dense steps) or through the hook's gradient
    route (``route="gradient"``: ``optimizer=None``, Adam's gradients compressed from the
    first step); the final loss."""
    from gradcomm.integrations.onebit_adam import OneBitAdam, onebit_adam_hook

    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = teacher_data()
    model = student()
    ddp = DDP(model)
    state = None
    if codec is not None and route == "onebitadam":
        opt: torch.optim.Optimizer = OneBitAdam(ddp.parameters(), lr=lr, compressor=codec,
                                                warmup_steps=warmup)
        ddp.register_comm_hook(opt, onebit_adam_hook)
    else:
        opt = torch.optim.AdamW(ddp.parameters(), lr=lr)
        if codec is not None:
            kw = {"start_iter": warmup} if route == "hook" else \
                {"start_iter": 0, "optimizer": None}
            state, hook = make_comm_hook(codec, model=ddp, **kw)
            ddp.register_comm_hook(state, hook)
    lossf = nn.CrossEntropyLoss()
    g = torch.Generator().manual_seed(7)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)      # the hook's Adam advice
            for _ in range(steps):
                idx = torch.randint(0, len(x), (world, batch), generator=g)[rank]
                opt.zero_grad(set_to_none=True)
                lossf(ddp(x[idx]), y[idx]).backward()
                opt.step()
        with torch.no_grad():
            return float(lossf(model(x), y))
    finally:
        if state is not None:
            state.close()


def check_adam(codecs: list[str], steps: int) -> None:
    out = {"none": train_adam(None, steps), "initial": initial_loss()}
    for codec in codecs:
        out[codec] = train_adam(codec, steps)
        out["hook:" + codec] = train_adam(codec, steps, route="hook")
        out["gradient:" + codec] = train_adam(codec, steps, route="gradient")
    INFO["adam"] = out


def check_nan() -> None:
    out = {}
    for codec, options in NAN_CODECS.items():
        for guard in (True, False):
            r = train(codec, {**options, "guard": guard}, steps=8, nan_step=2)
            out[f"{codec}/{'guard' if guard else 'off'}"] = r
            later = r["finite"][3:]
            if guard and not all(later):
                fail(f"{codec}: steps after the NaN step not finite: {r['finite']}")
            if guard and not r["resets"]:
                fail(f"{codec}: the guard counted no reset: {r}")
    INFO["nan"] = out


def initial_loss() -> float:
    x, y = teacher_data()
    with torch.no_grad():
        return float(nn.CrossEntropyLoss()(student()(x), y))


def check_train(codecs: list[str], steps: int) -> None:
    out = {"none": train(None, {}, steps)["loss"], "initial": initial_loss()}
    for name in codecs:
        text, _, opts = name.partition(":")
        options = {k: json.loads(v) for k, v in (o.split("=") for o in filter(None,
                                                                             opts.split(";")))}
        r = train(text, options, steps)
        out[name] = r["loss"]
        if not math.isfinite(r["loss"]):
            fail(f"{name}: loss {r['loss']}")
    INFO["train"] = out


def main(argv: list[str]) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    try:
        for name in argv:
            if name == "nan":
                check_nan()
            elif name.startswith("adam="):
                steps, _, codecs = name[len("adam="):].partition("@")
                check_adam(codecs.split(","), int(steps))
            elif name.startswith("train="):
                spec = name[len("train="):]
                steps, _, codecs = spec.partition("@")
                check_train(codecs.split(","), int(steps))
            else:
                fail(f"unknown check {name!r}")
    except Exception as exc:   # noqa: BLE001 - reported, the launch still ends cleanly
        fail(f"{type(exc).__name__}: {exc}")
    print("RESULT " + json.dumps({"rank": dist.get_rank(), "errors": ERRORS, "info": INFO}),
          flush=True)
    from gradcomm.integrations.ddp.lifecycle import end_process_group

    end_process_group()         # not a barrier (bench/RESULTS.md, "Exit aborts")


if __name__ == "__main__":
    main(sys.argv[1:])
