"""The transport interface every collective is written against.

A transport moves flat, contiguous buffers between ranks. Collectives only ever call
``isend``/``irecv``/``waitall`` (and the conveniences built on them here), so the same
algorithm runs over MPI, torch.distributed or in-process threads.

Example:
    >>> from gradcomm.comm import run_ranks
    >>> import numpy as np
    >>> def fn(t):
    ...     out = np.empty(1, np.int64)
    ...     t.sendrecv(np.array([t.rank]), (t.rank + 1) % t.size, out, (t.rank - 1) % t.size)
    ...     return int(out[0])
    >>> run_ranks(3, fn)
    [2, 0, 1]
"""

from __future__ import annotations

import os
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Protocol, Sequence

from ..errors import ConfigError, DeadlineError, TransportError
from . import background
from ._train import train
from .state import NATIVE_BELOW, TransportState

#: default deadline of one blocking wait, seconds
DEFAULT_TIMEOUT = 120.0

# Tags below TAG_USER are the library's; each subsystem has its own so that their messages
# can never match each other's. Collectives are issued in the same order on every rank, and
# messages between a pair with one tag are non-overtaking, so one tag per subsystem suffices.
TAG_CHECK = 1
TAG_BARRIER = 2
TAG_DATA = 3
TAG_SIZES = 4
TAG_GOSSIP = 5
TAG_PROFILE = 6
TAG_USER = 100

#: the message size of pipelined collectives (ring, tree) on the in-process transport, and
#: their smallest one anywhere: small enough that a reduction overlaps the next transfer
PIPELINE_CHUNK = 512 * 1024
#: what the network transports use: receives posted ahead, in bytes per peer (MPI), and
#: the largest message of a pipelined dense collective (MPI and torch)
NETWORK_WINDOW = 64 << 20
NETWORK_MAX_CHUNK = 16 << 20
#: :attr:`Transport.native_below` of MPI over shared memory: there a checked
#: MPI_Allreduce beats the ring 2-3x from 64 to 256 KiB, and ties it from 1 to 8 MiB
#: (bench/RESULTS.md, issue 12)
ONE_NODE_NATIVE = 1 << 20


class Request(Protocol):
    """A pending send or receive; ``test()`` is True once complete."""

    def test(self) -> bool: ...


@dataclass
class Stats:
    """Bytes and messages this rank sent and received since the last ``reset()``."""

    bytes_sent: int = 0
    messages_sent: int = 0
    bytes_received: int = 0
    messages_received: int = 0

    def reset(self) -> None:
        self.bytes_sent = self.messages_sent = 0
        self.bytes_received = self.messages_received = 0

    def snapshot(self) -> dict[str, int]:
        return dict(self.__dict__)


class Transport(ABC):
    """Point-to-point message passing between ``size`` ranks.

    Subclasses implement ``_isend``, ``_irecv`` and ``waitall``. Buffers are contiguous
    1-D arrays (numpy on the host; device arrays where the transport says it can).
    A receive must be posted with exactly the size of the matching send.
    """

    rank: int
    size: int
    timeout: float
    #: array devices this transport moves without staging: {"cpu"} or {"cpu", "cuda"}
    devices: frozenset[str] = frozenset({"cpu"})
    #: short name used in messages and benchmarks ("threads", "mpi", "torch")
    name: str = "transport"
    #: True where the library's own allreduce of a small buffer is cheaper than a
    #: recursive doubling of point-to-point messages (MPI: one C call; not gloo, whose
    #: all_reduce costs milliseconds). Then the argument check uses
    #: :meth:`small_allreduce`, and ``algorithm="auto"`` may hand small checked messages
    #: to :meth:`native_allreduce`. May be set per instance.
    fast_native: bool = False
    #: below this many bytes ``auto``'s built-in table (no profile) prefers the
    #: library's allreduce where :attr:`fast_native` allows it (MPI over shared memory:
    #: larger, bench/RESULTS.md). The ranks agree on it with the profile (any
    #: difference: :data:`~gradcomm.comm.state.NATIVE_BELOW` everywhere). Per instance.
    native_below: int = NATIVE_BELOW
    #: True where :meth:`native_allreduce` waits with the deadline (so ``auto`` may pick it
    #: for calls without the argument check); MPI's blocking MPI_Allreduce does not
    native_bounded: bool = False
    #: True where the library's own allreduce of a large buffer is faster than gradcomm's
    #: algorithms on the same bytes (gloo's C++ ring: bench/RESULTS.md); ``auto`` takes it
    #: for checked dense calls from 1 MiB, and the DDP hook sums its 16-bit cast payloads
    #: (fp16, bf16) with it (``integrations/ddp/cast.py``)
    native_preferred: bool = False
    #: True where a message only matches a receive of its own tag (threads, MPI, gloo);
    #: NCCL ignores tags, so there ``check="first"`` checks every call (its skipped calls
    #: carry their arguments in the tag). May be set per instance.
    tagged: bool = True
    #: bytes of receives a pipelined collective keeps posted ahead of the one it waits
    #: for, per peer (at least one message: 0 = double buffering, the in-process
    #: transport's memory-speed choice). Over a network, a receive posted late costs a
    #: rendezvous round trip with the link idle; a deep window keeps it streaming.
    #: Local to each rank (it never changes which bytes move).
    window_bytes: int = 0
    #: messages of more than this many bytes (up to ``_train.MAX_TRAIN_BYTES``) travel
    #: as consecutive slices of at most this size (:mod:`gradcomm.comm._train`: below
    #: the library's eager limit, so none waits for a rendezvous behind queued data);
    #: 0: one message each. Every rank must agree (the MPI transport: between nodes).
    slice_bytes: int = 0
    #: largest message :meth:`chunk_bytes` cuts a segment into
    max_chunk_bytes: int = PIPELINE_CHUNK
    #: messages per segment :meth:`chunk_bytes` aims at (enough for a reduction to overlap
    #: the transfers, few enough that per-message costs stay small)
    chunks_per_segment: int = 8

    def __init__(self, rank: int, size: int, timeout: float = DEFAULT_TIMEOUT) -> None:
        if timeout <= 0:
            raise ConfigError(f"timeout must be > 0 seconds, got {timeout}")
        self.rank, self.size, self.timeout = rank, size, float(timeout)
        self.stats = Stats()
        #: what the collectives keep for this transport from call to call
        self.state = TransportState()

    def chunk_bytes(self, segment_bytes: int) -> int:
        """The message size of a pipelined dense collective whose segments hold
        ``segment_bytes``: :data:`PIPELINE_CHUNK`, or on a transport whose
        :attr:`max_chunk_bytes` allows more, a ``chunks_per_segment``-th of the segment
        up to that bound. A function of the size and the transport's class only, so every
        rank derives the same message sizes; dense results never depend on it (each
        element is reduced alone), and codec framing never asks it.

        Example:
            >>> from gradcomm.comm import run_ranks
            >>> run_ranks(1, lambda t: t.chunk_bytes(50 << 20))[0] == PIPELINE_CHUNK
            True
        """
        per = segment_bytes // max(1, self.chunks_per_segment)
        return max(PIPELINE_CHUNK, min(self.max_chunk_bytes, per))

    # -- to implement -------------------------------------------------------------------
    @abstractmethod
    def _isend(self, buf: Any, dest: int, tag: int) -> Request: ...

    @abstractmethod
    def _irecv(self, buf: Any, source: int, tag: int) -> Request: ...

    @abstractmethod
    def waitall(self, requests: Sequence[Request], timeout: float | None = None) -> None:
        """Block until every request completes; ``DeadlineError`` after ``timeout``."""

    def native_allreduce(self, buf: Any, op: str, dtype: str) -> None:
        """The underlying library's own allreduce, in place on ``buf``.

        ``dtype`` is the logical dtype; ``op`` one of sum/max/min/prod.
        """
        from ..errors import UnsupportedError

        raise UnsupportedError(f"the {self.name} transport has no native allreduce")

    def native_allreduce_start(self, buf: Any, op: str, dtype: str) -> Any:
        """Start :meth:`native_allreduce` of ``buf`` and return what
        :meth:`native_allreduce_wait` waits for; ``buf`` must not change until then. Here:
        the allreduce runs now (a transport whose library has an asynchronous one starts
        it instead, e.g. gloo's)."""
        self.native_allreduce(buf, op, dtype)
        return None

    def native_allreduce_wait(self, work: Any) -> None:
        """Wait, within the deadline, for :meth:`native_allreduce_start`'s ``work``."""

    def native_supports(self, dtype: str, op: str) -> bool:
        """Whether :meth:`native_allreduce` reduces logical ``dtype`` under ``op`` (one of
        sum/max/min/prod) correctly. Cheap; the same answer on every rank."""
        return False

    def small_allreduce(self, buf: Any, op: str, dtype: str) -> None:
        """The library's own allreduce of a small buffer, in place, bounded by the deadline
        (:class:`DeadlineError`, unlike :meth:`native_allreduce`, which may block). Used
        by the argument check where :attr:`fast_native` is set."""
        from ..errors import UnsupportedError

        raise UnsupportedError(f"the {self.name} transport has no bounded native allreduce")

    # -- the interface collectives use ---------------------------------------------------
    def isend(self, buf: Any, dest: int, tag: int = TAG_DATA) -> Request:
        """Start sending ``buf`` to ``dest``; ``buf`` must not change until completion."""
        self._peer(dest)
        self.stats.bytes_sent += buf.nbytes
        self.stats.messages_sent += 1
        if self.slice_bytes:
            return train(lambda b, tg: self._isend(b, dest, tg), buf, self.slice_bytes, tag)
        return self._isend(buf, dest, tag)

    def irecv(self, buf: Any, source: int, tag: int = TAG_DATA) -> Request:
        """Start receiving into ``buf`` (exactly its size) from ``source``."""
        self._peer(source)
        self.stats.bytes_received += buf.nbytes
        self.stats.messages_received += 1
        if self.slice_bytes:
            return train(lambda b, tg: self._irecv(b, source, tg), buf, self.slice_bytes, tag)
        return self._irecv(buf, source, tag)

    def send(self, buf: Any, dest: int, tag: int = TAG_DATA) -> None:
        self.waitall([self.isend(buf, dest, tag)])

    def recv(self, buf: Any, source: int, tag: int = TAG_DATA) -> None:
        self.waitall([self.irecv(buf, source, tag)])

    def sendrecv(self, sendbuf: Any, dest: int, recvbuf: Any, source: int,
                 tag: int = TAG_DATA) -> None:
        """Send to ``dest`` while receiving from ``source`` (deadlock-free pairing)."""
        r = self.irecv(recvbuf, source, tag)
        s = self.isend(sendbuf, dest, tag)
        self.waitall([r, s])

    def barrier(self) -> None:
        """Dissemination barrier: ceil(log2 p) rounds of 1-byte messages."""
        import numpy as np

        token, sink = np.zeros(1, np.uint8), np.empty(1, np.uint8)
        dist = 1
        while dist < self.size:
            self.sendrecv(token, (self.rank + dist) % self.size, sink,
                          (self.rank - dist) % self.size, TAG_BARRIER)
            dist *= 2

    def close(self) -> None:
        """Release resources (private communicators, ...). Idempotent."""

    # -- helpers for subclasses -----------------------------------------------------------
    def _peer(self, peer: int) -> None:
        if not 0 <= peer < self.size or peer == self.rank:
            raise TransportError(f"rank {self.rank}: invalid peer {peer} (size {self.size})")

    def _deadline(self, timeout: float | None) -> float:
        return time.monotonic() + (self.timeout if timeout is None else timeout)

    def _expired(self, what: str) -> DeadlineError:
        return DeadlineError(
            f"rank {self.rank}/{self.size} ({self.name}): {what} did not complete within "
            f"{self.timeout:g} s; a peer did not join, failed, or called a different "
            "collective")


#: a wait spins this long before giving up the CPU (a small message arrives within it)
SPIN_SECONDS = 50e-6
#: then yields the CPU (``sched_yield``) between tests until this long has passed
YIELD_SECONDS = 1e-3
#: then sleeps an eighth of the time waited so far, at most this long, between tests
MAX_SLEEP_SECONDS = 1e-3

_yield = getattr(os, "sched_yield", None) or (lambda: time.sleep(0))


def poll(requests: Sequence[Request], deadline: float, on_expiry: Any) -> None:
    """Test until every request is complete or ``deadline`` (``time.monotonic``) passes.

    ``on_expiry()`` returns the exception to raise. Time-based back-off: spin for
    :data:`SPIN_SECONDS` (small messages arrive within it), then yield the CPU between
    tests until :data:`YIELD_SECONDS`, then sleep an eighth of the time waited so far
    (at most :data:`MAX_SLEEP_SECONDS`), so a late message costs at most ~1/8 more than
    its wait and an idle rank stays off the CPU. After the spin, slices of the calling
    thread's :mod:`~gradcomm.comm.background` work, if any, run between tests instead.
    """
    pending = [r for r in requests if not r.test()]
    if not pending:
        return
    start = time.monotonic()
    work = bool(background.JOBS.get())
    while True:
        pending = [r for r in pending if not r.test()]
        if not pending:
            return
        now = time.monotonic()
        waited = now - start
        if waited < SPIN_SECONDS:
            continue
        if now > deadline:
            raise on_expiry()
        if work and background.step():
            continue
        work = False
        if waited < YIELD_SECONDS:
            _yield()
        else:
            time.sleep(min(waited / 8, MAX_SLEEP_SECONDS, max(deadline - now, 0.0)))
