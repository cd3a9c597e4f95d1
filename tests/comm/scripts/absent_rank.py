"""One rank never joins the collective: the others must raise DeadlineError within the
short deadline, and (the error being uncaught under ``python -m mpi4py`` / a failing
gloo process) the job must end instead of hanging.

    mpirun -n 3 python -m mpi4py tests/comm/scripts/absent_rank.py ring 1.0 [--no-check]
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("algorithm")
    ap.add_argument("timeout", type=float)
    ap.add_argument("--no-check", action="store_true", help="skip the argument check, so "
                    "the wait that expires is one of the algorithm's own")
    ap.add_argument("--launcher", default="mpi", choices=["mpi", "torch"])
    ap.add_argument("--tag", default="", help="ignored; lets a test find its processes")
    args = ap.parse_args()
    if args.launcher == "torch":
        import torch.distributed as dist

        dist.init_process_group("gloo")
    import gradcomm
    from gradcomm.comm import get_transport

    t = get_transport(None, timeout=args.timeout)
    if t.rank == t.size - 1:
        print(f"rank {t.rank}: not joining", flush=True)
        time.sleep(120)
        return 0
    start = time.monotonic()
    try:
        gradcomm.allreduce(np.ones(1000), t, algorithm=args.algorithm,
                           check=not args.no_check)
    finally:
        print(f"rank {t.rank}: gave up after {time.monotonic() - start:.2f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
