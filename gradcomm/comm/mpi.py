"""The MPI transport: mpi4py's buffer (upper-case) methods on a private communicator.

:class:`MPITransport` duplicates the user's communicator once (``MPI_Comm_idup``, waited
with the deadline), so library messages can never match the program's own sends and
receives. Buffers travel as raw bytes (``[buf, MPI.BYTE]``) straight from their memory:
numpy arrays through the buffer protocol; device arrays (cupy, torch CUDA) through
``__cuda_array_interface__`` / DLPack when the MPI is CUDA-aware (see
:attr:`MPITransport.devices`). Nothing is pickled.

Every wait polls with a deadline: a peer that never posts its side raises
:class:`~gradcomm.errors.DeadlineError` instead of hanging. A received message of another
size than the posted buffer raises :class:`~gradcomm.errors.TransportError`.

Run multi-rank programs as ``mpirun -n 4 python -m mpi4py prog.py``: an error on one
rank then aborts the job instead of leaving the others waiting.

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
import time
from typing import Any, Sequence

from .. import arrays
from ..errors import ConfigError, DeadlineError, TransportError, UnsupportedError
from ._train import flat, slice_for
from .base import (DEFAULT_TIMEOUT, NETWORK_MAX_CHUNK, NETWORK_WINDOW, ONE_NODE_NATIVE,
                   SPIN_SECONDS, TAG_DATA, Request, Transport, poll)

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

#: duplications abandoned at their deadline, kept alive (MPI may still complete them)
_ABANDONED: list[tuple[Any, Any]] = []


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
        self.check_size(self.status)
        return True

    def check_size(self, status: Any) -> None:
        """For a completed receive: TransportError unless the message filled the buffer."""
        if self.status is None:             # a send (or a collective)
            return
        got = status.Get_count(self.owner.MPI.BYTE)
        if got != self.nbytes:
            raise TransportError(
                f"rank {self.owner.rank}: received a message of {got} bytes from rank "
                f"{self.peer} (tag {self.tag}) into a buffer of {self.nbytes} bytes")


class MPITransport(Transport):
    """Point-to-point over a private duplicate of the mpi4py intracommunicator ``comm``.

    Args:
        comm: an ``mpi4py.MPI.Intracomm`` (e.g. ``MPI.COMM_WORLD``). It is duplicated once
            here (a collective call: every rank of ``comm`` must construct the transport,
            within ``timeout``, else DeadlineError); :meth:`close` frees the duplicate.
        timeout: seconds each blocking wait may take before ``DeadlineError``.
    """

    name = "mpi"
    fast_native = True          # MPI_Allreduce of a few hundred bytes is one C call
    # over TCP a message above the eager limit (64 KiB) waits for its receive (a
    # rendezvous): deep windows keep the link streaming, and an instance sends 64 KiB to
    # 4 MiB as eager slices (base.Transport.slice_bytes). Over shared memory (one_node)
    # it double buffers, prefers MPI_Allreduce up to ONE_NODE_NATIVE and never slices.
    window_bytes = NETWORK_WINDOW
    max_chunk_bytes = NETWORK_MAX_CHUNK

    def __init__(self, comm: Any, timeout: float = DEFAULT_TIMEOUT) -> None:
        from mpi4py import MPI

        if not isinstance(comm, MPI.Intracomm):
            raise ConfigError(f"MPITransport needs an mpi4py intracommunicator, got "
                              f"{type(comm).__module__}.{type(comm).__qualname__}")
        super().__init__(comm.Get_rank(), comm.Get_size(), timeout)
        self.MPI = MPI
        self.user_comm = comm
        self._byte = MPI.BYTE
        self._orphans: list[_Req] = []       # abandoned requests, kept with their buffers
        self._comm: Any = self._duplicate(comm)
        self._cuda = cuda_aware()
        if one_node():
            self.window_bytes, self.native_below = 0, ONE_NODE_NATIVE
        self.slice_bytes = 0 if one_node() else slice_for(MPI.COMM_WORLD.Get_attr(MPI.TAG_UB))
        self.devices = frozenset({"cpu", "cuda"}) if self._cuda else frozenset({"cpu"})
        # (dtype, op) -> (MPI datatype, MPI op), filled on first use
        self._native: dict[tuple[str, str], tuple[Any, Any]] = {}
        # non-blocking collectives abandoned at their deadline: until they complete (a late
        # peer joins them), a new collective here would match a peer's older one
        self._stuck: list[tuple[_Req, str]] = []

    def _duplicate(self, comm: Any) -> Any:
        """The private duplicate of ``comm``: ``MPI_Comm_idup`` polled with the deadline, so
        a rank that never constructs its transport (skips the first call, or failed before
        it) is a DeadlineError on the others, not a hang. An abandoned duplication cannot
        be cancelled: it is kept (with its communicator) until the process ends."""
        # through a plain Intracomm: a subclass (e.g. gradcomm's own wrap()) must not leak
        # its overridden methods into the library's private communicator
        plain = self.MPI.Intracomm(comm)
        if self.size == 1:
            return plain.Dup()
        dup, req = plain.Idup()
        r = _Req(self, req, None, 0, -1, -1)
        try:
            poll([r], self._deadline(None), lambda: _expired(
                self, "creating the private communicator (MPI_Comm_idup, collective over "
                "the communicator: every rank must reach its first gradcomm call)",
                self.timeout))
        except BaseException:
            if not r.done:
                _ABANDONED.append((dup, req))
            raise
        return dup

    @property
    def comm(self) -> Any:
        """The private duplicate communicator the library's traffic runs on."""
        if self._comm is None:
            raise TransportError(f"rank {self.rank}: the MPI transport was closed")
        return self._comm

    # -- point-to-point ---------------------------------------------------------------
    def _isend(self, buf: Any, dest: int, tag: int) -> Request:
        if self._cuda:
            arrays.sync(buf)             # kernels still writing a device buffer finish first
        try:
            req = self.comm.Isend([buf, self._byte], dest, tag)
        except (BufferError, ValueError, TypeError) as exc:
            raise TransportError(f"rank {self.rank}: cannot send this buffer to rank "
                                 f"{dest}: {exc} (contiguous buffers only)") from None
        return _Req(self, req, None, buf.nbytes, dest, tag)

    def _irecv(self, buf: Any, source: int, tag: int) -> Request:
        if self._cuda:
            arrays.sync(buf)
        try:
            req = self.comm.Irecv([buf, self._byte], source, tag)
        except (BufferError, ValueError, TypeError) as exc:
            raise TransportError(f"rank {self.rank}: cannot receive into this buffer from "
                                 f"rank {source}: {exc} (contiguous, writable buffers only)"
                                 ) from None
        return _Req(self, req, self.MPI.Status(), buf.nbytes, source, tag)

    def sendrecv(self, sendbuf: Any, dest: int, recvbuf: Any, source: int,
                 tag: int = TAG_DATA) -> None:
        """One exchange, with a short path for the common case (host buffers, both
        completing within the spin): raw requests tested together, no wrappers."""
        if self._cuda or 0 < self.slice_bytes < max(sendbuf.nbytes, recvbuf.nbytes):
            return super().sendrecv(sendbuf, dest, recvbuf, source, tag)   # device; slices
        self._peer(dest)
        self._peer(source)
        st, nr, ns = self.stats, recvbuf.nbytes, sendbuf.nbytes
        st.bytes_received += nr
        st.messages_received += 1
        st.bytes_sent += ns
        st.messages_sent += 1
        comm, byte, MPI = self.comm, self._byte, self.MPI
        try:
            r = comm.Irecv([recvbuf, byte], source, tag)
        except (BufferError, ValueError, TypeError) as exc:
            raise TransportError(f"rank {self.rank}: cannot receive into this buffer from "
                                 f"rank {source}: {exc} (contiguous, writable buffers only)"
                                 ) from None
        rr = _Req(self, r, MPI.Status(), nr, source, tag)
        try:
            s = comm.Isend([sendbuf, byte], dest, tag)
        except (BufferError, ValueError, TypeError) as exc:
            self._abandon([rr])
            raise TransportError(f"rank {self.rank}: cannot send this buffer to rank "
                                 f"{dest}: {exc} (contiguous buffers only)") from None
        sr = _Req(self, s, None, ns, dest, tag)
        statuses = [rr.status, MPI.Status()]
        raw, testall = [r, s], MPI.Request.Testall
        stop = time.monotonic() + SPIN_SECONDS
        try:
            while not testall(raw, statuses):
                if time.monotonic() > stop:
                    break
            else:
                rr.done = sr.done = True
                rr.check_size(statuses[0])
                return
        except MPI.Exception as exc:
            try:
                self._testall_failed([rr, sr], statuses, exc)
            finally:
                self._abandon([rr, sr])
        self.waitall([rr, sr])

    def waitall(self, requests: Sequence[Request], timeout: float | None = None) -> None:
        """Poll until every request completes; on a deadline or an error, cancel the
        pending receives and keep the pending sends (and their buffers) alive.

        Several requests are first tested together with ``MPI_Testall`` for up to
        :data:`~gradcomm.comm.base.SPIN_SECONDS` (one C call per test: the common
        small exchange completes here), then one by one with the generic back-off.
        """
        limit = self.timeout if timeout is None else timeout
        try:
            if len(requests) > 1 and self._spin_all(requests):
                return
            poll(requests, self._deadline(limit), lambda: _expired(self, "a send or receive",
                                                                    limit))
        except BaseException:
            self._abandon(flat(requests))     # a train's slices one by one
            raise

    def _spin_all(self, requests: Sequence[Request]) -> bool:
        """Test the pending requests together until all complete (True) or the spin time
        is over (False, nothing completed by this call is lost: see below)."""
        pending = [r for r in requests if not (isinstance(r, _Req) and r.done)]
        if not pending:
            return True
        if not all(isinstance(r, _Req) for r in pending):
            return False
        raw = [r.req for r in pending]          # type: ignore[union-attr]
        statuses = [self.MPI.Status() for _ in raw]
        testall = self.MPI.Request.Testall
        stop = time.monotonic() + SPIN_SECONDS
        try:
            while not testall(raw, statuses):
                if time.monotonic() > stop:
                    return False                # MPI_Testall completes all or none
        except self.MPI.Exception as exc:
            self._testall_failed(pending, statuses, exc)    # type: ignore[arg-type]
        for r, st in zip(pending, statuses):
            r.done = True                       # type: ignore[union-attr]
            r.check_size(st)                    # type: ignore[union-attr]
        return True

    def _testall_failed(self, pending: list[_Req], statuses: list[Any], exc: Any) -> None:
        """After ``MPI_Testall`` reported an error: mark what completed, raise for the first
        request that failed."""
        MPI = self.MPI
        failed = None
        for r, st in zip(pending, statuses):
            err = st.Get_error()
            if err == MPI.SUCCESS:
                r.done = True
            elif err != MPI.ERR_PENDING and failed is None:
                failed = (r, err)
        r, err = failed if failed is not None else (pending[0], exc.Get_error_code())
        r.done = True
        raise TransportError(
            f"rank {self.rank}: MPI error on a message from/to rank {r.peer} (tag {r.tag}, "
            f"buffer of {r.nbytes} bytes): {MPI.Get_error_string(err)}") from None

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
        self._collectives_usable()
        self._collective(self.comm.Ibarrier(), "a barrier")

    def _collective(self, req: Any, what: str) -> None:
        """Poll a non-blocking collective with the deadline. One abandoned at its deadline
        cannot be cancelled and would match a peer's next collective, so the transport then
        refuses further collectives (point-to-point goes on working)."""
        r = _Req(self, req, None, 0, -1, -1)
        try:
            poll([r], self._deadline(None), lambda: _expired(self, what, self.timeout))
        except BaseException as exc:
            if not r.done:
                self._orphans.append(r)
                self._stuck.append((r, f"{what} abandoned ({type(exc).__name__})"))
            raise

    def _collectives_usable(self) -> None:
        """TransportError while an abandoned collective is still pending (it would pair
        with the peers' next collective instead of this one)."""
        if not self._stuck:
            return
        try:
            self._stuck = [(r, w) for r, w in self._stuck if not r.test()]
        except TransportError:
            pass
        if self._stuck:
            raise TransportError(
                f"rank {self.rank}: {self._stuck[0][1]} is still pending and would match a "
                "peer's next collective, so this MPI transport starts no collective until "
                "the late rank(s) join it; or close() it and create a new one")

    # -- the library's own allreduce ----------------------------------------------------
    def native_supports(self, dtype: str, op: str) -> bool:
        """Every dtype but float16/bfloat16 (which this MPI rejects or mis-sums)."""
        return dtype in _DATATYPES and op in (_BOOL_OPS if dtype == "bool" else _OPS)

    def _mpi_types(self, dtype: str, op: str) -> tuple[Any, Any]:
        types = self._native.get((dtype, op))
        if types is not None:
            return types
        if dtype not in _DATATYPES:
            raise UnsupportedError(
                f"MPI_Allreduce cannot reduce {dtype} correctly here (Open MPI rejects "
                "float16 and mis-sums bfloat16); use one of gradcomm's algorithms")
        table = _BOOL_OPS if dtype == "bool" else _OPS
        if op not in table:
            raise UnsupportedError(f"MPI_Allreduce has no op {op!r}; known: {', '.join(table)}")
        types = getattr(self.MPI, _DATATYPES[dtype]), getattr(self.MPI, table[op])
        self._native[(dtype, op)] = types
        return types

    def native_allreduce(self, buf: Any, op: str, dtype: str) -> None:
        """``MPI_Allreduce(MPI_IN_PLACE, buf)`` with the MPI datatype of logical ``dtype``.

        A blocking MPI call: the deadline does not reach inside it (gradcomm's argument
        check, which runs first, does catch an absent rank). float16 and bfloat16 raise
        UnsupportedError: this MPI rejects or silently mis-sums them.
        """
        types = self._native.get((dtype, op)) or self._mpi_types(dtype, op)
        if self._stuck:
            self._collectives_usable()
        if self._cuda:
            arrays.sync(buf)
        comm = self._comm if self._comm is not None else self.comm     # (raises if closed)
        try:
            comm.Allreduce(self.MPI.IN_PLACE, [buf, types[0]], types[1])
        except self.MPI.Exception as exc:
            raise TransportError(f"rank {self.rank}: MPI_Allreduce failed: "
                                 f"{exc.Get_error_string()}") from None

    def small_allreduce(self, buf: Any, op: str, dtype: str) -> None:
        """``MPI_Iallreduce(MPI_IN_PLACE, buf)`` polled with the deadline (DeadlineError
        if a rank does not join; the transport then refuses further collectives). About
        twice ``MPI_Allreduce``'s latency, still well under a point-to-point round."""
        datatype, mpi_op = self._native.get((dtype, op)) or self._mpi_types(dtype, op)
        if self._stuck:
            self._collectives_usable()
        if self.size == 1:
            return
        try:
            req = self.comm.Iallreduce(self.MPI.IN_PLACE, [buf, datatype], mpi_op)
            stop = time.monotonic() + SPIN_SECONDS
            while not req.Test():                 # completes within the spin when all joined
                if time.monotonic() > stop:
                    break
            else:
                return
        except self.MPI.Exception as exc:
            raise TransportError(f"rank {self.rank}: MPI_Iallreduce failed: "
                                 f"{exc.Get_error_string()}") from None
        self._collective(req, "an allreduce of the argument check")

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


def one_node(env: Any = None) -> bool:
    """Whether Open MPI started every rank of the job on this node with its shared-memory
    path allowed (local size = world size, pml ``ob1``, ``sm`` not left out of
    ``OMPI_MCA_btl``). False for several nodes, ``--mca btl tcp,self`` (bench/netns.py),
    other layers and other MPIs. ``env``: default ``os.environ``.

    Example:
        >>> one_node({"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"})
        True
        >>> one_node({"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
        ...           "OMPI_MCA_btl": "tcp,self"})
        False
    """
    env = os.environ if env is None else env
    size = env.get("OMPI_COMM_WORLD_SIZE")
    if (not size or env.get("OMPI_COMM_WORLD_LOCAL_SIZE") != size
            or env.get("OMPI_MCA_pml", "ob1") != "ob1"):
        return False
    btl = env.get("OMPI_MCA_btl", "").replace(" ", "")
    if not btl:
        return True
    named = {"sm", "vader"} & set(btl.lstrip("^").split(","))
    return not named if btl.startswith("^") else bool(named)


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
