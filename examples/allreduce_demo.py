"""A short tour of gradcomm.allreduce: one gradient, every compressor, four ranks.

    python examples/allreduce_demo.py              # in-process ranks (threads)
    mpirun -n 4 python examples/allreduce_demo.py  # real MPI ranks

Every rank holds its own "gradient" (1M float32). For each compressor the ranks average
them with ``gradcomm.allreduce(..., op="mean")`` and the demo prints the bytes each rank
sent, the compression ratio against the dense allreduce, the relative error against the
exact mean, and whether every rank ended with the same bytes.
"""

from __future__ import annotations

import argparse
import hashlib
import os

import numpy as np

import gradcomm
from gradcomm.comm import Transport, get_transport, run_ranks

CODECS = [("none", {}), ("fp16", {}), ("bf16", {}), ("int8", {}), ("qsgd", {}),
          ("terngrad", {}), ("onebit", {}), ("topk", {"ratio": 0.01}),
          ("randomk", {"ratio": 0.01})]


def demo(t: Transport, n: int) -> list[tuple[str, int, float, str]]:
    """Average one gradient with every codec; per codec (name, bytes sent, error, digest)."""
    g = np.random.default_rng(t.rank).standard_normal(n).astype(np.float32)
    exact = np.mean([np.random.default_rng(r).standard_normal(n).astype(np.float32)
                     .astype(np.float64) for r in range(t.size)], axis=0)
    rows = []
    for name, opts in CODECS:
        t.stats.reset()
        compressor = None if name == "none" else name
        y = gradcomm.allreduce(g, t, op="mean", compressor=compressor, **opts)
        err = float(np.linalg.norm(y - exact) / np.linalg.norm(exact))
        rows.append((name + "".join(f" {k}={v}" for k, v in opts.items()),
                     t.stats.bytes_sent, err, hashlib.sha1(y.tobytes()).hexdigest()[:12]))
    return rows


def report(per_rank: list[list[tuple[str, int, float, str]]]) -> None:
    p = len(per_rank)
    dense = per_rank[0][0][1]
    print(f"gradcomm.allreduce of 1M float32 on {p} ranks (op='mean')\n")
    print(f"{'compressor':<20}{'bytes/rank':>12}{'ratio':>8}{'rel.error':>11}  same bytes everywhere")
    for i, (name, sent, err, digest) in enumerate(per_rank[0]):
        same = all(rows[i][3] == digest for rows in per_rank)
        print(f"{name:<20}{sent:>12,}{dense / max(sent, 1):>7.1f}x{err:>11.2e}  {same}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--np", type=int, default=4, help="in-process ranks when not under mpirun")
    ap.add_argument("--count", type=int, default=1 << 20)
    args = ap.parse_args()
    if "OMPI_COMM_WORLD_SIZE" in os.environ or "PMI_SIZE" in os.environ:
        from mpi4py import MPI

        rows = demo(get_transport(MPI.COMM_WORLD), args.count)
        everyone = MPI.COMM_WORLD.gather(rows, root=0)   # demo output only, not library traffic
        if MPI.COMM_WORLD.rank == 0:
            report(everyone)
    else:
        report(run_ranks(args.np, lambda t: demo(t, args.count), timeout=300))


if __name__ == "__main__":
    main()
