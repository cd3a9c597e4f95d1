"""The MPI transport: mpi4py's buffer (upper-case) methods on a private communicator.

:class:`MPITransport` duplicates the user's communicator once (``comm.Dup()``), so library
messages can never match the program's own sends and receives. Buffers travel as raw bytes
(``[buf, MPI.BYTE]``) straight from their memory: numpy arrays through the buffer protocol;
device arrays (cupy, torch CUDA) through ``__cuda_array_interface__`` / DLPack when the MPI
is CUDA-aware (see :attr:`MPITransport.devices`). Nothing is pickled.

Every wait polls with a deadline: a peer that never posts its side raises
:class:`~gradcomm.errors.DeadlineError` instead of hanging. A received message of another
size than the posted buffer raises :class:`~gradcomm.errors.TransportError`.

Run multi-rank programs as ``mpirun -n 4 python -m mpi4py prog.py``: an uncaught error
on one rank then aborts the whole job instead of leaving the other ranks waiting.

Example:
    >>> import numpy as np
    >>> from mpi4py import MPI
    >>> t = MPITransport(MPI.COMM_SELF, timeout=5)
    >>> (t.name, t.rank, t.size, "cpu" in t.devices)
    ('mpi', 0, 1, True)
    >>> buf = np.arange(3.0); t.native_allreduce(buf, "sum", "float64"); buf.tolist()
    [0.0, 1.0, 2.0]
    >>> t.close()
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from typing import Any, Sequence

from .. import _array
from ..errors import ConfigError, DeadlineError, TransportError, UnsupportedError
from .base import DEFAULT_TIMEOUT, Request, Transport, poll

#: logical dtype -> MPI datatype attribute; 16-bit floats are absent on purpose: Open MPI
#: rejects MPI_FLOAT16_T in reductions and mpi4py maps bfloat16 to a type MPI mis-sums
_DATATYPES = {
    "float32": "FLOAT", "float64": "DOUBLE", "int8": "INT8_T", "int16": "INT16_T",
    "int32": "INT32_T", "int64": "INT64_T", "uint8": "UINT8_T", "uint16": "UINT16_T",
    "uint32": "UINT32_T", "uint64": "UINT64_T", "bool": "C_BOOL",
}
_OPS = {"sum": "SUM", "max": "MAX", "min": "MIN", "prod": "PROD"}
#: numpy's meaning of the ops on booleans (sum = or, like gradcomm's Reducer)
_BOOL_OPS = {"sum": "LOR", "max": "LOR", "min": "LAND", "prod": "LAND"}

#: set to "1" / "0" to declare the MPI CUDA-aware or not when detection cannot tell
CUDA_AWARE_ENV = "GRADCOMM_MPI_CUDA_AWARE"


class _Req:
    """One pending Isend/Irecv/Ibarrier; ``test()`` checks a receive's size on completion."""

    __slots__ = ("req", "status", "nbytes", "peer", "tag", "done", "owner")

    def __init__(self, owner: MPITransport, req: Any, status: Any, nbytes: int, peer: int,
                 tag: int) -> None:
        self.owner, self.req, self.status = owner, req, status
        self.nbytes, self.peer, self.tag = nbytes, peer, tag
        self.done = False

    def test(self) -> bool:
        if self.done:
            return True
        try:
            flag = self.req.Test(self.status)
        except self.owner.MPI.Exception as exc:
            self.done = True
            raise TransportError(
                f"rank {self.owner.rank}: MPI error on a message from/to rank {self.peer} "
                f"(tag {self.tag}, buffer of {self.nbytes} bytes): {exc.Get_error_string()}"
                ) from None
        if not flag:
            return False
        self.done = True
        if self.status is not None:
            got = self.status.Get_count(self.owner.MPI.BYTE)
            if got != self.nbytes:
                raise TransportError(
                    f"rank {self.owner.rank}: received a message of {got} bytes from rank "
                    f"{self.peer} (tag {self.tag}) into a buffer of {self.nbytes} bytes")
        return True


class MPITransport(Transport):
    """Point-to-point over a private duplicate of the mpi4py intracommunicator ``comm``.

    Args:
        comm: an ``mpi4py.MPI.Intracomm`` (e.g. ``MPI.COMM_WORLD``). It is duplicated once
            here (a collective call: every rank of ``comm`` must construct the transport);
            :meth:`close` frees the duplicate.
        timeout: seconds each blocking wait may take before ``DeadlineError``.
    """

    name = "mpi"

    def __init__(self, comm: Any, timeout: float = DEFAULT_TIMEOUT) -> None:
        from mpi4py import MPI

        if not isinstance(comm, MPI.Intracomm):
            raise ConfigError(f"MPITransport needs an mpi4py intracommunicator, got "
                              f"{type(comm).__module__}.{type(comm).__qualname__}")
        super().__init__(comm.Get_rank(), comm.Get_size(), timeout)
        self.MPI = MPI
        self.user_comm = comm
        # Dup through a plain Intracomm: a subclass (e.g. gradcomm's own wrap()) must not
        # leak its overridden methods into the library's private communicator
        self._comm: Any = MPI.Intracomm(comm).Dup()
        self._byte = MPI.BYTE
        self._orphans: list[_Req] = []       # abandoned requests, kept with their buffers
        self._cuda = cuda_aware()
        self.devices = frozenset({"cpu", "cuda"}) if self._cuda else frozenset({"cpu"})

    @property
    def comm(self) -> Any:
        """The private duplicate communicator the library's traffic runs on."""
        if self._comm is None:
            raise TransportError(f"rank {self.rank}: the MPI transport was closed")
        return self._comm

    # -- point-to-point ---------------------------------------------------------------
    def _isend(self, buf: Any, dest: int, tag: int) -> Request:
        if self._cuda:
            _array.sync(buf)             # kernels still writing a device buffer finish first
        try:
            req = self.comm.Isend([buf, self._byte], dest, tag)
        except (BufferError, ValueError, TypeError) as exc:
            raise TransportError(f"rank {self.rank}: cannot send this buffer to rank "
                                 f"{dest}: {exc} (contiguous buffers only)") from None
        return _Req(self, req, None, buf.nbytes, dest, tag)

    def _irecv(self, buf: Any, source: int, tag: int) -> Request:
        if self._cuda:
            _array.sync(buf)
        try:
            req = self.comm.Irecv([buf, self._byte], source, tag)
        except (BufferError, ValueError, TypeError) as exc:
            raise TransportError(f"rank {self.rank}: cannot receive into this buffer from "
                                 f"rank {source}: {exc} (contiguous, writable buffers only)"
                                 ) from None
        return _Req(self, req, self.MPI.Status(), buf.nbytes, source, tag)

    def waitall(self, requests: Sequence[Request], timeout: float | None = None) -> None:
        """Poll until every request completes; on a deadline or an error, cancel the
        pending receives and keep the pending sends (and their buffers) alive."""
        limit = self.timeout if timeout is None else timeout
        try:
            poll(requests, self._deadline(limit), lambda: _expired(self, "a send or receive",
                                                                    limit))
        except BaseException:
            self._abandon(requests)
            raise

    def _abandon(self, requests: Sequence[Any]) -> None:
        for r in requests:
            if not isinstance(r, _Req) or r.done:
                continue
            if r.status is not None:          # a receive: cancel it (sends cannot be)
                try:
                    r.req.Cancel()
                    if r.req.Test():
                        r.done = True
                        continue
                except self.MPI.Exception:
                    pass
            self._orphans.append(r)

    def barrier(self) -> None:
        """``MPI_Ibarrier`` on the private communicator, polled with the deadline."""
        if self.size == 1:
            return
        r = _Req(self, self.comm.Ibarrier(), None, 0, -1, -1)
        try:
            poll([r], self._deadline(None), lambda: _expired(self, "a barrier", self.timeout))
        except BaseException:
            self._orphans.append(r)
            raise

    # -- the library's own allreduce ----------------------------------------------------
    def native_allreduce(self, buf: Any, op: str, dtype: str) -> None:
        """``MPI_Allreduce(MPI_IN_PLACE, buf)`` with the MPI datatype of logical ``dtype``.

        A blocking MPI call: the deadline does not reach inside it (gradcomm's argument
        check, which runs first, does catch an absent rank). float16 and bfloat16 raise
        UnsupportedError: this MPI rejects or silently mis-sums them.
        """
        if dtype not in _DATATYPES:
            raise UnsupportedError(
                f"MPI_Allreduce cannot reduce {dtype} correctly here (Open MPI rejects "
                "float16 and mis-sums bfloat16); use one of gradcomm's algorithms")
        table = _BOOL_OPS if dtype == "bool" else _OPS
        if op not in table:
            raise UnsupportedError(f"MPI_Allreduce has no op {op!r}; known: {', '.join(table)}")
        mpi = self.MPI
        if self._cuda:
            _array.sync(buf)
        try:
            self.comm.Allreduce(mpi.IN_PLACE, [buf, getattr(mpi, _DATATYPES[dtype])],
                                getattr(mpi, table[op]))
        except mpi.Exception as exc:
            raise TransportError(f"rank {self.rank}: MPI_Allreduce failed: "
                                 f"{exc.Get_error_string()}") from None

    def close(self) -> None:
        """Free the private communicator (collective over the ranks). Idempotent."""
        comm, self._comm = self._comm, None
        if comm is None:
            return
        from . import _CACHE

        cached = _CACHE.get(id(self.user_comm))
        if cached is not None and cached[1] is self:
            del _CACHE[id(self.user_comm)]
        if not self.MPI.Is_finalized():
            for r in self._orphans:           # let abandoned sends finish if they can
                try:
                    r.req.Test()
                except self.MPI.Exception:
                    pass
            comm.Free()
        self._orphans.clear()


def _expired(t: Transport, what: str, limit: float) -> DeadlineError:
    return DeadlineError(
        f"rank {t.rank}/{t.size} ({t.name}): {what} did not complete within {limit:g} s; "
        "a peer did not join, failed, or called a different collective")


def cuda_aware() -> bool:
    """Whether the loaded MPI can move CUDA device buffers itself.

    The environment variable ``GRADCOMM_MPI_CUDA_AWARE`` ("1"/"0") decides if set; else
    Open MPI's ``MPIX_Query_cuda_support()`` is asked (a run-time answer: 0 when built
    with CUDA but no GPU is usable); any other MPI is taken as host-only.

    Example:
        >>> isinstance(cuda_aware(), bool)
        True
    """
    forced = os.environ.get(CUDA_AWARE_ENV)
    if forced in ("0", "1"):
        return forced == "1"
    from mpi4py import MPI  # noqa: F401 - loads libmpi and initialises MPI

    for path in _libmpi_paths():
        try:
            query = getattr(ctypes.CDLL(path), "MPIX_Query_cuda_support", None)
        except OSError:
            continue
        if query is not None:
            query.restype = ctypes.c_int
            return bool(query())
    return False


def _libmpi_paths() -> list[str]:
    """Paths of the libmpi this process has loaded (Linux), else the one the linker finds."""
    paths: list[str] = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rsplit(None, 1)[-1]
                if "/libmpi.so" in path and path not in paths:
                    paths.append(path)
    except OSError:
        pass
    if not paths:
        found = ctypes.util.find_library("mpi")
        if found:
            paths.append(found)
    return paths
