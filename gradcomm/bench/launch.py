"""Where the ranks come from: mpirun, torchrun, or the benchmark starting its own.

* Under ``mpirun``/``mpiexec`` (``OMPI_COMM_WORLD_SIZE``, ``PMI_SIZE``, ``PMIX_RANK``... in
  the environment) every process uses ``MPI.COMM_WORLD``.
* Under ``torchrun`` (``RANK`` and ``WORLD_SIZE``) every process joins the default
  torch.distributed group on gloo.
* Started bare, the benchmark re-executes itself under the ``mpiexec`` next to the Python
  interpreter (else on ``PATH``) when mpi4py is installed, adding ``--oversubscribe`` and
  Open MPI's run-as-root variables where needed; for ``--transport torch`` it starts the
  processes itself as torchrun would; otherwise it runs in-process ranks (threads).

Example:
    >>> detect_launcher({"OMPI_COMM_WORLD_SIZE": "2"}), detect_launcher({"RANK": "0",
    ...     "WORLD_SIZE": "2"}), detect_launcher({})
    ('mpi', 'torch', None)
"""

from __future__ import annotations

import importlib.util
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from ..errors import ConfigError, UnsupportedError

#: environment variables that MPI launchers set in every process they start
MPI_ENV = ("OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_SIZE", "PMI_RANK", "MV2_COMM_WORLD_SIZE",
           "MPI_LOCALNRANKS")
#: file:// rendezvous of the processes a bare ``--transport torch`` run starts
TORCH_INIT_ENV = "GRADCOMM_BENCH_TORCH_INIT"
#: the command a bare run re-executed itself with (recorded in the JSON environment)
LAUNCH_ENV = "GRADCOMM_BENCH_LAUNCH"


def detect_launcher(env: Mapping[str, str] | None = None) -> str | None:
    """'mpi' under an MPI launcher, 'torch' under torchrun, None when started bare."""
    env = os.environ if env is None else env
    if any(k in env for k in MPI_ENV):
        return "mpi"
    if "RANK" in env and "WORLD_SIZE" in env:
        return "torch"
    return None


def find_mpiexec(explicit: str | None = None) -> str | None:
    """``explicit``, else ``mpiexec``/``mpirun`` next to the interpreter, else on PATH —
    only if mpi4py is installed (without it the started ranks could not use MPI)."""
    if explicit:
        return explicit
    if importlib.util.find_spec("mpi4py") is None:
        return None
    here = os.path.dirname(sys.executable)
    for name in ("mpiexec", "mpirun"):
        path = os.path.join(here, name)
        if os.access(path, os.X_OK):
            return path
    return shutil.which("mpiexec") or shutil.which("mpirun")


def mpiexec_command(mpiexec: str, np_: int, child: Sequence[str],
                    extra: Sequence[str] = ()) -> tuple[list[str], dict[str, str]]:
    """The command line and environment that run ``child`` on ``np_`` MPI ranks."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    flags: list[str] = []
    if _is_open_mpi(mpiexec):
        if np_ > (os.cpu_count() or 1) and "--oversubscribe" not in extra:
            flags.append("--oversubscribe")
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
            env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    cmd = [mpiexec, "-n", str(np_), *flags, *extra, sys.executable, "-m", "gradcomm.bench",
           *child]
    env[LAUNCH_ENV] = shlex.join(cmd)
    return cmd, env


def _is_open_mpi(mpiexec: str) -> bool:
    try:
        out = subprocess.run([mpiexec, "--version"], capture_output=True, text=True,
                             timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    return "Open MPI" in out or "OpenRTE" in out


def run_under_mpiexec(mpiexec: str, np_: int, child: Sequence[str],
                      extra: Sequence[str] = ()) -> int:
    """Run the benchmark on ``np_`` MPI ranks; returns their exit status."""
    cmd, env = mpiexec_command(mpiexec, np_, child, extra)
    return subprocess.call(cmd, env=env)


def run_torch_processes(np_: int, child: Sequence[str]) -> int:
    """Start ``np_`` processes with torchrun's environment; their exit status.

    They meet through a file store in a fresh temporary directory (no port to race for).
    If one fails the others are given a moment, then terminated.
    """
    store = tempfile.mkdtemp(prefix="gradcomm-bench-")
    procs = []
    for r in range(np_):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(np_), LOCAL_RANK=str(r),
                   LOCAL_WORLD_SIZE=str(np_), MASTER_ADDR="127.0.0.1",
                   **{TORCH_INIT_ENV: "file://" + os.path.join(store, "store")})
        env.setdefault("OMP_NUM_THREADS", "1")
        cmd = [sys.executable, "-m", "gradcomm.bench", *child]
        env[LAUNCH_ENV] = f"{np_} processes: " + shlex.join(cmd)
        procs.append(subprocess.Popen(cmd, env=env))
    rc = 0
    try:
        while any(p.poll() is None for p in procs):
            codes = [p.returncode for p in procs if p.returncode]
            if codes:
                rc = codes[0]
                deadline = time.monotonic() + 10.0
                while time.monotonic() < deadline and any(p.poll() is None for p in procs):
                    time.sleep(0.1)
                break
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(5)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        shutil.rmtree(store, ignore_errors=True)
    return rc or next((p.returncode for p in procs if p.returncode), 0)


# -- the library's own allreduce, called directly ----------------------------------------

class MPIBaseline:
    """``comm.Allreduce(x, out, op)`` with a preallocated output, as MPI programs call it."""

    name = "MPI_Allreduce"

    def __init__(self, comm: Any) -> None:
        self.comm = comm

    def prepare(self, x: np.ndarray, dtype: str, op: str) -> Callable[[], np.ndarray]:
        from mpi4py import MPI

        if dtype in ("float16", "bfloat16"):
            raise UnsupportedError(f"MPI cannot reduce {dtype} (Open MPI rejects float16; "
                                   "bfloat16 is mis-summed)")
        mpi_op = {"sum": MPI.SUM, "mean": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN,
                  "prod": MPI.PROD}[op]
        out = np.empty_like(x)
        comm, p = self.comm, self.comm.Get_size()
        mean = op == "mean"

        def call() -> np.ndarray:
            comm.Allreduce(x, out, op=mpi_op)
            if mean:
                out[...] /= out.dtype.type(p)
            return out

        return call


class TorchBaseline:
    """``dist.all_reduce`` on a copy of the input (it reduces in place)."""

    name = "dist.all_reduce"

    def __init__(self, group: Any) -> None:
        self.group = group

    def prepare(self, x: np.ndarray, dtype: str, op: str) -> Callable[[], np.ndarray]:
        import torch
        import torch.distributed as dist

        from .. import arrays

        src = torch.from_numpy(x.view(np.int16)).view(torch.bfloat16) \
            if dtype == "bfloat16" else torch.from_numpy(x)
        out = src.clone()
        R = dist.ReduceOp
        rop = {"sum": R.SUM, "mean": R.SUM, "max": R.MAX, "min": R.MIN,
               "prod": R.PRODUCT}[op]
        group, p, mean = self.group, dist.get_world_size(self.group), op == "mean"

        def call() -> np.ndarray:
            out.copy_(src)
            dist.all_reduce(out, op=rop, group=group)
            if mean:
                out.div_(p)
            return arrays.host_view(out)

        return call


def mpi_world() -> tuple[Any, Any, MPIBaseline]:
    """(transport, MPI module, baseline) for ``MPI.COMM_WORLD``."""
    try:
        from mpi4py import MPI
    except ImportError:
        raise ConfigError("--transport mpi needs mpi4py (pip install 'gradcomm[mpi]')") from None
    from ..comm import get_transport

    try:
        t = get_transport(MPI.COMM_WORLD)
    except ImportError as exc:
        raise ConfigError(f"the MPI transport is not available: {exc}") from None
    return t, MPI, MPIBaseline(MPI.COMM_WORLD)


def torch_world() -> tuple[Any, TorchBaseline]:
    """(transport, baseline) for torch.distributed's default group (gloo, from env://)."""
    try:
        import torch.distributed as dist
    except ImportError:
        raise ConfigError("--transport torch needs torch (pip install 'gradcomm[torch]')") \
            from None
    if not dist.is_initialized():
        init = os.environ.get(TORCH_INIT_ENV)
        if init:                         # started by run_torch_processes
            dist.init_process_group("gloo", init_method=init, rank=int(os.environ["RANK"]),
                                    world_size=int(os.environ["WORLD_SIZE"]))
        else:                            # torchrun: env://
            dist.init_process_group("gloo")
    from ..comm import get_transport

    try:
        t = get_transport(dist.group.WORLD)
    except ImportError as exc:
        raise ConfigError(f"the torch transport is not available: {exc}") from None
    return t, TorchBaseline(dist.group.WORLD)
