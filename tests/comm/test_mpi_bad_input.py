"""Bad input and misuse under a real mpirun (issue 14): every rank gets a gradcomm error
within the deadline, never a hang inside MPI and never silently mixed data.

- the first call: the transport's private duplicate (MPI_Comm_idup) waits with the
  deadline, so a rank that never reaches gradcomm is a DeadlineError on the others;
- check="first": a later call whose op or dtype differs across ranks is an error on every
  rank (the data travel under a tag derived from the arguments);
- wrap(): a call handed to MPI's own Allreduce (BAND) on one rank while the others reduce
  with gradcomm (SUM), or a read-only receive buffer on one rank, is an error on every rank
  before anything blocks in MPI.
"""

from __future__ import annotations

import pytest

from tests._launch import mpi_call, require_mpi


def _outcome(fn) -> str:
    from gradcomm.errors import GradcommError

    try:
        fn()
    except GradcommError as exc:
        return type(exc).__name__
    return "ok"


def first_call_with_an_absent_rank(timeout: float) -> list:
    """The last rank reaches gradcomm only after the others' deadline."""
    import time

    import numpy as np
    from mpi4py import MPI

    import gradcomm
    from gradcomm.comm import get_transport

    comm = MPI.COMM_WORLD
    if comm.Get_rank() == comm.Get_size() - 1:
        time.sleep(timeout + 8)
        get_transport(comm, timeout=30)          # joins the abandoned duplication
        return ["late", 0.0]
    start = time.monotonic()
    got = _outcome(lambda: gradcomm.allreduce(np.ones(4), get_transport(comm,
                                                                        timeout=timeout)))
    return [got, time.monotonic() - start]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("n", [2, 3])
def test_first_call_has_a_deadline(n: int) -> None:
    require_mpi()
    res = mpi_call(first_call_with_an_absent_rank, n, 1.0, timeout=60)
    assert res[-1] == ["late", 0.0]
    for got, seconds in res[:-1]:
        assert got == "DeadlineError" and 0.9 < seconds < 5, res   # the late rank: 9 s


def check_first_mismatches() -> list:
    import numpy as np
    from mpi4py import MPI

    import gradcomm
    from gradcomm.collectives import DENSE
    from gradcomm.comm import get_transport

    # Each transport's first call (MPI_Comm_idup) has the same 1 s deadline as the cases, so
    # the ranks line up first: process start-up, and the deadline a case ends in, skew them
    # by more than that on a loaded machine.
    MPI.COMM_WORLD.Barrier()
    t = get_transport(MPI.COMM_WORLD, timeout=1.0)
    out = []
    for alg in DENSE + ("auto",):
        for change in ("op", "dtype"):
            x = np.arange(1, 10, dtype=np.float32) * (t.rank + 1)
            other = (x, "max") if change == "op" else (x.astype(np.int32), "sum")
            gradcomm.allreduce(x, t, algorithm=alg, check="first")
            gradcomm.allreduce(other[0], t, op=other[1], algorithm=alg, check="first")
            if t.rank == 1:
                got = _outcome(lambda: gradcomm.allreduce(other[0], t, op=other[1],
                                                          algorithm=alg, check="first"))
            else:
                got = _outcome(lambda: gradcomm.allreduce(x, t, algorithm=alg,
                                                          check="first"))
            out.append([alg, change, got])
            t.close()                            # a fresh transport for the next case
            MPI.COMM_WORLD.Barrier()
            t = get_transport(MPI.COMM_WORLD, timeout=1.0)
    return out


@pytest.mark.timeout(150)
@pytest.mark.parametrize("n", [2, 3])
def test_check_first_later_mismatch_is_an_error_on_every_rank(n: int) -> None:
    require_mpi()
    for rank, cases in enumerate(mpi_call(check_first_mismatches, n, timeout=120)):
        for alg, change, got in cases:
            want = "MismatchError" if alg == "native" else "DeadlineError"
            assert got == want, (rank, alg, change, got)


def wrap_misuse() -> dict:
    import numpy as np
    from mpi4py import MPI

    from gradcomm.integrations.mpi import wrap

    comm = wrap(MPI.COMM_WORLD, algorithm="ring", timeout=5.0)
    rank, p = comm.Get_rank(), comm.Get_size()
    out = {}
    x = np.full(4, 3, np.int32)
    out["band_vs_sum"] = _outcome(lambda: comm.Allreduce(
        MPI.IN_PLACE, x, op=MPI.BAND if rank == 0 else MPI.SUM))
    y = np.ones(4)
    y.flags.writeable = rank != p - 1
    out["read_only"] = _outcome(lambda: comm.Allreduce(MPI.IN_PLACE, y, op=MPI.SUM))
    z = np.full(4, 6, np.int32)
    comm.Allreduce(MPI.IN_PLACE, z, op=MPI.BAND)        # all forward: agreed, then MPI
    out["band_all"] = z.tolist()
    w = np.ones(4)
    comm.Allreduce(MPI.IN_PLACE, w, op=MPI.SUM)         # still usable
    out["after"] = w.tolist()
    return out


@pytest.mark.timeout(90)
@pytest.mark.parametrize("n", [2, 3])
def test_wrap_says_so_before_handing_a_disagreeing_call_to_mpi(n: int) -> None:
    require_mpi()
    res = mpi_call(wrap_misuse, n, timeout=60)
    for rank, r in enumerate(res):
        assert r["band_vs_sum"] == "MismatchError", (rank, r)
        assert r["read_only"] == ("ConfigError" if rank == n - 1 else "MismatchError"), r
        assert r["band_all"] == [6] * 4 and r["after"] == [float(n)] * 4, r


def float16_means() -> list:
    import numpy as np
    from mpi4py import MPI

    import gradcomm
    from gradcomm.comm import get_transport

    t = get_transport(MPI.COMM_WORLD, timeout=20)
    x = np.full(7, 6e4 - 32 * t.rank, np.float16)
    x[1] = 1.0
    return [gradcomm.allreduce(x, t, op="mean", algorithm=alg).tolist()
            for alg in ("ring", "recursive_doubling", "auto")]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("n", [2, 3])
def test_float16_mean_does_not_overflow_under_mpirun(n: int) -> None:
    import numpy as np

    require_mpi()
    res = mpi_call(float16_means, n, timeout=60)
    want = np.float16(np.mean([6e4 - 32 * r for r in range(n)]))
    for r in res:
        assert r == res[0]                                   # every rank, same values
        for y in r:
            assert y[0] == want and y[1] == 1.0, y
