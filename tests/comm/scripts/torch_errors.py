"""The torch.distributed transport on real gloo processes: sub-groups (group ranks mapped
to global ranks), isolation from the program's own messages, argument mismatches, native
all_reduce limits, byte counters, and a deadline. Prints ``RESULT {json}``; run with
``tests._launch.torchrun`` on 3 processes. With ``--matrix`` the conformance matrix
subset (``conformance.run_matrix(small=True)``) runs first, in the same launch.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import numpy as np  # noqa: E402


def outcome(fn: Callable[[], Any]) -> str:
    from gradcomm.errors import GradcommError

    try:
        fn()
    except GradcommError as exc:
        return type(exc).__name__
    return "ok"


def main() -> int:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    import gradcomm
    from gradcomm.collectives import DENSE
    from gradcomm.comm import get_transport

    t = get_transport(None, timeout=30)
    rank, p = t.rank, t.size
    res: dict[str, Any] = {"rank": rank, "transport": type(t).__name__, "backend": t.backend,
                           "cached": get_transport(dist.group.WORLD) is t}
    if "--matrix" in sys.argv[1:]:
        from tests.comm.scripts.conformance import run_matrix

        res["matrix"] = run_matrix(t, small=True)

    # a sub-group of the last two ranks: group ranks 0, 1 are global ranks p-2, p-1
    members = [p - 2, p - 1]
    sub = dist.new_group(members)
    if rank in members:
        ts = get_transport(sub, timeout=30)
        res["sub_rank"] = ts.rank
        y = {a: gradcomm.allreduce(np.full(5, rank, np.int64), sub, algorithm=a).tolist()
             for a in DENSE}
        res["sub_ok"] = all(v == [sum(members)] * 5 for v in y.values())

    # the program's own send/recv with gradcomm's tag value is not matched by the library
    # (gloo sends wait for the matching receive: the program's is non-blocking here)
    mine = dist.isend(torch.full((4,), 7.0), 1, tag=3) if rank == 0 else None
    y = gradcomm.allreduce(torch.ones(4), None, algorithm="ring")
    if mine is not None:
        mine.wait()
    if rank == 1:
        got = torch.zeros(4)
        dist.recv(got, 0, tag=3)
        res["isolated"] = got.tolist() == [7.0] * 4 and y.tolist() == [float(p)] * 4

    for algo in DENSE:
        res[f"count/{algo}"] = outcome(
            lambda: gradcomm.allreduce(np.ones(5 + (rank == p - 1)), None, algorithm=algo))
    res["dtype"] = outcome(lambda: gradcomm.allreduce(
        torch.ones(4, dtype=torch.float32 if rank else torch.bfloat16), None))
    res["unknown_algorithm"] = outcome(lambda: gradcomm.allreduce(np.ones(3), None,
                                                                  algorithm="bogus"))
    res["native_int16"] = outcome(lambda: t.native_allreduce(np.ones(3, np.int16), "sum",
                                                             "int16"))
    y = gradcomm.allreduce(torch.ones(3, dtype=torch.bfloat16), None, algorithm="native")
    res["native_bf16"] = y.dtype == torch.bfloat16 and y.tolist() == [float(p)] * 3
    res["after_errors"] = gradcomm.allreduce(np.ones(2), None).tolist() == [float(p)] * 2

    t.stats.reset()
    if rank == 0:
        t.send(np.zeros(10, np.float32), 1)
    elif rank == 1:
        t.recv(np.zeros(10, np.float32), 0)
    res["stats"] = t.stats.snapshot()
    t.barrier()

    # last: rank 0 waits for a message nobody sends (gloo then drops that connection)
    if rank == 0:
        start = time.monotonic()
        res["deadline"] = outcome(lambda: t.waitall([t.irecv(np.zeros(1), 1, 60)],
                                                    timeout=0.5))
        res["deadline_seconds"] = round(time.monotonic() - start, 3)
    else:
        time.sleep(3)    # stay connected while rank 0 waits (a closed peer is not a deadline)
    print("RESULT " + json.dumps(res), flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
