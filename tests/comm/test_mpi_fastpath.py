"""The MPI transport's latency paths under a real mpirun (one launch, two ranks).

- the argument check through ``MPI_Iallreduce`` (``fast_native``): mismatches named, and
  a rank that joins late: its peer's check expires, the transport refuses collectives
  while the abandoned one is pending, and works again once the late rank joined it;
- ``auto`` hands small checked messages to ``MPI_Allreduce`` (no point-to-point data),
  but not unchecked ones (no deadline inside MPI_Allreduce), nor float16;
- ``check="first"``; the ``sendrecv`` short path and ``MPI_Testall`` spin, including a
  message longer than its receive buffer (a clear TransportError, the transport usable).
"""

from __future__ import annotations

import pytest

from tests._late import late_rank
from tests._launch import mpi_call, require_mpi


def fastpaths() -> dict:
    import numpy as np
    from mpi4py import MPI

    import gradcomm
    from gradcomm.bench.data import exact_input, exact_result, exact_values
    from gradcomm.collectives._check import agree
    from gradcomm.comm import get_transport
    from gradcomm.errors import DeadlineError, MismatchError, TransportError

    t = get_transport(MPI.COMM_WORLD, timeout=20)
    rank, p = t.rank, t.size
    out: dict = {"fast_native": t.fast_native}

    def outcome(fn) -> str:
        try:
            fn()
        except (MismatchError, DeadlineError, TransportError) as exc:
            return f"{type(exc).__name__}: {exc}"
        return "ok"

    out["count"] = outcome(lambda: gradcomm.allreduce(np.ones(4 + rank), t))
    out["collective"] = outcome(lambda: agree(t, "gossip" if rank else "allreduce", n=1))

    sent = []
    for check, n, dtype in ((True, 100, np.float32), (False, 100, np.float32),
                            ("first", 100, np.float32), ("first", 101, np.float32),
                            ("first", 101, np.float32), (True, 100, np.float16)):
        name = np.dtype(dtype).name
        x = exact_input(rank, n, name, "sum")          # per-rank integers, no period
        t.stats.reset()
        y = gradcomm.allreduce(x, t, check=check)
        assert y.tobytes() == exact_result(p, n, name, "sum").tobytes()
        sent.append(t.stats.bytes_sent)
    out["sent"] = sent

    x = exact_values(rank, 1000, "float64", "sum")
    y = np.empty_like(x)
    t.sendrecv(x, (rank + 1) % p, y, (rank - 1) % p)
    out["sendrecv"] = y.tolist() == exact_values((rank - 1) % p, 1000, "float64", "sum").tolist()
    if rank == 0:                                      # 32 bytes into a 24-byte buffer
        t.send(np.zeros(4), 1, 61)
        t.send(np.zeros(3), 1, 62)
    elif rank == 1:
        out["truncated"] = outcome(lambda: t.sendrecv(np.zeros(3), 0, np.zeros(3), 0, 61))
        t.recv(np.zeros(3), 0, 62)
    if rank == 0:
        t.recv(np.zeros(3), 1, 61)
    out["after_truncation"] = gradcomm.allreduce(np.ones(3), t).tolist() == [float(p)] * 3

    # a late rank: the check's MPI_Iallreduce expires on the others, who then refuse new
    # collectives until the late rank joins the abandoned one
    out.update(late_rank())
    return out


@pytest.mark.timeout(90)
def test_mpi_fast_paths() -> None:
    require_mpi()
    res = mpi_call(fastpaths, 2, timeout=80, env={"GRADCOMM_PROFILE": "none"})  # the table
    for r in res:
        assert r["fast_native"] is True
        assert "MismatchError" in r["count"] and "count ranges from 4 to 5" in r["count"]
        assert "MismatchError" in r["collective"] and "collective differs" in r["collective"]
        checked, unchecked, verified, first, again, half = r["sent"]
        assert checked == 0            # check and data inside MPI: nothing point to point
        assert unchecked == 400        # float32 recursive doubling: one exchange of 400 B
        assert verified == 400         # 'first': these arguments were checked by call 1
        assert first == 0 and again == 404     # new arguments: checked once, then not
        assert half == 200             # float16: gradcomm reduces it (MPI cannot)
        assert r["sendrecv"] and r["after_truncation"] and r["after_late"]
    assert "TransportError" in res[1]["truncated"] and "MPI_ERR_TRUNCATE" in res[1]["truncated"]
    assert res[0]["late"].startswith("DeadlineError") and "within 0.5 s" in res[0]["late"]
    assert 0.4 < res[0]["late_seconds"] < 5
    assert res[0]["while_pending"].startswith("TransportError") and \
        "still pending" in res[0]["while_pending"]
