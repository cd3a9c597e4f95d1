"""In-process ranks on threads, with real message passing between them.

Messages up to ``eager_limit`` bytes are copied and the send completes at once; larger
sends wait until the receiver has taken them (rendezvous), as MPI's do, so an ordering that
would deadlock under ``mpirun`` deadlocks here too and is caught by the deadline.

Example:
    >>> import numpy as np
    >>> from gradcomm.comm import run_ranks
    >>> run_ranks(2, lambda t: t.rank * 10)
    [0, 10]
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Sequence

import numpy as np

from ..errors import AbortedError, DeadlineError, TransportError
from . import background
from .base import DEFAULT_TIMEOUT, Request, Transport

#: sends up to this many bytes complete without waiting for the receiver (Open MPI's
#: shared-memory eager limit is 4 KiB; TCP's 64 KiB)
EAGER_LIMIT = 64 * 1024


class _Req:
    __slots__ = ("done", "buf", "src", "tag", "peer_req")

    def __init__(self, buf: Any, src: int, tag: int) -> None:
        self.done = False
        self.buf, self.src, self.tag = buf, src, tag
        self.peer_req: _Req | None = None

    def test(self) -> bool:
        return self.done


class _Fabric:
    """Mailboxes of all ranks under one condition variable."""

    def __init__(self, size: int, eager_limit: int) -> None:
        self.size, self.eager_limit = size, eager_limit
        self.cond = threading.Condition()
        self.posted: list[list[_Req]] = [[] for _ in range(size)]    # receives waiting
        self.unexpected: list[list[_Req]] = [[] for _ in range(size)]  # sends waiting
        self.failure: tuple[int, BaseException] | None = None
        self._gather: dict[int, list[Any]] = {}
        self._round = [0] * size

    def abort(self, rank: int, exc: BaseException) -> None:
        with self.cond:
            if self.failure is None:
                self.failure = (rank, exc)
            self.cond.notify_all()

    def check(self, me: int) -> None:
        if self.failure is not None and self.failure[0] != me:
            rank, exc = self.failure
            raise AbortedError(f"rank {me}: abandoned because rank {rank} failed: "
                               f"{type(exc).__name__}: {exc}")

    @staticmethod
    def _deliver(send: _Req, recv: _Req) -> None:
        src, dst = send.buf, recv.buf
        if src.nbytes != dst.nbytes:
            raise TransportError(
                f"message of {src.nbytes} bytes from rank {send.src} (tag {send.tag}) "
                f"but the receive buffer holds {dst.nbytes} bytes")
        if src.nbytes:
            dst.view(np.uint8)[...] = src.view(np.uint8)
        send.done = recv.done = True
        send.buf = None

    def isend(self, buf: np.ndarray, src: int, dest: int, tag: int) -> _Req:
        req = _Req(buf, src, tag)
        with self.cond:
            self.check(src)
            for i, recv in enumerate(self.posted[dest]):
                if recv.src == src and recv.tag == tag:
                    del self.posted[dest][i]
                    self._deliver(req, recv)
                    self.cond.notify_all()
                    return req
            if buf.nbytes <= self.eager_limit:
                req.buf = buf.copy()
                req.done = True            # eager: the sender may reuse its buffer now
                stored = _Req(req.buf, src, tag)
                self.unexpected[dest].append(stored)
            else:
                self.unexpected[dest].append(req)
        return req

    def irecv(self, buf: np.ndarray, me: int, source: int, tag: int) -> _Req:
        req = _Req(buf, source, tag)
        with self.cond:
            self.check(me)
            for i, send in enumerate(self.unexpected[me]):
                if send.src == source and send.tag == tag:
                    del self.unexpected[me][i]
                    self._deliver(send, req)
                    self.cond.notify_all()
                    return req
            self.posted[me].append(req)
        return req

    def wait(self, me: int, reqs: Sequence[_Req], timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                self.check(me)
                if all(r.done for r in reqs):
                    return True
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.cond.wait(left)

    def allgather_objects(self, me: int, obj: Any, timeout: float) -> list[Any]:
        """Every rank contributes ``obj``; all get the list in rank order (shared refs)."""
        deadline = time.monotonic() + timeout
        with self.cond:
            self._round[me] += 1
            slot = self._gather.setdefault(self._round[me], [None] * self.size)
            slot[me] = obj
            self.cond.notify_all()
            while any(v is None for v in slot):
                self.check(me)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise DeadlineError(f"rank {me}: native allreduce: not every rank "
                                        f"joined within {timeout:g} s")
                self.cond.wait(left)
            if all(r >= self._round[me] for r in self._round):
                self._gather.pop(self._round[me], None)   # all joined: free the slot
            return list(slot)


class ThreadTransport(Transport):
    """One rank of an in-process group; made by :func:`run_ranks`."""

    name = "threads"
    native_bounded = True       # its native allreduce waits with the deadline

    def __init__(self, fabric: _Fabric, rank: int, timeout: float = DEFAULT_TIMEOUT) -> None:
        super().__init__(rank, fabric.size, timeout)
        self._fabric = fabric

    def _isend(self, buf: Any, dest: int, tag: int) -> Request:
        return self._fabric.isend(_bytes(buf), self.rank, dest, tag)

    def _irecv(self, buf: Any, source: int, tag: int) -> Request:
        return self._fabric.irecv(_bytes(buf), self.rank, source, tag)

    def waitall(self, requests: Sequence[Request], timeout: float | None = None) -> None:
        """Block until every request completes (the thread's background work runs first,
        while a request is pending: peers deliver without this rank)."""
        t = self.timeout if timeout is None else timeout
        if background.JOBS.get():
            while not all(r.test() for r in requests) and background.step():
                pass
        if not self._fabric.wait(self.rank, requests, t):  # type: ignore[arg-type]
            raise self._expired("a send or receive")

    def native_supports(self, dtype: str, op: str) -> bool:
        """Every dtype: the reduction is gradcomm's own, in rank order."""
        return op in ("sum", "max", "min", "prod")

    def small_allreduce(self, buf: Any, op: str, dtype: str) -> None:
        """:meth:`native_allreduce` (it already waits with the deadline)."""
        self.native_allreduce(buf, op, dtype)

    def native_allreduce(self, buf: Any, op: str, dtype: str) -> None:
        """Shared-memory allreduce: every rank reduces all inputs in rank order."""
        from ..ops import Reducer

        parts = self._fabric.allgather_objects(self.rank, buf.copy(), self.timeout)
        red = Reducer(op, dtype)
        buf[...] = parts[0]
        for part in parts[1:]:
            red.combine(buf, part, buf)


def _bytes(buf: Any) -> np.ndarray:
    if not isinstance(buf, np.ndarray) or not buf.flags.c_contiguous:
        raise TransportError("the threads transport moves contiguous numpy buffers only")
    return buf.reshape(-1)


def run_ranks(n: int, fn: Callable[[Transport], Any], *, timeout: float = 60.0,
              eager_limit: int = EAGER_LIMIT, wait_timeout: float | None = None) -> list[Any]:
    """Run ``fn(transport)`` on ``n`` in-process ranks and return their results in order.

    An exception in any rank aborts the others and is raised here, with a note naming
    the first rank that failed (and ``exc.rank`` set). If the ranks
    have not all finished after ``timeout`` seconds a :class:`DeadlineError` names the
    ones still running. Every blocking wait inside has the deadline ``wait_timeout``
    (default: ``timeout``). No thread is left blocked on return.

    Example:
        >>> run_ranks(4, lambda t: (t.rank, t.size))
        [(0, 4), (1, 4), (2, 4), (3, 4)]
    """
    if n < 1:
        raise TransportError(f"run_ranks needs n >= 1, got {n}")
    fabric = _Fabric(n, eager_limit)
    results: list[Any] = [None] * n
    errors: dict[int, BaseException] = {}

    def body(rank: int) -> None:
        try:
            t = ThreadTransport(fabric, rank, timeout if wait_timeout is None else wait_timeout)
            results[rank] = fn(t)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
            errors[rank] = exc
            fabric.abort(rank, exc)

    threads = [threading.Thread(target=body, args=(r,), name=f"gradcomm-rank{r}",
                                daemon=True) for r in range(n)]
    for th in threads:
        th.start()
    deadline = time.monotonic() + timeout
    for th in threads:
        th.join(max(0.0, deadline - time.monotonic()))
    alive = [r for r, th in enumerate(threads) if th.is_alive()]
    if alive:
        exc = DeadlineError(f"run_ranks: rank(s) {alive} still running after {timeout:g} s")
        fabric.abort(-1, exc)
        for th in threads:
            th.join(5.0)
        raise exc
    if errors:
        first = _first_failure(fabric, errors)
        cause = errors[first]
        cause.add_note(f"raised on rank {first} of {n} (gradcomm.comm.run_ranks)")
        cause.rank = first  # type: ignore[attr-defined]
        raise cause
    return results


def _first_failure(fabric: _Fabric, errors: dict[int, BaseException]) -> int:
    if fabric.failure is not None and fabric.failure[0] in errors:
        return fabric.failure[0]
    return min(errors)
