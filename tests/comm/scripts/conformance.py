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
from typing import Any, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from tests._cases import (DTYPES, OPS, expected, make_input, op_applies,  # noqa: E402
                          same_bytes, small_counts)

SMALL_DTYPES = ("bfloat16", "float32", "int8", "int64")
SMALL_OPS = ("sum", "max", "mean")


def run_matrix(t: Any, *, small: bool = False, large: int = 65537,
               algorithms: Sequence[str] = ()) -> dict[str, Any]:
    """Run the matrix on transport ``t``; this rank's errors, digests and the cases the
    library refused (UnsupportedError)."""
    from gradcomm.collectives import DENSE, dense_allreduce
    from gradcomm.errors import UnsupportedError

    p, rank = t.size, t.rank
    algos = list(algorithms) or list(DENSE)
    if "native" in algos:                      # native first: the others compare to it
        algos.remove("native")
        algos.insert(0, "native")
    dtypes = SMALL_DTYPES if small else DTYPES
    ops = SMALL_OPS if small else OPS
    counts = small_counts(p) + [large]
    errors: list[str] = []
    digests: dict[str, str] = {}
    native: dict[tuple[str, str, int], bytes] = {}
    unsupported: list[str] = []
    start = time.perf_counter()
    for algo in algos:
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
    return {"rank": rank, "size": p, "transport": t.name, "errors": errors,
            "digests": digests, "unsupported": unsupported,
            "seconds": round(time.perf_counter() - start, 2)}


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
    from gradcomm.comm import get_transport

    t = get_transport(None, timeout=60)
    res = run_matrix(t, small=args.small, large=args.large,
                     algorithms=[a for a in args.algorithms.split(",") if a])
    print("RESULT " + json.dumps(res), flush=True)
    if args.launcher == "torch":
        from gradcomm.integrations.ddp.lifecycle import end_process_group

        end_process_group()
    else:
        t.barrier()
    return 0


def check_conformance(results: list[dict], n: int, *, native_16bit: bool) -> None:
    """Every rank exact, no errors, every rank the same digests for the same cases."""
    from gradcomm.collectives import DENSE

    core = {"ring", "tree", "recursive_doubling", "rabenseifner", "native"}
    assert [r["rank"] for r in results] == list(range(n))
    for r in results:
        assert r["size"] == n
        assert r["errors"] == [], f"rank {r['rank']}: {r['errors'][:10]}"
    first = results[0]["digests"]
    algorithms = {case.split("/")[0] for case in first}
    assert algorithms == set(DENSE) and core <= algorithms
    for r in results[1:]:
        assert r["digests"].keys() == first.keys(), f"rank {r['rank']} ran other cases"
        differ = [c for c in first if r["digests"][c] != first[c]]
        assert not differ, f"rank {r['rank']} holds other bytes than rank 0 in {differ[:10]}"
        assert r["unsupported"] == results[0]["unsupported"]
    unsupported = {tuple(c.split("/")[::2]) for c in results[0]["unsupported"]}
    if native_16bit:
        assert not unsupported
    else:                                     # MPI: 16-bit floats refused, never mis-summed
        assert {a for a, _ in unsupported} <= {"native"}
        assert {d for _, d in unsupported} == {"float16", "bfloat16"}


if __name__ == "__main__":
    sys.exit(main())
