"""The dense-allreduce conformance matrix on a real launcher (mpirun or gloo processes).

Every rank runs every algorithm of ``gradcomm.collectives.DENSE`` x op x dtype x count
(``small_counts(p)`` and 65 537) on exact small-integer inputs, compares its result with
the exact expected bytes and with ``native``'s result, and prints ``RESULT {json}``: its
errors and one digest per case, which the test compares across ranks (identical bytes on
every rank). ``native`` on float16/bfloat16 must raise UnsupportedError on MPI.

    mpirun -n 3 python -m mpi4py tests/comm/scripts/conformance.py
    (torch) RANK=.. WORLD_SIZE=.. MASTER_ADDR=.. MASTER_PORT=.. python \
        tests/comm/scripts/conformance.py --launcher torch --small
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from tests._cases import (DTYPES, OPS, expected, make_input, op_applies,  # noqa: E402
                          same_bytes, small_counts)

SMALL_DTYPES = ("bfloat16", "float32", "int8", "int64")
SMALL_OPS = ("sum", "max", "mean")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--launcher", default="mpi", choices=["mpi", "torch"])
    ap.add_argument("--small", action="store_true", help="a subset (for slow gloo)")
    ap.add_argument("--large", type=int, default=65537)
    ap.add_argument("--algorithms", default="", help="comma list (default: all DENSE)")
    args = ap.parse_args(argv)
    if args.launcher == "torch":
        import torch.distributed as dist

        dist.init_process_group("gloo")
    from gradcomm.collectives import DENSE, dense_allreduce
    from gradcomm.comm import get_transport
    from gradcomm.errors import UnsupportedError

    t = get_transport(None, timeout=60)
    p, rank = t.size, t.rank
    algorithms = [a for a in args.algorithms.split(",") if a] or list(DENSE)
    if "native" in algorithms:                     # native first: the others compare to it
        algorithms.remove("native")
        algorithms.insert(0, "native")
    dtypes = SMALL_DTYPES if args.small else DTYPES
    ops = SMALL_OPS if args.small else OPS
    counts = small_counts(p) + [args.large]
    errors: list[str] = []
    digests: dict[str, str] = {}
    native: dict[tuple[str, str, int], bytes] = {}
    unsupported: list[str] = []
    start = time.perf_counter()
    for algo in algorithms:
        for op in ops:
            for dtype in dtypes:
                if not op_applies(op, dtype):
                    continue
                for count in counts:
                    case = f"{algo}/{op}/{dtype}/{count}"
                    buf = make_input(rank, count, dtype, op)
                    try:
                        dense_allreduce(t, buf, op, dtype, algo)
                    except UnsupportedError:
                        unsupported.append(case)
                        continue
                    except Exception as exc:   # noqa: BLE001 - reported per case
                        errors.append(f"{case}: {type(exc).__name__}: {exc}")
                        continue
                    want = expected(p, count, dtype, op)
                    if not same_bytes(buf, want):
                        bad = int((buf.view(f"u{buf.itemsize}") !=
                                   want.view(f"u{want.itemsize}")).sum()) \
                            if buf.shape == want.shape else -1
                        errors.append(f"{case}: {bad} elements differ from the exact result")
                    key = (op, dtype, count)
                    if algo == "native":
                        native[key] = buf.tobytes()
                    elif key in native and native[key] != buf.tobytes():
                        errors.append(f"{case}: differs from native's result")
                    digests[case] = hashlib.blake2b(buf.tobytes(), digest_size=8).hexdigest()
    res = {"rank": rank, "size": p, "transport": t.name, "errors": errors,
           "digests": digests, "unsupported": unsupported,
           "seconds": round(time.perf_counter() - start, 2)}
    print("RESULT " + json.dumps(res), flush=True)
    t.barrier()
    if args.launcher == "torch":
        import torch.distributed as dist

        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
