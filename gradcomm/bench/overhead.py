"""Where the time of one small allreduce goes: ``python -m gradcomm.bench.overhead``.

Times, at one size, each layer that ``gradcomm.allreduce`` stacks on the transport, from
the library's own allreduce up to the full call (with and without the argument check,
``check="first"``, ``auto``), so the per-call Python cost of each layer can be read off as
a difference. Measured like the benchmark (barrier, then each rank's ``perf_counter``; the
median over iterations of the slowest rank). ``--rounds R`` measures the whole list R
times, interleaved, and prints each layer's median over rounds, its best round, and its
ratio to the library's allreduce measured in the same round (timed first and last; the
lower of the two), the figure a busy machine distorts least. Run it under
``mpirun -n 2`` (MPI) or bare (in-process threads)::

    mpirun -n 2 python -m gradcomm.bench.overhead --size 4K --iters 2000 --rounds 5

Example:
    >>> from gradcomm.comm import run_ranks
    >>> rows = run_ranks(2, lambda t: layers(t, 64, iters=3, warmup=1))[0]
    >>> rows[-1][0]
    'gradcomm.allreduce(auto)'
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any, Callable

import numpy as np

from ..comm.base import TAG_DATA, Transport
from ._util import median_slowest_us


def steps(t: Transport, size: int, algorithm: str = "recursive_doubling",
          raw: Callable[[], Any] | None = None,
          extra: list[tuple[str, Callable[[], Any]]] = ()  # type: ignore[assignment]
          ) -> tuple[list[tuple[str, Callable[[], Any]]], Callable[[], None]]:
    """The layers to time, bottom up (``extra`` last, e.g. ``wrap(comm).Allreduce``),
    and a reset for the scratch buffer they reduce."""
    import gradcomm
    from .. import arrays
    from ..collectives import algorithm as get_algorithm
    from ..collectives import dense_allreduce
    from ..collectives._check import agree
    from ..ops import Reducer

    n = max(size // 4, 1)
    x = np.ones(n, np.float32)
    buf, tmp = x.copy(), np.empty_like(x)
    sig = np.zeros(32, np.int64)
    peer = t.rank ^ 1 if (t.rank ^ 1) < t.size else t.rank - 1
    red = Reducer("sum", "float32")
    out: list[tuple[str, Callable[[], Any]]] = []
    if raw is not None:
        out.append(("library allreduce, direct", raw))
    out += [("t.native_allreduce", lambda: t.native_allreduce(buf, "sum", "float32"))]
    if t.fast_native:
        out.append(("t.small_allreduce (256 B, the check's)",
                    lambda: t.small_allreduce(sig, "max", "int64")))
    out += [
        ("t.sendrecv (one exchange)", lambda: t.sendrecv(x, peer, tmp, peer, TAG_DATA)),
        ("t.barrier", t.barrier),
        ("to_flat + from_flat", lambda: arrays.from_flat(*arrays.to_flat(x))),
        ("agree() (the argument check)",
         lambda: agree(t, "allreduce", count=n, dtype="float32", op="sum",
                       algorithm=algorithm)),
        (f"{algorithm}.allreduce (raw)", lambda: get_algorithm(algorithm)(t, buf, red)),
        ("dense_allreduce, check=False",
         lambda: dense_allreduce(t, buf, "sum", "float32", algorithm, check=False)),
        ("dense_allreduce, check=True",
         lambda: dense_allreduce(t, buf, "sum", "float32", algorithm)),
        ("gradcomm.allreduce(native, check=False)",
         lambda: gradcomm.allreduce(x, t, algorithm="native", check=False)),
        ("gradcomm.allreduce(native)", lambda: gradcomm.allreduce(x, t, algorithm="native")),
        (f"gradcomm.allreduce({algorithm}, check=False)",
         lambda: gradcomm.allreduce(x, t, algorithm=algorithm, check=False)),
        (f"gradcomm.allreduce({algorithm})", lambda: gradcomm.allreduce(x, t,
                                                                        algorithm=algorithm)),
        ("gradcomm.allreduce(auto, check=False)",
         lambda: gradcomm.allreduce(x, t, check=False)),
        ("gradcomm.allreduce(auto, check='first')",
         lambda: gradcomm.allreduce(x, t, check="first")),
        ("gradcomm.allreduce(auto)", lambda: gradcomm.allreduce(x, t)),
        *extra,
    ]
    if raw is not None:               # again: the first layer timed also pays warm-up
        out.append(("library allreduce, direct (again)", raw))

    def reset() -> None:
        buf[...] = x

    return out, reset


def layers(t: Transport, size: int, *, iters: int = 1000, warmup: int = 100,
           algorithm: str = "recursive_doubling", raw: Callable[[], Any] | None = None,
           extra: list[tuple[str, Callable[[], Any]]] = ()  # type: ignore[assignment]
           ) -> list[tuple[str, float | None]]:
    """(layer, median µs) from the bottom up; times on rank 0 only.

    ``raw``, if given, is the library's allreduce called directly (e.g. mpi4py's);
    ``extra``: more (name, call) layers, timed after ``gradcomm.allreduce``.
    """
    todo, reset = steps(t, size, algorithm, raw, extra)
    out = []
    for name, fn in todo:
        with np.errstate(over="ignore"):       # buf is summed into itself over and over
            out.append((name, median_slowest_us(t, fn, iters, warmup)))
        reset()
    return out


def main(argv: list[str] | None = None) -> int:
    from ._util import parse_size
    from .launch import detect_launcher

    ap = argparse.ArgumentParser(prog="python -m gradcomm.bench.overhead",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="4K", help="bytes (float32), default 4K")
    ap.add_argument("--iters", type=int, default=1000)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=1,
                    help="measure the whole list this many times, interleaved (default 1)")
    ap.add_argument("--algorithm", default="recursive_doubling")
    ap.add_argument("--np", type=int, default=2, help="in-process ranks when run bare")
    args = ap.parse_args(argv)
    size = parse_size(args.size)

    def run(t: Transport, raw: Callable[[], Any] | None,
            extra: list[tuple[str, Callable[[], Any]]] = ()) -> None:  # type: ignore
        rounds = [layers(t, size, iters=args.iters, warmup=args.warmup,
                         algorithm=args.algorithm, raw=raw, extra=extra)
                  for _ in range(args.rounds)]
        if t.rank != 0:
            return
        import os

        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
        print(f"# {size} B float32 sum, {t.size} ranks, transport {t.name}: median of the "
              f"slowest rank over {args.iters} iterations, {args.rounds} round(s), load "
              f"{load:.2f}")
        # reference of each round: the lower of the first and last layer (the library's
        # allreduce, timed at both ends when given)
        refs = [min(r[0][1], r[-1][1]) for r in rounds]             # type: ignore[type-var]
        print(f"# {'layer':50s} {'median':>9s} {'best':>9s} {'x ' + rounds[0][0][0][:22]:>26s}")
        for i, (name, _) in enumerate(rounds[0]):
            us = [r[i][1] for r in rounds]
            ratio = [r[i][1] / ref for r, ref in zip(rounds, refs) if ref]  # type: ignore
            print(f"{name:52s} {statistics.median(us):9.2f} {min(us):9.2f} "   # type: ignore
                  f"{statistics.median(ratio):26.2f}")

    if detect_launcher() == "mpi":
        from .launch import mpi_world

        from ..integrations.mpi import wrap

        t, MPI, _ = mpi_world()
        x = np.ones(max(size // 4, 1), np.float32)
        out, out2 = np.empty_like(x), np.empty_like(x)
        w = wrap(MPI.COMM_WORLD)
        run(t, lambda: MPI.COMM_WORLD.Allreduce(x, out),
            [("wrap(comm).Allreduce", lambda: w.Allreduce(x, out2))])
    else:
        from ..comm import run_ranks

        run_ranks(args.np, lambda t: run(t, None), timeout=3600.0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
