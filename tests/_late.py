"""A rank that joins a checked call late, run on every mpirun rank (``mpi_call``).

Shared by the MPI transport's latency tests and the small-call path's: the check's
``MPI_Iallreduce`` expires on rank 0 (DeadlineError within the deadline), rank 0's
transport then refuses new collectives until the others join the abandoned one, and a
matched call works again.
"""

from __future__ import annotations

from typing import Any


def outcome(fn: Any) -> str:
    """``"ok"``, or the GradcommError ``fn()`` raised as ``"Name: message"``."""
    from gradcomm.errors import GradcommError

    try:
        fn()
    except GradcommError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "ok"


def late_rank(warm: bool = False) -> dict[str, Any]:
    """Rank 0 calls ``gradcomm.allreduce(np.ones(3))`` on a fresh transport with a 0.5 s
    deadline while the others do not (``warm``: after one matched call, so that it is a
    resolved small call). Returns rank 0's ``late`` outcome, ``late_seconds`` and
    ``while_pending`` (a barrier meanwhile), and every rank's ``after_late`` (a matched
    call afterwards is exact) and ``freed`` (the closed transport is freed by reference
    counting alone)."""
    import gc
    import time
    import weakref

    import numpy as np
    from mpi4py import MPI

    import gradcomm
    from gradcomm.collectives._check import agree
    from gradcomm.comm.mpi import MPITransport

    out: dict[str, Any] = {}
    rank, p = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    late = MPITransport(MPI.COMM_WORLD, timeout=20)
    if warm:
        gradcomm.allreduce(np.ones(3), late)
    late.timeout = 0.5
    if rank == 0:
        start = time.monotonic()
        out["late"] = outcome(lambda: gradcomm.allreduce(np.ones(3), late))
        out["late_seconds"] = time.monotonic() - start
        out["while_pending"] = outcome(late.barrier)
    MPI.COMM_WORLD.Barrier()
    if rank != 0:
        late.timeout = 20
        agree(late, "allreduce", count=3, dtype="float64", op="sum", algorithm="auto",
              valid=True)
    MPI.COMM_WORLD.Barrier()
    late.timeout = 20
    out["after_late"] = gradcomm.allreduce(np.ones(3), late).tolist() == [float(p)] * 3
    late.close()
    gc.disable()
    ref = weakref.ref(late)
    del late
    out["freed"] = ref() is None
    gc.enable()
    return out
