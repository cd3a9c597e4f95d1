"""The per-hop compressed ring with its codec work on a worker thread.

The same schedule as :mod:`~gradcomm.collectives.ring` (segments, chunks, the order of
every wire operation, so the same bytes and the same hop residuals), but the wire's
codec work runs on one worker thread while the calling thread only moves messages:

1. Every receive of the whole schedule is posted up front, each into its own buffer
   (the compressed wire hands out distinct buffers), and the worker starts encoding the
   rank's own chunks.
2. The calling thread polls: a finished receive becomes a worker task (decode-and-add
   then re-encode, or decode into place); a task's output, and every finished segment
   received in the allgather phase, is sent to the next rank as soon as everything
   queued before it has been sent (the receiver matches messages in schedule order).
3. The worker runs the tasks in schedule order. numba kernels release the GIL, so chunk
   i+1 is compressed while chunk i is on the wire, and the MPI library keeps being
   driven (progress) while the codec runs: codec time hides behind transfer time.

Used only on transports whose requests can be polled (:data:`POLLABLE`), for large
messages (:data:`MIN_BYTES`; a thread costs more than it hides on small ones), and when
the node has a spare core per rank for the worker, or a calibrated profile says the link
is the bottleneck (measurements: ``bench/COMPRESSED.md``). Every wait has the transport's
deadline; an error on the worker (a bad peer frame) or a deadline abandons the pending
messages and is raised in the caller.

The environment variable ``GRADCOMM_PIPELINE`` set to ``0`` turns the pipelined path
off, ``1`` forces it at any size (tests, measurements).

Example:
    >>> import numpy as np
    >>> from gradcomm import compressors
    >>> from gradcomm.comm import run_ranks
    >>> from gradcomm.compressed.seeds import Seeds
    >>> from gradcomm.compressed.wire import CompressedWire
    >>> def fn(t):
    ...     x = np.full(5, t.rank + 1.0, np.float32)
    ...     seeds = Seeds(0, 0, "w", t.rank, False)
    ...     allreduce(t, x, CompressedWire(compressors.get("fp16"), x, seeds), chunk_bytes=8)
    ...     return x.tolist()
    >>> run_ranks(3, fn)[0]
    [6.0, 6.0, 6.0, 6.0, 6.0]
"""

from __future__ import annotations

import collections
import os
import threading
import time
from typing import Any, Callable

from .. import arrays
from ..comm.base import TAG_DATA, Request, Transport
from ..errors import DeadlineError
from ..collectives._segments import ring_schedule

#: dense bytes from which compressed ring allreduces take the pipelined path by default
MIN_BYTES = 4 << 20
#: environment variables launchers set to the number of ranks on this node
LOCAL_SIZE_VARS = ("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "MV2_COMM_WORLD_LOCAL_SIZE",
                   "LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE")
#: longest sleep of the polling loop when nothing moved (seconds)
MAX_PAUSE = 5e-4


#: transports whose requests report completion when polled (gloo's point-to-point works
#: complete only inside wait(): there the serial ring, whose transfers gloo's own threads
#: already overlap with the codec, is used)
POLLABLE = ("mpi", "threads")


def local_ranks(t: Transport | None) -> int:
    """Ranks sharing this node's cores: the launcher's count, all of them for in-process
    ranks, else 1."""
    for var in LOCAL_SIZE_VARS:
        try:
            v = int(os.environ.get(var, ""))
        except ValueError:
            continue
        if v > 0:
            return v
    return t.size if t is not None and t.name == "threads" else 1


def wanted(nbytes: int, t: Transport | None = None, link_bound: bool = False) -> bool:
    """Whether a compressed ring of ``nbytes`` dense bytes on ``t`` takes this path: a
    pollable transport, a large message, and either a spare core per rank for its worker
    or a link so slow (``link_bound``: a calibrated profile models the wire time above
    twice the codec time) that keeping it busy is worth sharing the cores."""
    if t is not None and t.name not in POLLABLE:
        return False
    env = os.environ.get("GRADCOMM_PIPELINE", "")
    if env in ("0", "1"):
        return env == "1"
    return nbytes >= MIN_BYTES and (
        link_bound or (os.cpu_count() or 1) >= 2 * local_ranks(t))


class _Task:
    __slots__ = ("fn", "args", "done", "value")

    def __init__(self, fn: Callable[..., Any] | None, args: tuple[Any, ...]) -> None:
        self.fn, self.args = fn, args
        self.done = fn is None           # a ready value (a forwarded buffer)
        self.value: Any = args[0] if fn is None else None


class _Worker:
    """One thread running tasks in submission order; ``wake`` is set after each."""

    def __init__(self) -> None:
        self.wake = threading.Event()
        self.error: BaseException | None = None
        self._queue: collections.deque[_Task] = collections.deque()
        self._more = threading.Condition()
        self._stop = False
        self.pending = 0
        self._thread = threading.Thread(target=self._run, name="gradcomm-codec", daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> _Task:
        task = _Task(fn, args)
        with self._more:
            self.pending += 1
            self._queue.append(task)
            self._more.notify()
        return task

    def _run(self) -> None:
        while True:
            with self._more:
                while not self._queue and not self._stop:
                    self._more.wait()
                if self._stop:
                    return
                task = self._queue.popleft()
            try:
                if self.error is None:
                    task.value = task.fn(*task.args)       # type: ignore[misc]
            except BaseException as exc:                   # handed to the caller
                self.error = exc
            task.done = True
            with self._more:
                self.pending -= 1
            self.wake.set()

    def close(self) -> None:
        with self._more:
            self._stop = True
            self._queue.clear()
            self._more.notify()
        self._thread.join()


def allreduce(t: Transport, buf: Any, wire: Any, *, tag: int = TAG_DATA,
              chunk_bytes: int) -> None:
    """Ring allreduce of flat ``buf`` in place through ``wire`` (a compressed wire whose
    ``partial_buffer``/``final_buffer`` return distinct buffers), codec on a worker."""
    p, rank, n = t.size, t.rank, arrays.size(buf)
    if p == 1 or n == 0:
        return
    right, left = (rank + 1) % p, (rank - 1) % p
    last = 2 * p - 3                        # steps 0..p-2 reduce, p-1..2p-3 gather
    first, jobs = ring_schedule(n, p, rank, max(1, chunk_bytes // arrays.itemsize(buf)))
    landings = [wire.partial_buffer(hi - lo, buf, slot=i % 2) if s < p - 1 else
                wire.final_buffer(hi - lo, buf[lo:hi]) for i, (s, lo, hi) in enumerate(jobs)]
    recvs: list[Request] = []
    sends: list[Request] = []
    work = _Worker()
    try:
        recvs = [t.irecv(landing, left, tag) for landing in landings]
        outq: collections.deque[_Task] = collections.deque(
            work.submit(wire.encode, buf[lo:hi]) for lo, hi in first)

        def hop(landing: Any, seg: Any, final: bool) -> Any:
            wire.reduce(landing, seg, left < rank)
            return wire.final(seg) if final else wire.encode(seg)

        nxt, pause = 0, 0.0
        deadline = time.monotonic() + t.timeout
        while True:
            work.wake.clear()
            moved = False
            while outq and outq[0].done and work.error is None:
                sends.append(t.isend(outq.popleft().value, right, tag))
                moved = True
            if work.error is not None:
                raise work.error
            while nxt < len(jobs) and recvs[nxt].test():
                s, lo, hi = jobs[nxt]
                seg, landing = buf[lo:hi], landings[nxt]
                if s < p - 1:
                    outq.append(work.submit(hop, landing, seg, s + 1 == p - 1))
                else:
                    if s < last:            # forward the very bytes the owner produced
                        outq.append(_Task(None, (landing,)))
                    work.submit(wire.place, landing, seg)
                nxt += 1
                moved = True
            if nxt == len(jobs) and not outq and work.pending == 0:
                break
            if moved:
                pause = 0.0
                deadline = time.monotonic() + t.timeout
                continue
            if time.monotonic() > deadline:
                raise DeadlineError(
                    f"rank {t.rank}/{t.size} ({t.name}): a compressed ring step did not "
                    f"complete within {t.timeout:g} s; a peer did not join, failed, or "
                    "called a different collective")
            t.waitall([])                   # lets an aborting transport raise
            pause = min(max(2 * pause, 1e-5), MAX_PAUSE)
            work.wake.wait(pause)
        if work.error is not None:
            raise work.error
        t.waitall(sends)
    except BaseException:
        work.close()
        pending = []
        for r in recvs + sends:
            try:
                if not r.test():
                    pending.append(r)
            except Exception:                      # noqa: BLE001 - already failed
                pass
        if pending:
            try:
                t.waitall(pending, timeout=1e-6)   # abandons them (cancels receives)
            except Exception:                      # noqa: BLE001 - the first error wins
                pass
        raise
    work.close()
