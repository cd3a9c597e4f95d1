"""Convergence benchmark: does compressed DDP training reach the uncompressed accuracy?

Trains the same MLP (same initial weights, same data order) once per variant on real
gloo ranks (plain processes on 127.0.0.1) and reports, per task x optimizer x rank count:
final test accuracy and loss, the step at which the test accuracy first reached the
uncompressed run's final accuracy minus ``--tol`` points, the error-feedback residual
norm over time, gradcomm's bytes sent per rank per step and the time per step. A variant
whose loss ends non-finite or above its starting loss is marked diverged.

Variants as in ``bench/train.py`` (``ddp`` = DDP's built-in allreduce, the reference;
``gc-<codec>[:opt=v;...]`` = ``make_comm_hook(codec, **opts)``, ``ef=0`` turns error
feedback off, ``opt=1`` passes the optimizer, ``mc=0`` passes ``optimizer=None``: no
momentum correction and no optimizer watch); every other option after ``:`` goes to
``make_comm_hook``, so mechanisms are switched per variant
(``gc-topk:ratio=0.01;start_iter=0``). PyTorch's own hooks are the references:
``torch-fp16`` (``fp16_compress_hook``) and ``torch-powersgd[:rank=R;start=S]``
(``powerSGD_hook``, ``start_powerSGD_iter=S``, default 10); their bytes are not counted
(B/step 0).

Tasks: ``digits`` (scikit-learn's 8x8 digits, 360 test samples) and ``synthetic``
(``make_classification``, 10 classes, 4800 test samples: one point is 48 samples).
Optimizers: ``sgd`` (momentum 0.9, ``--sgd-lr``) and ``adamw`` (``--adamw-lr``).

Run::

    python bench/converge.py --np 2,4 --tasks digits,synthetic --optims sgd,adamw \\
        --json bench/results/converge.json --md bench/results/converge.md \\
        --plot bench/converge.png
    python bench/converge.py --np 4 --tasks digits --optims sgd \\
        --variants ddp,gc-topk:ratio=0.01,gc-onebit     # one cell, quick
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from train import (TORCH_HOOKS, load_data, make_model,  # noqa: E402  (bench/train.py)
                   parse_variant, register_torch_hook)

DEFAULT_VARIANTS = ("ddp,gc-fp16,gc-bf16,gc-int8,gc-qsgd,gc-terngrad,gc-topk:ratio=0.01,"
                    "gc-topk:ratio=0.001,gc-topk:ratio=0.01;ef=0,gc-randomk:ratio=0.01,"
                    "gc-onebit,gc-powersgd:rank=2")
#: epochs per task (digits at lr 0.1 with momentum is where issue 13 saw the failures)
EPOCHS = {"digits": 15, "synthetic": 3}


# ------------------------------------------------------------------ one training run
def residual_norm(state: Any) -> float:
    """sqrt of the sum of squares of every residual this rank's hook holds (hops too,
    and the Adam route's momentum residuals)."""
    if state is None:
        return 0.0
    return math.sqrt(state.residuals.sq_norm() + state.adam.sq_norm())


#: the tensors of this rank's last collective (see rank_main's end)
_HELD: list[Any] = []


def train_one(v: dict[str, Any], task: str, optim: str, data: Any, args: argparse.Namespace,
              rank: int, world: int) -> dict[str, Any]:
    import numpy as np
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    Xtr, ytr, Xte, yte = data
    model = make_model(args.width, args.depth, args.seed)
    ddp = DDP(model, bucket_cap_mb=args.bucket_mb)
    if optim == "sgd":
        opt: Any = torch.optim.SGD(ddp.parameters(), lr=args.sgd_lr, momentum=0.9)
    else:
        opt = torch.optim.AdamW(ddp.parameters(), lr=args.adamw_lr)
    state: Any = None
    # an option's value "none" is None (clip=none, ramp=none: off)
    kw: dict[str, Any] = {k: None if val == "none" else val for k, val in v["options"].items()}
    if v["kind"] == "gc" and v["codec"] == "onebitadam":     # the optimizer wrapper
        from gradcomm.integrations.onebit_adam import OneBitAdam, onebit_adam_hook

        opt = OneBitAdam(ddp.parameters(), lr=args.adamw_lr,
                         warmup_steps=int(kw.pop("warmup", 100)), **kw)
        ddp.register_comm_hook(opt, onebit_adam_hook)
    elif v["kind"] == "gc":
        from gradcomm.integrations.ddp import make_comm_hook

        codec = None if v["codec"] == "none" else v["codec"]
        if codec is not None:
            kw["error_feedback"] = v["ef"]
        if kw.pop("opt", 0):
            kw["optimizer"] = opt
        if not kw.pop("mc", 1):          # mc=0: no optimizer watch, no momentum correction
            kw["optimizer"] = None
        state, hook = make_comm_hook(codec, algorithm=v["algorithm"], model=ddp, **kw)
        ddp.register_comm_hook(state, hook)
    elif v["kind"] in TORCH_HOOKS:              # PyTorch's own hooks, the references
        register_torch_hook(v, ddp, args.seed)
    elif v["kind"] != "ddp":
        raise ValueError(f"converge.py runs ddp, torch-fp16, torch-powersgd and gc-* "
                         f"variants, not {v['label']!r}")
    lossf = torch.nn.CrossEntropyLoss()
    n, per = len(Xtr), args.batch
    steps = EPOCHS[task] * args.epochs_scale * n // (per * world)
    every = max(1, steps // args.points)
    rng = np.random.default_rng(args.seed)
    order, pos = rng.permutation(n), 0
    curve: list[list[float]] = []
    times: list[float] = []

    def evaluate(step: int) -> None:
        model.eval()
        with torch.no_grad():
            logits = model(Xte)
            acc = float((logits.argmax(1) == yte).float().mean())
            loss = float(lossf(logits, yte))
        model.train()
        norm = torch.tensor([residual_norm(state) ** 2])
        dist.all_reduce(norm)                 # every rank's residuals: sqrt(sum ||e_r||^2)
        curve.append([step, acc, loss, math.sqrt(float(norm))])

    try:
        evaluate(0)
        for step in range(1, steps + 1):
            if pos + per * world > n:
                order, pos = rng.permutation(n), 0
            idx = order[pos + rank * per: pos + (rank + 1) * per]
            pos += per * world
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            lossf(ddp(Xtr[idx]), ytr[idx]).backward()
            opt.step()
            times.append(time.perf_counter() - t0)
            if step % every == 0 or step == steps:
                evaluate(step)
        stats = dict(state.stats) if state is not None else {}
        if v["kind"] == "gc" and v["codec"] == "onebitadam":
            stats = {"bytes_sent": opt.stats["bytes_sent"],
                     **opt.allreduce.guard.stats}
    finally:
        if state is not None:
            state.close()
    nparams = sum(p.numel() for p in model.parameters())
    ring = 2 * (world - 1) / world            # the library's dense steps, ring-equivalent
    mine = torch.tensor([statistics.fmean(times[len(times) // 10:]),
                         (stats.get("bytes_sent", 0) + ring * stats.get("native_nbytes", 0))
                         / steps], dtype=torch.float64)
    parts = [torch.empty(2, dtype=torch.float64) for _ in range(world)]
    dist.all_gather(parts, mine)
    _HELD[:] = [mine, *parts]      # rank_main waits for gloo to let go of them at the end
    gathered = [{"t": float(q[0]), "sent": float(q[1])} for q in parts]
    final = curve[-1]
    diverged = not math.isfinite(final[2]) or final[2] > curve[0][2]
    return {"variant": v["label"], "task": task, "optim": optim, "p": world, "steps": steps,
            "acc": final[1], "loss": final[2], "diverged": diverged, "curve": curve,
            "step_s": max(g["t"] for g in gathered),
            "bytes_per_step": statistics.fmean(g["sent"] for g in gathered),
            "dense_bytes_per_step": 4 * nparams * 2 * (world - 1) / world,
            "stats": {k: val for k, val in stats.items() if isinstance(val, (int, float))}}


def rank_main(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=args.timeout))
    rows = []
    try:
        for task in args.tasks.split(","):
            data = load_data(task, args.seed)
            for optim in args.optims.split(","):
                for text in args.variants.split(","):
                    if text.startswith("gc-onebitadam") and optim != "adamw":
                        continue                     # an Adam wrapper: AdamW cells only
                    row = train_one(parse_variant(text), task, optim, data, args, rank, world)
                    rows.append(row)
                    if rank == 0:
                        print(f"# p={world} {task}/{optim} {text}: acc {100 * row['acc']:.2f} "
                              f"loss {row['loss']:.3f}{' DIVERGED' if row['diverged'] else ''}"
                              f" {1e3 * row['step_s']:.1f} ms/step", flush=True)
        if rank == 0:
            with open(args.out, "w") as f:
                json.dump({"load": os.getloadavg()[0], "rows": rows}, f)
        dist.barrier()
        from gradcomm.integrations.ddp.lifecycle import wait_released
        wait_released(*_HELD)          # before Python frees them (an exit abort otherwise)
    finally:
        dist.destroy_process_group()
    return 0


# ------------------------------------------------------------------ report
def add_reference(rows: list[dict[str, Any]], tol: float) -> None:
    """Per cell, the gap to ``ddp`` and the first step reaching its accuracy - tol."""
    ref = {(r["task"], r["optim"], r["p"]): r for r in rows if r["variant"] == "ddp"}
    for r in rows:
        base = ref.get((r["task"], r["optim"], r["p"]))
        if base is None:
            continue
        r["gap_pts"] = 100 * (r["acc"] - base["acc"])
        target = base["acc"] - tol / 100
        r["steps_to_ref"] = next((s for s, a, *_ in r["curve"] if a >= target), None)
        r["time_ratio"] = r["step_s"] / base["step_s"]


def markdown(rows: list[dict[str, Any]], tol: float, load: str) -> str:
    out = [f"Accuracy gap to `ddp` in points; 'reach': first step at which the test accuracy "
           f"was within {tol:g} point of ddp's final accuracy ('-': never); residual: "
           f"sqrt(sum over ranks ||e||^2) at the end; B/step: bytes sent per rank per "
           f"step, gradcomm's messages plus the hook's dense (start_iter) steps handed to "
           f"the library, ring-equivalent (ddp: the ring-equivalent dense bytes; "
           f"onebitadam: its compressed steps only); time: per step vs ddp in "
           f"the same launch. Load: {load}.", ""]
    cells = sorted({(r["task"], r["optim"], r["p"]) for r in rows})
    for task, optim, p in cells:
        out += [f"**{task}, {optim}, p={p}**", "",
                "| variant | acc % | gap | loss | reach | residual | B/step | time |",
                "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for r in rows:
            if (r["task"], r["optim"], r["p"]) != (task, optim, p):
                continue
            b = r["dense_bytes_per_step"] if r["variant"] == "ddp" else r["bytes_per_step"]
            flag = " **diverged**" if r["diverged"] else ""
            out.append(f"| `{r['variant']}`{flag} | {100 * r['acc']:.2f} | "
                       f"{r.get('gap_pts', 0):+.2f} | {r['loss']:.3f} | "
                       f"{r.get('steps_to_ref') if r.get('steps_to_ref') is not None else '-'}"
                       f"/{r['steps']} | {r['curve'][-1][3]:.3g} | {b / 1e3:.1f} k | "
                       f"{r.get('time_ratio', 1):.2f}x |")
        out.append("")
    return "\n".join(out)


def plot(rows: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = sorted({(r["task"], r["optim"], r["p"]) for r in rows})
    cols = min(4, len(cells))
    nrows = (len(cells) + cols - 1) // cols
    fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 3.4 * nrows), squeeze=False)
    # one colour per variant in every cell, and one legend entry each
    names = list(dict.fromkeys(r["variant"] for r in rows if r["variant"] != "ddp"))
    cmap = plt.get_cmap("tab20")
    colour = {v: cmap(i % 20) for i, v in enumerate(names)}
    colour["ddp"] = "k"
    lines: dict[str, Any] = {}
    for ax, cell in zip(axes.flat, cells):
        ref = 100.0
        for r in rows:
            if (r["task"], r["optim"], r["p"]) == cell:
                s = [c[0] for c in r["curve"]]
                a = [100 * c[1] for c in r["curve"]]
                lines[r["variant"]], = ax.plot(
                    s, a, label=r["variant"].replace("gc-", ""), color=colour[r["variant"]],
                    lw=2.2 if r["variant"] == "ddp" else 1.0)
                if r["variant"] == "ddp":
                    ref = a[-1]
        ax.set_title("%s, %s, p=%d" % cell, fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.set_ylabel("test accuracy %", fontsize=8)
        ax.set_ylim(max(0.0, ref - 20.0), 100)     # the last points, where the gaps are
        ax.tick_params(labelsize=7)
    for ax in list(axes.flat)[len(cells):]:
        ax.axis("off")
    order = [v for v in ["ddp", *names] if v in lines]
    fig.legend([lines[v] for v in order], [v.replace("gc-", "") for v in order],
               loc="lower center", ncol=min(6, len(order)), fontsize=7)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(path, dpi=110)


# ------------------------------------------------------------------ launcher
def launch(args: argparse.Namespace, argv: list[str], p: int, out: str) -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    cmd = [sys.executable, str(Path(__file__).resolve()), *argv, "--_rank", "--_out", out]
    procs = [subprocess.Popen(cmd, env=dict(env, RANK=str(r), WORLD_SIZE=str(p)))
             for r in range(p)]
    try:
        codes = [q.wait(timeout=args.timeout * 60) for q in procs]
    finally:
        for q in procs:
            if q.poll() is None:
                q.kill()
                q.wait()
    return next((c for c in codes if c), 0)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog="python bench/converge.py",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--np", default="2,4", help="rank counts, comma-separated")
    ap.add_argument("--tasks", default="digits,synthetic")
    ap.add_argument("--optims", default="sgd,adamw")
    ap.add_argument("--variants", default=DEFAULT_VARIANTS)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--depth", type=int, default=2)
    ap.add_argument("--batch", type=int, default=32, help="samples per rank per step")
    ap.add_argument("--epochs-scale", type=int, default=1, help="multiplies the epochs")
    ap.add_argument("--sgd-lr", type=float, default=0.1)
    ap.add_argument("--adamw-lr", type=float, default=1e-3)
    ap.add_argument("--bucket-mb", type=float, default=25.0)
    ap.add_argument("--points", type=int, default=30, help="evaluations per run")
    ap.add_argument("--tol", type=float, default=1.0, help="points, for 'reach'")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds per collective")
    ap.add_argument("--json", default=None)
    ap.add_argument("--md", default=None)
    ap.add_argument("--plot", default=None, help="png: accuracy vs step per cell")
    ap.add_argument("--report", default=None,
                    help="no training: merge these --json files (comma-separated) into "
                         "--md / --plot / --json")
    ap.add_argument("--_rank", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--_out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    for text in args.variants.split(","):
        parse_variant(text)
    if args._rank:
        args.out = args._out
        return rank_main(args)
    if args.report:
        docs = [json.loads(Path(f).read_text()) for f in args.report.split(",")]
        return write(args, argv, [r for d in docs for r in d["rows"]],
                     "; ".join(d["load"] for d in docs))
    rows, loads = [], []
    load0 = os.getloadavg()[0]
    for p in map(int, args.np.split(",")):
        out = f"/tmp/converge-{os.getpid()}-{p}.json"
        code = launch(args, argv, p, out)
        if code:
            print(f"converge.py: the p={p} launch exited with {code}", file=sys.stderr)
            return code
        with open(out) as f:
            doc = json.load(f)
        os.unlink(out)
        rows += doc["rows"]
        loads.append(doc["load"])
    load = (f"{load0:.2f} at the start, {', '.join(f'{x:.2f}' for x in loads)} at the end of "
            f"each launch, {os.cpu_count()} cpus")
    return write(args, argv, rows, load)


def write(args: argparse.Namespace, argv: list[str], rows: list[dict[str, Any]],
          load: str) -> int:
    """The table (stdout, ``--md``), ``--json`` and ``--plot`` of ``rows``."""
    add_reference(rows, args.tol)
    text = markdown(rows, args.tol, load)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"argv": argv, "load": load, "rows": rows}, f)
    if args.md:
        Path(args.md).write_text(text + "\n")
    if args.plot:
        plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
