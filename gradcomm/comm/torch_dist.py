"""The torch.distributed transport: point-to-point ``isend``/``irecv`` on any backend.

:class:`TorchTransport` moves flat buffers as raw bytes (a ``torch.uint8`` tensor sharing
the buffer's memory: numpy arrays through ``torch.from_numpy``, no copy), so every storage
dtype travels, bfloat16 included. Group ranks are mapped to global ranks once. Library
messages carry tags offset by :data:`TAG_OFFSET`, so on gloo they never match a program's
own ``send``/``recv`` on the same group (NCCL ignores tags: give gradcomm its own group
there if the program also does point-to-point on it).

Waits have deadlines: each pending operation is waited on with the time left
(``work.wait(timeout=...)``): gloo's point-to-point works only report completion from
``wait``, so ``is_completed()`` cannot be polled. After a deadline gloo closes the
connection to that peer: treat the transport as broken.

gloo checks less than MPI: a message longer than the posted receive aborts the receiving
process inside gloo, and a shorter one is accepted silently. gradcomm's collectives post
exact sizes derived from the agreed arguments, so neither happens in correct use.

Example (one process, a one-rank gloo group):
    >>> import os, tempfile, numpy as np, torch.distributed as dist
    >>> path = os.path.join(tempfile.mkdtemp(), "store")
    >>> dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1)
    >>> t = TorchTransport(None, timeout=5)
    >>> (t.name, t.rank, t.size, t.backend)
    ('torch', 0, 1, 'gloo')
    >>> buf = np.arange(3.0); t.native_allreduce(buf, "sum", "float64"); buf.tolist()
    [0.0, 1.0, 2.0]
    >>> dist.destroy_process_group()
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any, Sequence

from .. import arrays
from . import background, torch_teardown
from ..errors import ConfigError, DeadlineError, TransportError, UnsupportedError
from .base import DEFAULT_TIMEOUT, NETWORK_MAX_CHUNK, Request, Transport

#: added to gradcomm's tags (all below TAG_USER) on the wire
TAG_OFFSET = 0x67630000

_OPS = {"sum": "SUM", "max": "MAX", "min": "MIN", "prod": "PRODUCT"}
#: dtypes each backend's all_reduce cannot reduce (gloo: "Invalid scalar type")
_NATIVE_UNSUPPORTED = {
    "gloo": frozenset({"int16", "uint16", "uint32", "uint64"}),
    "nccl": frozenset({"int16", "uint16", "uint32", "uint64", "bool"}),
}


class _Work:
    """A pending torch.distributed operation, with the buffer it must keep alive."""

    __slots__ = ("work", "buf", "peer", "what", "done")

    def __init__(self, work: Any, buf: Any, peer: int, what: str) -> None:
        self.work, self.buf, self.peer, self.what = work, buf, peer, what
        self.done = False

    def test(self) -> bool:
        """True once known complete. gloo point-to-point works only complete inside
        ``wait``: use :meth:`TorchTransport.waitall` to wait for them."""
        if not self.done and self.work.is_completed():
            self.done = True
        return self.done


class TorchTransport(Transport):
    """Point-to-point over the ``torch.distributed`` process group ``group``.

    Args:
        group: a ``ProcessGroup``, or None for the default group (initialised).
        timeout: seconds each blocking wait may take before ``DeadlineError``.
    """

    name = "torch"
    native_bounded = True       # its native allreduce waits with the deadline
    # gloo moves messages on its own threads: double buffering keeps a slow link busy,
    # a deep window does not (bench/RESULTS.md, "Figures moved out of the code")
    max_chunk_bytes = NETWORK_MAX_CHUNK
    # gloo's own all_reduce beats gradcomm's fp16 ring on the same bytes over this
    # transport (bench/RESULTS.md, issue 12)
    native_preferred = True

    def __init__(self, group: Any = None, timeout: float = DEFAULT_TIMEOUT) -> None:
        import torch
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise ConfigError("TorchTransport needs torch.distributed initialised "
                              "(dist.init_process_group)")
        if group is None:
            group = dist.group.WORLD
        torch_teardown.install()            # the group is let go of when destroyed
        rank = dist.get_rank(group)
        if rank < 0:
            raise ConfigError("this process is not a member of the given process group")
        size = dist.get_world_size(group)
        super().__init__(rank, size, timeout)
        self.torch, self.dist, self.group = torch, dist, group
        self.backend = str(dist.get_backend(group))
        self._global = [dist.get_global_rank(group, r) for r in range(size)]
        self.devices = frozenset({"cuda"}) if self.backend == "nccl" else frozenset({"cpu"})
        self.tagged = self.backend != "nccl"
        self._orphans: list[_Work] = []      # abandoned operations, kept with their buffers

    def _tensor(self, buf: Any) -> Any:
        if "cuda" in self.devices:
            arrays.sync(buf)
        try:
            return arrays.torch_bytes(buf)
        except (RuntimeError, ValueError) as exc:
            raise TransportError(f"rank {self.rank}: cannot move this buffer: {exc} "
                                 "(flat contiguous buffers only)") from None

    def _isend(self, buf: Any, dest: int, tag: int) -> Request:
        t = self._tensor(buf)
        work = self.dist.isend(t, self._global[dest], group=self.group, tag=tag + TAG_OFFSET)
        return _Work(work, t, dest, "send to")

    def _irecv(self, buf: Any, source: int, tag: int) -> Request:
        t = self._tensor(buf)
        work = self.dist.irecv(t, self._global[source], group=self.group,
                               tag=tag + TAG_OFFSET)
        return _Work(work, t, source, "receive from")

    def waitall(self, requests: Sequence[Request], timeout: float | None = None) -> None:
        """Wait for each request with the time left before the deadline."""
        limit = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        if background.JOBS.get() and any(isinstance(r, _Work) and not r.done
                                         for r in requests):
            while background.step():        # gloo moves the bytes on its own threads
                pass
        for i, r in enumerate(requests):
            if not isinstance(r, _Work):
                raise TransportError(f"rank {self.rank}: not a torch transport request: {r!r}")
            if r.done:
                continue
            try:
                self._wait(r.work, deadline, limit, f"a {r.what} rank {r.peer}")
            except BaseException:
                self._orphans.extend(w for w in requests[i:] if isinstance(w, _Work)
                                     and not w.done)
                raise
            r.done = True
            r.buf = None

    def _wait(self, work: Any, deadline: float, limit: float, what: str) -> None:
        left = deadline - time.monotonic()
        try:
            if left <= 0 and not work.is_completed():
                raise RuntimeError("timed out")
            work.wait(timeout=timedelta(seconds=max(left, 1e-3)))
        except RuntimeError as exc:
            text = str(exc)
            if time.monotonic() >= deadline - 1e-3 or "timed out" in text.lower():
                raise DeadlineError(
                    f"rank {self.rank}/{self.size} (torch {self.backend}): {what} did not "
                    f"complete within {limit:g} s; a peer did not join, failed, or called a "
                    "different collective") from None
            raise TransportError(f"rank {self.rank} (torch {self.backend}): {what} failed: "
                                 f"{text.splitlines()[0] if text else exc!r}") from None

    def native_supports(self, dtype: str, op: str) -> bool:
        """What :meth:`native_allreduce` accepts (gloo: not int16 or wide unsigned)."""
        return (op in _OPS and dtype not in _NATIVE_UNSUPPORTED.get(self.backend, ())
                and hasattr(self.torch, dtype))

    def small_allreduce(self, buf: Any, op: str, dtype: str) -> None:
        """:meth:`native_allreduce` (it waits with the deadline). Not used by the argument
        check (``fast_native`` is False: gloo's all_reduce costs milliseconds)."""
        self.native_allreduce(buf, op, dtype)

    def native_allreduce(self, buf: Any, op: str, dtype: str) -> None:
        """``dist.all_reduce`` in place on ``buf`` (viewed as the torch dtype), with the
        deadline. UnsupportedError for dtypes the backend cannot reduce (gloo: int16 and
        unsigned types wider than 8 bits)."""
        work = self.native_allreduce_start(self._tensor(buf), op, dtype)
        self.native_allreduce_wait(work)

    def native_allreduce_start(self, t: Any, op: str, dtype: str) -> Any:
        """Start ``dist.all_reduce`` in place on ``t`` (a torch tensor, or a flat host
        buffer; viewed as ``dtype``) and return its work for :meth:`native_allreduce_wait`.
        No host synchronisation for a tensor: torch orders a device collective after the
        work already queued on the current stream, so a caller on the autograd thread
        keeps the order DDP issues in."""
        if not isinstance(t, self.torch.Tensor):
            t = self._tensor(t)
        if dtype in _NATIVE_UNSUPPORTED.get(self.backend, ()):
            raise UnsupportedError(f"torch.distributed {self.backend} all_reduce cannot "
                                   f"reduce {dtype}; use one of gradcomm's algorithms")
        if op not in _OPS:
            raise UnsupportedError(f"all_reduce has no op {op!r}; known: {', '.join(_OPS)}")
        return self.dist.all_reduce(t.view(getattr(self.torch, dtype)),
                                    op=getattr(self.dist.ReduceOp, _OPS[op]),
                                    group=self.group, async_op=True)

    def native_allreduce_wait(self, work: Any) -> None:
        """Wait for :meth:`native_allreduce_start`'s work, within the deadline (a device
        collective is polled: its ``wait`` would only order streams)."""
        deadline = time.monotonic() + self.timeout
        if "cpu" not in self.devices:
            while not work.is_completed():
                if time.monotonic() >= deadline:
                    break                   # _wait reports the deadline
                time.sleep(20e-6)
        self._wait(work, deadline, self.timeout, "all_reduce")
