"""Interleaved timing of small and mid-size dense calls: ``MPI_Allreduce(x, out)``,
``gradcomm.allreduce(x, comm)`` (of ``x`` and, where torch is installed, of a CPU tensor
on ``x``'s memory: "tensor") and ``wrap(comm).Allreduce(x, out)`` (defaults: ``auto``,
checked), optionally beside another version of gradcomm. Run under mpirun::

    mpirun -n 2 python bench/small_ab.py --sizes 4KiB,64KiB,256KiB
    git worktree add /tmp/base <commit>
    mpirun -n 2 python bench/small_ab.py --baseline /tmp/base --sizes 4KiB,64KiB

Each round runs every variant ``--calls`` times in a row (fewer above 8 KiB); a variant's
time is the mean over rounds (the first two dropped: warm-up) of the slowest rank's mean
per call, reported beside ``MPI_Allreduce``'s from the same rounds. float32 sum of
Gaussian data; ``GRADCOMM_PROFILE`` and the rest come from the environment.
"""

from __future__ import annotations

import argparse
import importlib
import os
import shutil
import sys
import tempfile
import time
from typing import Any, Callable

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="4KiB", help="bytes of float32, comma-separated")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--calls", type=int, default=300, help="calls per round at 8 KiB and less")
    ap.add_argument("--baseline", default=None, help="a gradcomm source tree (its root)")
    args = ap.parse_args()

    from mpi4py import MPI

    import gradcomm
    from gradcomm.bench._util import parse_size

    mods: dict[str, Any] = {"": gradcomm}
    if args.baseline:
        tmp = tempfile.mkdtemp(prefix="gradcomm-ab-")
        shutil.copytree(os.path.join(args.baseline, "gradcomm"),
                        os.path.join(tmp, "gradcomm_baseline"))
        sys.path.insert(0, tmp)
        import gradcomm_baseline

        mods = {" new": gradcomm, " base": gradcomm_baseline}
    try:
        import torch
    except ImportError:
        torch = None
    world = MPI.COMM_WORLD
    rng = np.random.default_rng(world.rank)
    if world.rank == 0:
        print(f"# {world.size} ranks, load {os.getloadavg()[0]:.2f}; mean over rounds 3..{args.rounds} "
              "of the slowest rank's mean per call", flush=True)
    for size in (parse_size(s) for s in args.sizes.split(",")):
        x = rng.standard_normal(size // 4).astype(np.float32)
        out = np.empty_like(x)
        tensor = torch.from_numpy(x) if torch is not None else None
        calls: dict[str, Callable[[], Any]] = {"MPI_Allreduce": lambda: world.Allreduce(x, out)}
        for tag, mod in mods.items():
            comm = importlib.import_module(f"{mod.__name__}.integrations.mpi").wrap(world.Dup())
            plain = world.Dup()
            calls[f"allreduce{tag}"] = lambda m=mod, c=plain: m.allreduce(x, c)
            if tensor is not None:
                calls[f"tensor{tag}"] = lambda m=mod, c=plain: m.allreduce(tensor, c)
            calls[f"wrap{tag}"] = lambda c=comm: c.Allreduce(x, out)
        n = max(5, args.calls * 8192 // max(size, 8192))
        times: dict[str, list[float]] = {k: [] for k in calls}
        for _ in range(args.rounds):
            for name, fn in calls.items():
                world.Barrier()
                t0 = time.perf_counter()
                for _ in range(n):
                    fn()
                times[name].append((time.perf_counter() - t0) / n)
        slowest = {k: np.maximum.reduce(world.allgather(np.array(v))) for k, v in times.items()}
        if world.rank == 0:
            base = float(np.mean(slowest["MPI_Allreduce"][2:]))
            print(f"{size:>9d} B  " + "  ".join(
                f"{k} {np.mean(v[2:]) * 1e6:.1f} us ({np.mean(v[2:]) / base:.2f}x)"
                for k, v in slowest.items()), flush=True)


if __name__ == "__main__":
    main()
