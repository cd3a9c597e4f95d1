"""A raw mpi4py data-parallel loop, made faster by one line: ``comm = wrap(comm, ...)``.

    mpirun -n 2 python examples/mpi_allreduce.py                      # 64 MiB, ring
    mpirun -n 4 python examples/mpi_allreduce.py --compressor fp16    # half the bytes
    mpirun -n 4 python examples/mpi_allreduce.py --compressor topk --ratio 0.01

Every step each rank produces a gradient-sized float32 buffer and averages it with
``comm.Allreduce(MPI.IN_PLACE, grad, op=MPI.SUM)``, exactly as a hand-written mpi4py
training loop does. The same function runs twice: on ``MPI.COMM_WORLD`` and on
``wrap(MPI.COMM_WORLD, ...)``; nothing else changes. It prints the time per step of
both, the speed-up, and whether the results agree (bitwise without a compressor at two
ranks, where every order of summation gives the same bytes; within the codec's error
otherwise).
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
from mpi4py import MPI

from gradcomm.integrations.mpi import wrap


def train(comm, grad: np.ndarray, steps: int) -> tuple[float, np.ndarray]:
    """The user's loop: ``steps`` averaged gradients; returns (seconds/step, last average)."""
    size = comm.Get_size()
    work = np.empty_like(grad)
    comm.Barrier()
    began = time.perf_counter()
    for step in range(steps):
        np.multiply(grad, np.float32(1 + step), out=work)         # "backward pass"
        comm.Allreduce(MPI.IN_PLACE, work, op=MPI.SUM)
        work /= size
    comm.Barrier()
    return (time.perf_counter() - began) / steps, work


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", type=int, default=1 << 24, help="float32 elements (64 MiB)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--algorithm", default="ring")
    ap.add_argument("--compressor", default=None)
    ap.add_argument("--ratio", type=float, help="kept fraction for topk / randomk")
    args = ap.parse_args()
    options = {} if args.ratio is None else {"ratio": args.ratio}

    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    grad = np.random.default_rng(rank).standard_normal(args.size, dtype=np.float32)

    plain_s, plain = train(world, grad, args.steps)
    comm = wrap(world, algorithm=args.algorithm, compressor=args.compressor, **options)
    ours_s, ours = train(comm, grad, args.steps)          # the one line above is all

    exact = np.array_equal(plain, ours)
    err = float(np.abs(plain - ours).max() / (np.abs(plain).max() or 1.0))
    if rank == 0:
        label = args.algorithm + (f" + {args.compressor}" if args.compressor else "")
        print(f"{world.Get_size()} ranks, {args.size * 4 / 2**20:.0f} MiB per Allreduce, "
              f"{args.steps} steps")
        print(f"  MPI_Allreduce:          {plain_s * 1e3:8.2f} ms/step")
        print(f"  wrap() ({label}): {ours_s * 1e3:8.2f} ms/step   speed-up "
              f"{plain_s / ours_s:.2f}x")
        print(f"  results {'bitwise equal' if exact else f'differ by {err:.2e} (relative)'}")
        print("RESULT " + json.dumps({"ranks": world.Get_size(), "mpi_s": plain_s,
                                      "gradcomm_s": ours_s, "speedup": plain_s / ours_s,
                                      "bitwise_equal": bool(exact), "max_rel_err": err}))


if __name__ == "__main__":
    main()
