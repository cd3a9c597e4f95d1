"""A/B of the gathered route's pipeline (``gradcomm.compressed.pipeline``): error-feedback
allreduces through ``gradcomm.Allreduce`` (the guard on, as the targets table runs them)
with the route cut into K pieces or sent in one shot, beside ``MPI_Allreduce``,
interleaved in one launch.

Each variant is ``CODEC/K`` on the allgather route, or ``CODEC@ALGORITHM`` (e.g.
``onebit@auto``: the route auto takes, the per-hop ring at p = 2) (``K``: pieces, 1 = one shot, ``auto`` = the cost model's
choice; each variant its own ``Allreduce``, so its residuals see the same inputs) or
``MPI_Allreduce``. Every call's result is compared bytewise with the ``CODEC/1`` variant
of the same round (same inputs, same residuals: the pipeline keeps the bytes). Rank 0
prints each variant's mean and best time and the ratio of ``CODEC/1``'s mean (or of the
first variant's) over it::

    python bench/netns.py --rate 1gbit --np 2 -- python bench/gather_ab.py \\
        --size 1e8 --rounds 6 --variants MPI_Allreduce,onebit/1,onebit/16,int8/1,int8/16
    mpirun -n 2 python bench/gather_ab.py --size 64MiB --rounds 10    # shared memory
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

import gradcomm  # noqa: E402
from _ab import float32_count, options, timed, transport  # noqa: E402
from gradcomm.bench.data import gaussian_input  # noqa: E402
from gradcomm.compressed import auto_route, routes  # noqa: E402


def main() -> int:
    a = options(__doc__, "MPI_Allreduce,onebit/1,onebit/16,int8/1,int8/16", warmup=True)
    comm, t = transport()
    n = float32_count(a.size)
    specs = a.variants.split(",")
    reducers = {s: gradcomm.Allreduce(t, op="mean", compressor=s.split("/")[0].split("@")[0],
                                      algorithm=s.split("@")[1] if "@" in s else "allgather")
                for s in specs if s != "MPI_Allreduce"}
    if t.rank == 0:
        for c in sorted({s.split("/")[0].split("@")[0] for s in reducers}):
            pieces = routes.gather_pieces(t, gradcomm.compressors.get(c), n, "float32", 4)
            print(f"# {c}: auto route {auto_route(t, c, n, 'float32')}, model's pieces "
                  f"{pieces}", flush=True)
    times: dict[str, list[float]] = {s: [] for s in specs}
    wrong: list[str] = []
    for step in range(-a.warmup, a.rounds):
        x0 = gaussian_input(t.rank + 2 * step, n, "float32")
        outs: dict[str, np.ndarray] = {}
        for s in specs:
            buf = x0.copy()
            routes.GATHER_PIECES = None     # the model's choice unless the variant names K
            if "/" in s and s.split("/")[1] != "auto":
                routes.GATHER_PIECES = int(s.split("/")[1])
            if s == "MPI_Allreduce":
                took, _ = timed(comm, lambda: comm.Allreduce(MPI.IN_PLACE, buf, MPI.SUM))
            else:
                took, buf = timed(comm, lambda: reducers[s](buf, key="w"))
            if step >= 0:
                times[s].append(took)
            outs[s] = buf
        routes.GATHER_PIECES = None
        for s, out in outs.items():
            base = s.split("/")[0] + "/1"
            if base in outs and not np.array_equal(out.view(np.uint32),
                                                   outs[base].view(np.uint32)):
                wrong.append(s)
    if t.rank == 0:
        means = {s: float(np.mean(v)) for s, v in times.items()}
        for s, v in times.items():
            base = s.split("/")[0] + "/1"
            ref = means.get(base, means[specs[0]])
            print(f"{s:16s} mean {means[s] * 1e3:9.1f} ms  best {min(v) * 1e3:9.1f} ms  "
                  f"{base if base in means else specs[0]}/this {ref / means[s]:5.2f}  "
                  f"MPI_Allreduce/this "
                  f"{means.get('MPI_Allreduce', float('nan')) / means[s]:6.2f}", flush=True)
        print(f"# {n * 4} B, {t.size} ranks, {a.rounds} rounds interleaved; wrong: "
              f"{sorted(set(wrong)) or 'none'}", flush=True)
    t.close()
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
