"""Error paths of the MPI transport and the dense collectives under a real mpirun.

Each check records what happened on this rank; the test asserts every rank saw the same
error class. Prints ``RESULT {json}``.

    mpirun -n 3 python -m mpi4py tests/comm/scripts/mpi_errors.py [--matrix]

With ``--matrix`` the conformance matrix (``conformance.run_matrix``) runs first, in the
same launch, and its result is the ``"matrix"`` field.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402


def outcome(fn: Callable[[], Any]) -> str:
    """'ok' or the name of the gradcomm error raised (other errors propagate)."""
    from gradcomm.errors import GradcommError

    try:
        fn()
    except GradcommError as exc:
        return type(exc).__name__
    return "ok"


def main() -> int:
    import gradcomm
    from gradcomm.collectives import DENSE, dense_allreduce
    from gradcomm.comm import get_transport
    from gradcomm.comm.mpi import MPITransport

    world = MPI.COMM_WORLD
    t = get_transport(world, timeout=30)
    rank, p = t.rank, t.size
    res: dict[str, Any] = {"rank": rank, "transport": type(t).__name__,
                           "cached": get_transport(world) is t}
    if "--matrix" in sys.argv[1:]:
        from tests.comm.scripts.conformance import run_matrix

        res["matrix"] = run_matrix(t)

    # ranks disagree on count / dtype / op: MismatchError on every rank, any algorithm
    for algo in DENSE:
        res[f"count/{algo}"] = outcome(
            lambda: dense_allreduce(t, np.ones(5 + (rank == p - 1)), "sum", "float64", algo))
    res["dtype"] = outcome(lambda: gradcomm.allreduce(
        np.ones(4, np.float32 if rank else np.float64), world, algorithm="ring"))
    res["op"] = outcome(lambda: gradcomm.allreduce(
        np.ones(4), world, op="max" if rank else "sum", algorithm="tree"))
    res["algorithm"] = outcome(lambda: gradcomm.allreduce(
        np.ones(4), world, algorithm="ring" if rank else "rabenseifner"))
    res["unknown_algorithm"] = outcome(lambda: gradcomm.allreduce(
        np.ones(4), world, algorithm="bogus"))
    res["unknown_op"] = outcome(lambda: gradcomm.allreduce(np.ones(4), world, op="avg"))
    # the transport is still usable after all of that
    y = gradcomm.allreduce(np.full(7, rank, np.int64), world, algorithm="ring")
    res["after_errors"] = y.tolist() == [p * (p - 1) // 2] * 7

    # message of another size than the posted receive: TransportError, both directions
    if rank == 0:
        t.send(np.zeros(2), 1, 50)                 # 16 bytes into a 24-byte buffer
        t.send(np.zeros(4), 1, 51)                 # 32 bytes into a 24-byte buffer
    elif rank == 1:
        res["short_message"] = outcome(lambda: t.recv(np.zeros(3), 0, 50))
        res["long_message"] = outcome(lambda: t.recv(np.zeros(3), 0, 51))
    t.barrier()

    # a receive nobody sends to: DeadlineError within the short deadline; cancelled, so
    # the transport goes on working
    start = time.monotonic()
    res["deadline"] = outcome(lambda: t.waitall(
        [t.irecv(np.zeros(1), (rank + 1) % p, 60)], timeout=0.3))
    res["deadline_seconds"] = round(time.monotonic() - start, 3)
    t.barrier()
    y = gradcomm.allreduce(np.ones(3), world, algorithm="recursive_doubling")
    res["after_deadline"] = y.tolist() == [float(p)] * 3

    # library traffic never matches the program's own messages (same tag, same peers)
    if p >= 2:
        mine = np.full(4, 7.0)
        if rank == 0:
            world.Send(mine, 1, tag=3)
        y = gradcomm.allreduce(np.ones(4), world, algorithm="ring")
        if rank == 1:
            got = np.zeros(4)
            world.Recv(got, 0, tag=3)
            res["isolated"] = got.tolist() == [7.0] * 4 and y.tolist() == [float(p)] * 4

    # 16-bit floats: MPI_Allreduce would reject / mis-sum them; gradcomm refuses natively
    res["native_float16"] = outcome(
        lambda: t.native_allreduce(np.ones(3, np.float16), "sum", "float16"))
    res["native_bfloat16"] = outcome(
        lambda: t.native_allreduce(np.ones(3, np.uint16), "sum", "bfloat16"))
    res["bool_native"] = outcome(
        lambda: t.native_allreduce(np.array([rank == 0, False]), "sum", "bool"))

    # byte counters and the barrier
    t.stats.reset()
    if rank == 0:
        t.send(np.zeros(10, np.float32), 1)
    elif rank == 1:
        t.recv(np.zeros(10, np.float32), 0)
    res["stats"] = t.stats.snapshot()
    t.barrier()

    # close() frees the duplicate and forgets the cached transport
    t2 = MPITransport(world, timeout=5)
    t2.close()
    t2.close()
    res["closed"] = outcome(lambda: t2.send(np.zeros(1), (rank + 1) % p))
    res["intercomm"] = "n/a"
    if p >= 2:
        local = world.Split(rank % 2, rank)
        inter = local.Create_intercomm(0, world, 1 - rank % 2, 77)
        res["intercomm"] = outcome(lambda: MPITransport(inter))
        inter.Free()
        local.Free()
    t.close()
    res["recreated"] = get_transport(world) is not t
    get_transport(world).close()
    print("RESULT " + json.dumps(res), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
