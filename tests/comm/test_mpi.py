"""The MPI transport under a real ``mpirun``: the dense conformance matrix at 2, 3 and 4
ranks (exact results, identical bytes on every rank, native MPI equal to ours), and the
error paths (argument mismatches, wrong message sizes, deadlines, an absent rank).

Each launch batches many cases (mpirun start-up costs about a second).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests._launch import mpirun, require_mpi
from tests.comm.scripts.conformance import check_conformance

SCRIPTS = Path(__file__).resolve().parent / "scripts"


@pytest.mark.timeout(150)
@pytest.mark.parametrize("n", [2, 3, 4])
def test_conformance_and_error_paths_under_mpirun(n: int) -> None:
    """One launch per rank count: the whole matrix, then every error path."""
    require_mpi()
    results = mpirun(SCRIPTS / "mpi_errors.py", n, "--matrix", timeout=130).results(n)
    matrix = [r["matrix"] for r in results]
    assert {m["transport"] for m in matrix} == {"mpi"}
    check_conformance(matrix, n, native_16bit=False)
    check_error_paths(results)


def check_error_paths(results: list[dict]) -> None:
    from gradcomm.collectives import DENSE

    for r in results:
        where = f"rank {r['rank']}"
        assert r["transport"] == "MPITransport" and r["cached"], where
        for algo in DENSE:                     # counts differ: every rank, every algorithm
            assert r[f"count/{algo}"] == "MismatchError", (where, algo)
        assert r["dtype"] == r["op"] == r["algorithm"] == "MismatchError", where
        assert r["unknown_algorithm"] == r["unknown_op"] == "ConfigError", where
        assert r["after_errors"] and r["after_deadline"], where
        assert r["deadline"] == "DeadlineError", where
        assert 0.25 <= r["deadline_seconds"] < 5, where
        assert r["native_float16"] == r["native_bfloat16"] == "UnsupportedError", where
        assert r["bool_native"] == "ok", where
        assert r["closed"] == "TransportError" and r["recreated"], where
        assert r["intercomm"] == "ConfigError", where
    r1 = results[1]
    assert r1["short_message"] == r1["long_message"] == "TransportError"
    assert r1["isolated"] is True
    assert results[0]["stats"] == {"bytes_sent": 40, "messages_sent": 1,
                                   "bytes_received": 0, "messages_received": 0}
    assert r1["stats"] == {"bytes_sent": 0, "messages_sent": 0,
                           "bytes_received": 40, "messages_received": 1}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("n,algorithm,extra", [(2, "auto", ()),
                                               (3, "ring", ("--no-check",))])
def test_absent_rank_raises_deadline_and_the_job_ends(n: int, algorithm: str,
                                                       extra: tuple[str, ...]) -> None:
    """The last rank never joins: the others raise DeadlineError after ~1 s and the job
    (run under ``python -m mpi4py``) aborts instead of hanging."""
    require_mpi()
    run = mpirun(SCRIPTS / "absent_rank.py", n, algorithm, "1.0", *extra, timeout=45,
                 check=False)
    assert run.returncode != 0, run.describe()
    assert "DeadlineError" in run.stderr, run.describe()
    assert "did not complete within 1 s" in run.stderr, run.describe()
    assert run.elapsed < 30, run.describe()


def test_mpi_transport_in_process_single_rank() -> None:
    """On COMM_SELF (no launcher): the transport works, refuses 16-bit floats natively,
    frees its duplicate on close, and importing gradcomm did not import mpi4py."""
    require_mpi()
    import subprocess

    code = ("import sys, gradcomm, gradcomm.comm, gradcomm.collectives;"
            "assert 'mpi4py' not in sys.modules and 'torch' not in sys.modules;"
            "print('clean')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.stdout.strip() == "clean", out.stderr
    import numpy as np
    from mpi4py import MPI

    from gradcomm.comm.mpi import MPITransport, cuda_aware
    from gradcomm.errors import ConfigError, TransportError, UnsupportedError

    t = MPITransport(MPI.COMM_SELF, timeout=2)
    assert (t.rank, t.size) == (0, 1)
    assert t.devices == (frozenset({"cpu", "cuda"}) if cuda_aware() else frozenset({"cpu"}))
    with pytest.raises(UnsupportedError, match="float16"):
        t.native_allreduce(np.ones(2, np.float16), "sum", "float16")
    with pytest.raises(TransportError, match="invalid peer"):
        t.send(np.ones(2), 0)
    t.barrier()
    t.close()
    with pytest.raises(TransportError, match="closed"):
        t.native_allreduce(np.ones(2), "sum", "float64")
    with pytest.raises(ConfigError, match="intracommunicator"):
        MPITransport(object())


def test_cuda_awareness_can_be_declared(monkeypatch: pytest.MonkeyPatch) -> None:
    require_mpi()
    from gradcomm.comm.mpi import CUDA_AWARE_ENV, cuda_aware

    monkeypatch.setenv(CUDA_AWARE_ENV, "1")
    assert cuda_aware() is True
    from mpi4py import MPI

    from gradcomm.comm.mpi import MPITransport

    t = MPITransport(MPI.COMM_SELF, timeout=2)     # device buffers would go to MPI as is
    assert t.devices == frozenset({"cpu", "cuda"})
    t.barrier()
    t.close()
    monkeypatch.setenv(CUDA_AWARE_ENV, "0")
    assert cuda_aware() is False


def _rank_and_native_sum(k: int) -> list[int]:
    """Run by mpi_call on every rank."""
    import numpy as np
    from mpi4py import MPI

    from gradcomm.comm import get_transport

    t = get_transport(MPI.COMM_WORLD, timeout=20)
    buf = np.full(3, t.rank * k, np.int64)
    t.native_allreduce(buf, "sum", "int64")
    return [t.rank, t.size, int(buf[0])]


@pytest.mark.timeout(60)
def test_mpi_call_runs_a_function_on_every_rank() -> None:
    require_mpi()
    from tests._launch import mpi_call

    assert mpi_call(_rank_and_native_sum, 3, 10, timeout=50) == [[0, 3, 30], [1, 3, 30],
                                                                 [2, 3, 30]]


def test_only_a_launcher_that_started_no_rank_is_launched_again() -> None:
    """tests/_launch.mpirun launches once more only when mpirun's PMIx server did not
    start (its message on stderr, nothing on stdout); a rank's failure is never
    retried."""
    from tests._launch import PMIX_NOT_STARTED, Run, _launcher_did_not_start

    banner = f"----\n{PMIX_NOT_STARTED}. We cannot\ncontinue.\n----\n"
    assert _launcher_did_not_start(Run(["mpirun"], 213, "", banner, 0.0, [213]))
    assert not _launcher_did_not_start(Run(["mpirun"], 213, "RESULT {}\n", banner, 1.0))
    assert not _launcher_did_not_start(Run(["mpirun"], 1, "", "Traceback ...", 0.5))
    assert not _launcher_did_not_start(Run(["mpirun"], 0, "", banner, 0.5))


@pytest.mark.timeout(60)
def test_a_hanging_launch_is_killed_with_all_its_ranks() -> None:
    require_mpi()
    import os
    import uuid

    token = f"gradcomm-hang-{uuid.uuid4().hex}"
    with pytest.raises(AssertionError, match="timed out after 4 s"):
        # every rank waits 60 s for a message that never comes
        mpirun(SCRIPTS / "absent_rank.py", 3, "ring", "60", "--no-check", "--tag", token,
               timeout=4)
    left = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if token.encode() in f.read():
                    left.append(pid)
        except OSError:
            pass
    assert not left, f"processes left running: {left}"


def _window_and_sum() -> list[int]:
    """Run by mpi_call on every rank: the transport's receive window, and an exact ring
    sum of 3 MiB (many messages) under it."""
    import numpy as np
    from mpi4py import MPI

    import gradcomm
    from gradcomm.collectives import ring
    from gradcomm.comm.mpi import MPITransport
    from gradcomm.ops import Reducer

    t = MPITransport(MPI.COMM_WORLD, timeout=20)
    n = 3 << 18
    buf = (np.arange(n, dtype=np.int64) * 7919 % 1009 + t.rank).astype(np.float32)
    want = sum((np.arange(n, dtype=np.int64) * 7919 % 1009 + r).astype(np.float64)
               for r in range(t.size))
    ring.allreduce(t, buf, Reducer("sum", "float32"), chunk_bytes=64 << 10)
    ok = int(np.array_equal(buf, want))
    x = buf[:(256 << 10) // 4].copy()           # auto, checked: native only on one node
    t.stats.reset()
    ok &= int(np.array_equal(gradcomm.allreduce(x, t), x * t.size))
    t.close()
    return [t.window_bytes, ok, t.state.native_below, int(t.stats.bytes_sent > 0)]


@pytest.mark.timeout(120)
def test_the_receive_window_follows_the_path_between_the_ranks() -> None:
    """Ranks on one node over shared memory keep double buffering and hand checked calls
    below 1 MiB to MPI_Allreduce; the same job with the shared-memory path left out
    (``--mca btl tcp,self``, as bench/netns.py runs) keeps the network's deep window and
    the 64 KiB limit; the sums are exact under both."""
    require_mpi()
    from gradcomm.comm.base import NETWORK_WINDOW, ONE_NODE_NATIVE
    from gradcomm.comm.mpi import one_node
    from tests._launch import mpi_call

    none = {"GRADCOMM_PROFILE": "none"}                # auto's built-in table
    assert mpi_call(_window_and_sum, 3, timeout=50, env=none) == \
        [[0, 1, ONE_NODE_NATIVE, 0]] * 3               # 256 KiB through MPI_Allreduce
    tcp = {"OMPI_MCA_pml": "ob1", "OMPI_MCA_btl": "tcp,self", **none}
    assert mpi_call(_window_and_sum, 3, timeout=50, env=tcp) == \
        [[NETWORK_WINDOW, 1, 64 << 10, 1]] * 3         # ... and through gradcomm's ring
    same = {"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}
    assert one_node(same) and one_node({**same, "OMPI_MCA_btl": "self,sm"})
    assert one_node({**same, "OMPI_MCA_btl": "^tcp"})
    assert not one_node({**same, "OMPI_MCA_btl": "^sm,tcp"})
    assert not one_node({**same, "OMPI_COMM_WORLD_LOCAL_SIZE": "2"})     # two nodes
    assert not one_node({**same, "OMPI_MCA_pml": "ucx"}) and not one_node({})
