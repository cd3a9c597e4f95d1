"""Memory bandwidth of this machine for one process and for several at once: the floor of
every memory-bound pass the ranks make (codec passes, the guard's norms, TCP's copies).

Each process streams a float32 array: a read pass (``dot``) and a copy pass (read +
write), median of ``--reps`` passes. With ``--procs 2`` two processes run the same
passes at the same moment (they start together on a barrier, and the report shows that
their timed windows overlapped), as two ranks on a 2-core box do::

    OMP_NUM_THREADS=1 python bench/membw.py --procs 1,2 --mb 100

On the 2-core VM of bench/RESULTS.md one process reads at ~34 GB/s and two at once get
~21 GB/s each: the ranks share one memory system, so a pass that runs while the other
rank streams too takes up to twice as long.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import time
from typing import Any

import numpy as np


def _passes(n: int, reps: int, barrier: Any, out: Any) -> None:
    a = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    b = np.ones_like(a)
    barrier.wait(timeout=120)
    t0 = time.time()
    times = {"read": [], "copy": []}
    for _ in range(reps):
        s = time.perf_counter()
        a.dot(a)
        times["read"].append(time.perf_counter() - s)
        s = time.perf_counter()
        np.copyto(b, a)
        times["copy"].append(time.perf_counter() - s)
    out.put({"start": t0, "end": time.time(),
             "read_s": float(np.median(times["read"])),
             "copy_s": float(np.median(times["copy"]))})


def measure(nbytes: int, procs: int, reps: int = 20) -> list[dict[str, float]]:
    """One row per process: the medians of its read and copy passes over ``nbytes`` (in
    seconds and GB/s; a copy moves ``2 * nbytes``) and its timed window (``start``,
    ``end``, wall clock), all ``procs`` processes started together.

    Example:
        >>> rows = measure(1 << 20, procs=2, reps=3)
        >>> len(rows), all(r["read_gbs"] > 0 for r in rows)
        (2, True)
    """
    n = max(nbytes // 4, 1)
    ctx = mp.get_context("spawn")       # a clean child: no threads or MPI state forked
    barrier, out = ctx.Barrier(procs), ctx.Queue()
    ps = [ctx.Process(target=_passes, args=(n, reps, barrier, out)) for _ in range(procs)]
    for p in ps:
        p.start()
    rows = [out.get(timeout=600) for _ in ps]
    for p in ps:
        p.join(timeout=60)
        if p.exitcode != 0:
            raise RuntimeError(f"a bandwidth process exited with {p.exitcode}")
    for r in rows:
        r["read_gbs"] = 4 * n / r["read_s"] / 1e9
        r["copy_gbs"] = 8 * n / r["copy_s"] / 1e9
    return sorted(rows, key=lambda r: r["start"])


def overlapped(rows: list[dict[str, float]]) -> bool:
    """Whether every process's timed window overlapped every other's (they competed)."""
    return max(r["start"] for r in rows) < min(r["end"] for r in rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=float, default=100.0, help="array size in MB (10^6 B)")
    ap.add_argument("--procs", default="1,2", help="process counts to run, in turn")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    nbytes = int(args.mb * 1e6)
    load = os.getloadavg()[0]
    print(f"# {args.mb:g} MB float32 per process, median of {args.reps} passes, "
          f"{os.cpu_count()} cpus, load {load:.2f}")
    print(f"{'procs':>5s} {'read GB/s each':>15s} {'total':>7s} {'copy GB/s each':>15s} "
          f"{'total':>7s} overlapped")
    report = []
    for procs in (int(p) for p in args.procs.split(",")):
        rows = measure(nbytes, procs, args.reps)
        read = [r["read_gbs"] for r in rows]
        copy = [r["copy_gbs"] for r in rows]
        both = overlapped(rows)
        print(f"{procs:5d} {min(read):7.1f}-{max(read):<7.1f} {sum(read):7.1f} "
              f"{min(copy):7.1f}-{max(copy):<7.1f} {sum(copy):7.1f} "
              f"{'yes' if both else 'NO'}")
        report.append({"procs": procs, "rows": rows, "overlapped": both})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"mb": args.mb, "load": load, "runs": report}, f, indent=1)


if __name__ == "__main__":
    main()
