"""End-to-end DDP training over emulated links: gradcomm hooks vs PyTorch's own.

Trains the same MLP (same initial weights, same data order) once per variant and reports,
per variant: time per step (mean and p50 over the timed steps, slowest rank), bytes each
rank put on its link per step (the emulated NIC's own counter, so every variant is counted
the same way, TCP/IP headers included), final test accuracy and loss, and whether the
replicas ended bitwise identical.

Variants (``--variants``, comma-separated; options after ``:`` separated by ``;``):

* ``ddp`` — DDP's built-in allreduce (gloo), uncompressed: the accuracy reference.
* ``torch-fp16`` — ``default_hooks.fp16_compress_hook``.
* ``torch-powersgd[:rank=2;start=10]`` — ``powerSGD_hook`` (PowerSGDState with that
  matrix_approximation_rank and start_powerSGD_iter).
* ``gc-<codec>[:opt=v;...]`` — ``gradcomm.integrations.ddp.make_comm_hook(codec, **opts)``,
  e.g. ``gc-int8``, ``gc-topk:ratio=0.01``; ``ef=0`` turns error feedback off
  (``gc-topk:ratio=0.01;ef=0`` is the ablation that shows why EF exists); ``alg=ring``
  picks the algorithm; ``gc-none`` is gradcomm without compression. ``start_iter``
  defaults to 0 here, not to the hook's ``"auto"`` (150 dense steps for topk, randomk and
  powersgd), so that every step is compressed: the untimed ones absorb what a compressed
  route does once (numba compiling its kernels into an empty cache, the route's plan, its
  pieces vote), and every timed step is compressed.

After the main variants (on ``--data``) comes the error-feedback ablation: ``ddp``, top-k
1 % with and without EF on ``--ablation`` data (default ``synthetic``; ``none`` skips it).
Every variant is trained ``--repeats`` times (default 3), the variants taking turns
(repeat 1 of every variant, then repeat 2, ...), so a slow phase of the machine lands on
all of them; each row reports the mean step time over the repeats and its spread
(min–max of the repeats' means).
Output: one table per section on rank 0 and, with ``--json``, ``{"args", "rate_bps",
"sections": [{"name", "data", "header", "rows", "runs", "summary", "skipped"}]}``; the
summary reports the variant named in advance (``--report-variant``, default
``gc-topk:ratio=0.01``; never the best of several): its speed-up over ``torch-fp16``
(mean of the repeats' paired ratios, with their min–max; target >= 1.5 at 1 Gbit/s), met
only within 1 accuracy point of ``ddp`` with bitwise-identical replicas; and top-k's
accuracy with minus without EF.

Run (root; the harness makes the namespaces and removes them)::

    python bench/train.py --rate 1gbit                  # every default variant, 2 ranks
    python bench/train.py --rate 10gbit --variants ddp,torch-fp16,gc-topk:ratio=0.01
    python bench/train.py --rate none --steps 40        # no emulation: 127.0.0.1, quick

Ranks are started by Open MPI (``--launcher mpi``, default) or as plain processes
(``--launcher gloo``). Both hook families run on the same transport by default: DDP's
gloo process group over the emulated link (``--hook-transport torch``), so the
comparison is between hooks, not transports; ``--hook-transport mpi`` (with
``--launcher mpi``) moves gradcomm's hooks to MPI.

The data: scikit-learn's digits (1797 8x8 images, 80/20 split; offline), or
``--data synthetic`` (``make_classification``, 64 features, 10 classes, 24000 samples: a
test set of 4800, so one accuracy point is 48 samples rather than 3.6). The model: an MLP
64 -> width (x depth) -> 10; the default 2048 x 2 has 4.35 M parameters, 17.4 MB of float32
gradient per step.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from _train_common import load_data, make_model, parse_options, report, run_steps

HERE = Path(__file__).resolve().parent

DEFAULT_VARIANTS = ("ddp,torch-fp16,torch-powersgd:rank=2;start=10,gc-none,gc-fp16,gc-int8,"
                    "gc-qsgd,gc-terngrad,gc-onebit,gc-randomk:ratio=0.01,gc-topk:ratio=0.01,"
                    "gc-topk:ratio=0.01;ef=0")
#: PyTorch's own DDP hooks, the references (:func:`register_torch_hook`)
TORCH_HOOKS = ("torch-fp16", "torch-powersgd")
#: the error-feedback ablation, run on ``--ablation`` data after the main variants: on
#: digits every variant reaches ~97.5 % (the task is too easy to separate them), on the
#: synthetic task top-k without EF falls ~10 points behind top-k with EF
ABLATION_VARIANTS = "ddp,gc-topk:ratio=0.01,gc-topk:ratio=0.01;ef=0"


# ------------------------------------------------------------------ variants
def parse_variant(text: str) -> dict[str, Any]:
    """``"gc-topk:ratio=0.01;ef=0"`` -> ``{"kind": "gc", "codec": "topk", ...}``.

    Example:
        >>> v = parse_variant("gc-topk:ratio=0.01;ef=0")
        >>> v["kind"], v["codec"], v["options"], v["ef"]
        ('gc', 'topk', {'ratio': 0.01}, False)
        >>> parse_variant("torch-powersgd:rank=4")["options"]
        {'rank': 4}
    """
    name, options = parse_options(text)
    v: dict[str, Any] = {"label": text, "options": options}
    if name == "ddp":
        v["kind"] = "ddp"
    elif name in TORCH_HOOKS:
        v["kind"] = name
    elif name.startswith("gc-"):
        v["kind"], v["codec"] = "gc", name[3:]
        v["ef"] = bool(options.pop("ef", 1))
        v["algorithm"] = str(options.pop("alg", "auto"))
    else:
        raise ValueError(f"unknown variant {name!r}: ddp, torch-fp16, torch-powersgd or "
                         f"gc-<codec>")
    if v["kind"] != "torch-powersgd" and v["kind"] != "gc" and options:
        raise ValueError(f"variant {name!r} takes no options; got {sorted(options)}")
    return v


def hook_options(v: dict[str, Any], args: argparse.Namespace
                 ) -> tuple[str | None, dict[str, Any]]:
    """A ``gc-`` variant's codec and ``make_comm_hook`` options. Compressed from the first
    step (``start_iter=0`` unless the variant sets it): the untimed steps then pay the
    route's one-time costs (numba compiling into an empty cache, the plan, its pieces
    vote), not the timed ones.

    Example:
        >>> import argparse
        >>> a = argparse.Namespace(hook_transport="torch")
        >>> hook_options(parse_variant("gc-topk:ratio=0.01"), a)
        ('topk', {'ratio': 0.01, 'error_feedback': True, 'start_iter': 0})
        >>> hook_options(parse_variant("gc-none"), a)
        (None, {})
    """
    codec = None if v["codec"] == "none" else v["codec"]
    kw: dict[str, Any] = dict(v["options"])
    if codec is not None:
        kw["error_feedback"] = v["ef"]
        kw.setdefault("start_iter", 0)
    if args.hook_transport == "mpi":
        kw["transport"] = "mpi"
    return codec, kw


def register_torch_hook(v: dict[str, Any], ddp: Any, seed: int) -> None:
    """Register PyTorch's own hook of a :data:`TORCH_HOOKS` variant on ``ddp``:
    ``torch-fp16``, or ``torch-powersgd[:rank=R;start=S]`` (``matrix_approximation_rank``
    R, default 1, ``start_powerSGD_iter`` S, default 10, ``random_seed`` ``seed``)."""
    if v["kind"] == "torch-fp16":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        return
    assert v["kind"] == "torch-powersgd", v
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps

    o = v["options"]
    state = ps.PowerSGDState(process_group=None,
                             matrix_approximation_rank=int(o.get("rank", 1)),
                             start_powerSGD_iter=int(o.get("start", 10)),
                             random_seed=seed)
    ddp.register_comm_hook(state, ps.powerSGD_hook)


# ------------------------------------------------------------------ one variant
def train_variant(v: dict[str, Any], args: argparse.Namespace, data, rank: int,
                  world: int) -> dict[str, Any]:
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = make_model(args.width, args.depth, args.seed)
    ddp = DDP(model, bucket_cap_mb=args.bucket_mb)
    state: Any = None           # gradcomm's hook state (PyTorch's hooks: nothing to close)
    if v["kind"] in TORCH_HOOKS:
        register_torch_hook(v, ddp, args.seed)
    elif v["kind"] == "gc":
        from gradcomm.integrations.ddp import make_comm_hook

        codec, kw = hook_options(v, args)
        state, hook = make_comm_hook(codec, algorithm=v["algorithm"], model=ddp, **kw)
        ddp.register_comm_hook(state, hook)

    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9) \
        if args.optim == "sgd" else torch.optim.AdamW(ddp.parameters(), lr=args.adamw_lr)
    lossf = torch.nn.CrossEntropyLoss()
    try:
        ddp.train()
        times, start_bytes, end_bytes = run_steps(ddp, opt, lossf, data, args, rank, world)
        stats = dict(getattr(state, "stats", {}) or {})
    finally:
        if state is not None and hasattr(state, "close"):
            state.close()
    return report(v, args, model, lossf, data, world, times, start_bytes, end_bytes,
                  stats.get("bytes_sent"))


# ------------------------------------------------------------------ report
def merge_runs(runs: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per variant from the repeats (``runs[i]``: repeat i's rows, same variants
    in the same order): means over the repeats, with each repeat's step time kept.

    Example:
        >>> r = lambda s, a: {"variant": "v", "kind": "gc", "step_s_mean": s, "step_s_p50": s,
        ...                   "test_acc": a, "test_loss": 1.0, "train_loss": 1.0,
        ...                   "tx_bytes_per_step": None, "hook_bytes_sent_per_step": None,
        ...                   "replicas_identical": True}
        >>> m = merge_runs([[r(1.0, 0.9)], [r(3.0, 0.7)]])[0]
        >>> m["step_s_mean"], m["step_s_min"], m["step_s_max"], round(m["test_acc"], 3)
        (2.0, 1.0, 3.0, 0.8)
    """
    out = []
    for i, first in enumerate(runs[0]):
        reps = [run[i] for run in runs]
        row = dict(first)
        for k in ("step_s_mean", "step_s_p50", "test_acc", "test_loss", "train_loss",
                  "tx_bytes_per_step", "hook_bytes_sent_per_step"):
            vals = [r[k] for r in reps]
            row[k] = statistics.fmean(vals) if all(v is not None for v in vals) else None
        steps = [r["step_s_mean"] for r in reps]
        row.update(repeats=len(reps), step_s_runs=steps, step_s_min=min(steps),
                   step_s_max=max(steps), test_acc_runs=[r["test_acc"] for r in reps],
                   replicas_identical=all(r["replicas_identical"] for r in reps))
        out.append(row)
    return out


def summarize(rows: list[dict[str, Any]], report_variant: str = "gc-topk:ratio=0.01"
              ) -> dict[str, Any]:
    """Speed-ups vs torch-fp16 and accuracy gaps vs ddp; the target check, on the
    variant named in advance (``report_variant``), with its spread over the repeats
    (each repeat's ratio of the two variants' step times, paired by repeat)."""
    by = {r["variant"]: r for r in rows}
    ref = next((r for r in rows if r["kind"] == "ddp"), None)
    fp16 = next((r for r in rows if r["kind"] == "torch-fp16"), None)
    out: dict[str, Any] = {}
    for r in rows:
        if ref is not None:
            r["acc_gap_pts"] = 100 * (r["test_acc"] - ref["test_acc"])
        if fp16 is not None:
            r["speedup_vs_torch_fp16"] = fp16["step_s_mean"] / r["step_s_mean"]
        if ref is not None:
            r["speedup_vs_ddp"] = ref["step_s_mean"] / r["step_s_mean"]
    named = by.get(report_variant)
    if named is not None and ref is not None and fp16 is not None:
        paired = [f / v for f, v in zip(fp16.get("step_s_runs", [fp16["step_s_mean"]]),
                                        named.get("step_s_runs", [named["step_s_mean"]]))]
        speed = statistics.fmean(paired)
        out["variant"] = report_variant
        out["speedup_vs_torch_fp16"] = speed
        out["speedup_runs"] = {"min": min(paired), "max": max(paired), "n": len(paired)}
        out["acc_gap_pts"] = named["acc_gap_pts"]
        out["target_1_5x_met"] = (speed >= 1.5 and named["acc_gap_pts"] >= -1.0
                                  and named["replicas_identical"])
    elif named is None:
        out["variant"] = f"{report_variant} (not measured)"
    ef, noef = by.get("gc-topk:ratio=0.01"), by.get("gc-topk:ratio=0.01;ef=0")
    if ef and noef:
        out["topk_ef_vs_noef_acc_pts"] = 100 * (ef["test_acc"] - noef["test_acc"])
    return out


def add_link_utilisation(rows: list[dict[str, Any]], rate_bps: float | None) -> None:
    """``row["link_pct"]``: the bytes a rank put on its link per step (NIC counter, else
    the hook's own count) over what the link carries in the mean step time, in percent;
    None without an emulated rate.

    Example:
        >>> rows = [{"step_s_mean": 0.1, "tx_bytes_per_step": 6.25e6,
        ...          "hook_bytes_sent_per_step": None}]
        >>> add_link_utilisation(rows, 1e9); rows[0]["link_pct"]
        50.0
    """
    for r in rows:
        mb = r["tx_bytes_per_step"] if r["tx_bytes_per_step"] is not None else \
            r["hook_bytes_sent_per_step"]
        r["link_pct"] = (mb * 8 / (r["step_s_mean"] * rate_bps) * 100
                         if rate_bps and mb is not None and r["step_s_mean"] else None)


def print_table(rows: list[dict[str, Any]], summary: dict[str, Any], header: str) -> None:
    print(header)
    cols = (f"{'variant':30s} {'step ms':>8s} {'min-max ms':>15s} {'p50 ms':>8s} {'MB/step':>8s} "
            f"{'link %':>6s} {'acc %':>6s} {'Δacc':>6s} {'vs fp16':>7s} {'vs ddp':>7s} "
            f"{'loss':>7s} same")
    print(cols)
    for r in rows:
        mb = r["tx_bytes_per_step"] if r["tx_bytes_per_step"] is not None else \
            r["hook_bytes_sent_per_step"]
        mbs = f"{mb / 1e6:8.2f}" if mb is not None else f"{'-':>8s}"
        link = r.get("link_pct")
        links = f"{link:6.1f}" if link is not None else f"{'-':>6s}"
        spread = f"{1e3 * r.get('step_s_min', r['step_s_mean']):.1f}-" \
                 f"{1e3 * r.get('step_s_max', r['step_s_mean']):.1f}"
        print(f"{r['variant']:30s} {1e3 * r['step_s_mean']:8.1f} {spread:>15s} "
              f"{1e3 * r['step_s_p50']:8.1f} "
              f"{mbs} {links} {100 * r['test_acc']:6.2f} {r.get('acc_gap_pts', 0):+6.2f} "
              f"{_x(r.get('speedup_vs_torch_fp16'))} {_x(r.get('speedup_vs_ddp'))} "
              f"{r['train_loss']:7.4f} "
              f"{'yes' if r['replicas_identical'] else 'NO'}")
    if summary:
        print("# summary: " + json.dumps(summary))


def _x(v: float | None) -> str:
    return f"{v:6.2f}x" if v is not None else f"{'-':>7s}"


# ------------------------------------------------------------------ rank entry point
def rank_main(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    from gradcomm.integrations.ddp.lifecycle import end_process_group

    torch.set_num_threads(1)
    env = os.environ
    if "OMPI_COMM_WORLD_RANK" in env:
        rank, world = int(env["OMPI_COMM_WORLD_RANK"]), int(env["OMPI_COMM_WORLD_SIZE"])
    else:
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    if args.hook_transport == "mpi":
        from mpi4py import MPI  # noqa: F401  (initialise MPI before gloo opens sockets)
    dist.init_process_group("gloo", init_method=f"tcp://{env['MASTER_ADDR']}:"
                            f"{env['MASTER_PORT']}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=args.timeout))
    try:
        known = None
        try:
            from gradcomm import compressors

            known = set(compressors.names())
        except Exception:   # noqa: BLE001 - the baselines still run
            pass
        rate = env.get("GRADCOMM_NET_RATE")
        doc: dict[str, Any] = {"args": vars(args), "rate_bps": int(rate) if rate else None,
                               "sections": []}
        sections = [("main", args.data, args.variants)]
        if args.ablation != "none":
            sections.append(("ef-ablation", args.ablation, ABLATION_VARIANTS))
        for name, data_kind, variants in sections:
            data = load_data(data_kind, args.seed)
            todo, skipped = [], []
            for text in variants.split(","):
                v = _fsdp().parse_fsdp_variant(text) if args.fsdp else parse_variant(text)
                if v["kind"] == "gc" and v["codec"] != "none" and known is not None and \
                        v["codec"] not in known:
                    skipped.append(f"{text} (codec not available yet)")
                    continue
                todo.append(v)
            runs: list[list[dict[str, Any]]] = []
            for rep in range(args.repeats):     # the variants take turns, repeat by repeat
                run = []
                for v in todo:
                    dist.barrier()
                    t0 = time.perf_counter()
                    row = (_fsdp().train_fsdp_variant(v, args, data, rank, world)
                           if args.fsdp else train_variant(v, args, data, rank, world))
                    row["wall_s"] = time.perf_counter() - t0
                    row["repeat"] = rep
                    run.append(row)
                    if rank == 0:
                        print(f"# [{name}] repeat {rep + 1}/{args.repeats} {row['variant']}: "
                              f"{1e3 * row['step_s_mean']:.1f} ms/step, acc "
                              f"{100 * row['test_acc']:.2f} %, {row['wall_s']:.0f} s",
                              flush=True)
                runs.append(run)
            if rank != 0:
                continue
            rows = merge_runs(runs) if todo else []
            add_link_utilisation(rows, int(rate) if rate else None)
            summary = summarize(rows, args.report_variant if name == "main"
                                else "gc-topk:ratio=0.01") if not args.fsdp else \
                _fsdp().summarize_fsdp(rows, args.report_variant)
            header = (f"# bench/train.py [{name}]: {world} ranks, link "
                      f"{(str(int(rate) / 1e9) + ' Gbit/s') if rate else 'not emulated'}, "
                      f"data {data_kind}, MLP 64-{args.width}x{args.depth}-10, batch "
                      f"{args.batch}/rank, {args.steps} steps ({args.warmup} untimed) x "
                      f"{args.repeats} repeats (interleaved), hooks' "
                      f"transport {args.hook_transport}{'; FSDP2' if args.fsdp else ''}; "
                      f"load {os.getloadavg()[0]:.2f} on "
                      f"{os.cpu_count()} cpus")
            print_table(rows, summary, header)
            if skipped:
                print("# skipped: " + ", ".join(skipped))
            doc["sections"].append({"name": name, "data": data_kind, "header": header,
                                    "rows": rows, "runs": runs, "summary": summary,
                                    "skipped": skipped})
            if args.json:     # rewritten after each section: a long run keeps what it has
                with open(args.json, "w") as f:
                    json.dump(doc, f, indent=1)
        end_process_group()     # every rank here, then torn down (bench/RESULTS.md,
    finally:                    # "Exit aborts")
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


# ------------------------------------------------------------------ launcher
def _fsdp():
    sys.path.insert(0, str(HERE))
    import train_fsdp  # bench/train_fsdp.py: the --fsdp variants

    return train_fsdp


def _netns():
    sys.path.insert(0, str(HERE))
    import netns  # bench/netns.py

    return netns


def launch(args: argparse.Namespace, argv: list[str]) -> int:
    child = [sys.executable, str(Path(__file__).resolve()), *argv, "--_rank"]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    if args.launcher == "gloo" and args.hook_transport == "mpi":
        args.hook_transport = "torch"
        child.append("--hook-transport=torch")
    if args.rate != "none":
        netns = _netns()
        why = netns.available()
        if why:
            print(f"train.py: cannot emulate links ({why}); use --rate none", file=sys.stderr)
            return 2
        with netns.Network(args.np, args.rate) as net:
            print(f"# netns: {net.describe()}", flush=True)
            try:
                net.run(child, launcher=args.launcher, timeout=args.timeout * 10, env=env)
            except (RuntimeError, TimeoutError) as e:
                print(f"train.py: {e}", file=sys.stderr)
                return 1
        return 0
    # no emulation: every rank on this host's loopback
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    if args.launcher == "mpi":
        mpirun = os.path.join(os.path.dirname(sys.executable), "mpirun")
        mpirun = mpirun if os.access(mpirun, os.X_OK) else (shutil.which("mpirun") or "mpirun")
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        cmd = [mpirun, "-n", str(args.np), "--oversubscribe", "--bind-to", "none",
               "-x", "MASTER_ADDR", "-x", "MASTER_PORT", "-x", "OMP_NUM_THREADS", *child]
        return subprocess.call(cmd, env=env)
    procs = [subprocess.Popen(child, env=dict(env, RANK=str(r), WORLD_SIZE=str(args.np)))
             for r in range(args.np)]
    codes = [p.wait() for p in procs]
    return next((c for c in codes if c), 0)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog="python bench/train.py", description=__doc__.split("\n")[0])
    ap.add_argument("--rate", default="1gbit", help="emulated link rate (1gbit, 10gbit...) or "
                                                    "'none' for plain loopback")
    ap.add_argument("--np", type=int, default=2)
    ap.add_argument("--launcher", default="mpi", choices=["mpi", "gloo"])
    ap.add_argument("--hook-transport", default="torch", choices=["mpi", "torch"],
                    help="gradcomm hooks' transport: torch (default: DDP's gloo group, the "
                         "same as torch's hooks) or mpi (needs --launcher mpi)")
    ap.add_argument("--variants", default=DEFAULT_VARIANTS)
    ap.add_argument("--repeats", type=int, default=3,
                    help="trainings per variant, interleaved (default 3)")
    ap.add_argument("--report-variant", default="gc-topk:ratio=0.01",
                    help="the gradcomm variant the summary judges (named in advance)")
    ap.add_argument("--data", default="digits", choices=["digits", "synthetic"])
    ap.add_argument("--ablation", default="synthetic", choices=["synthetic", "digits", "none"],
                    help="data of the top-k EF/no-EF ablation run after the main variants")
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--depth", type=int, default=2)
    ap.add_argument("--batch", type=int, default=32, help="samples per rank per step")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=10, help="untimed first steps")
    ap.add_argument("--lr", type=float, default=0.02, help="SGD's (momentum 0.9)")
    ap.add_argument("--optim", default="sgd", choices=["sgd", "adamw"],
                    help="with adamw the gc hook takes its Adam route for topk, randomk, "
                    "onebit and terngrad (100 dense steps first: time after them, "
                    "--warmup 110)")
    ap.add_argument("--adamw-lr", type=float, default=1e-3)
    ap.add_argument("--bucket-mb", type=float, default=25.0, help="DDP bucket_cap_mb")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per collective")
    ap.add_argument("--json", default=None, help="write rows and summary here (rank 0)")
    ap.add_argument("--fsdp", action="store_true",
                    help="FSDP2 (fully_shard) instead of DDP: variants fsdp, fsdp-bf16, "
                         "fsdp-gc-<codec> (bench/train_fsdp.py)")
    ap.add_argument("--_rank", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.fsdp:
        if args.variants == DEFAULT_VARIANTS:
            args.variants = _fsdp().FSDP_VARIANTS
        if args.report_variant == "gc-topk:ratio=0.01":
            args.report_variant = _fsdp().FSDP_REPORT
        args.ablation = "none"
    for text in args.variants.split(","):
        _fsdp().parse_fsdp_variant(text) if args.fsdp else parse_variant(text)  # fail early
    if args.warmup >= args.steps:
        ap.error("--warmup must be smaller than --steps")
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    if args.json:
        args.json = os.path.abspath(args.json)
    if args._rank:
        return rank_main(args)
    return launch(args, [a for a in argv])


if __name__ == "__main__":
    sys.exit(main())
