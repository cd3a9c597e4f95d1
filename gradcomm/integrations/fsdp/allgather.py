"""A quantized parameter all-gather for FSDP2 (the shape of ZeRO++'s qwZ).

``compress_fsdp(model, "int8", weights="int8")`` installs :class:`QuantizedAllGather` on
every FSDPModule (``set_custom_all_gather``). FSDP2 calls it with the flat local shard of
the module's parameters in the param dtype (``MixedPrecisionPolicy(param_dtype=...)``:
float32, bfloat16 or float16) as ``input_tensor`` and the flat ``world_size x`` output;

1. the shard is copied out in float32 at the call (it is a view of the output),
2. a worker thread (one per gather group, first in first out, so every rank runs the
   gathers in FSDP2's order) quantizes it blockwise with the int8 codec (deterministic
   rounding, one min/max per block of ``bucket_size`` elements: about
   ``1 + 8/bucket_size`` bytes per element instead of 4 or 2), all-gathers the payloads
   (:func:`gradcomm.collectives.allgather.allgatherv` over a gloo group of its own) and
   decodes every rank's payload into its slot of the output, its own too (rounded to the
   param dtype), so that every rank computes with the same weights;
3. where FSDP2 can compute before it waits, the call returns a ``torch.distributed.Work``
   at once and FSDP2 waits on it in its copy-out (``wait()`` carries the transport's
   deadline): with ``async_op=True`` (``module.unshard(async_op=True)``, async unshards
   with ``set_modules_to_forward_prefetch``) and inside backward (FSDP2's implicit
   prefetch of the next module to run backward, ``reshard_after_forward=True``). A
   forward unshard with ``async_op=False`` is waited on at once, so there the exchange
   runs inside the call (a thread hand-off would only add latency; measured in
   bench/RESULTS.md) and the call returns None. ``overlap=True`` / ``False`` forces
   either way.

Only what forward and backward compute with is quantized: the sharded master parameters,
the gradients and the optimizer step stay exact (FSDP2 copies the gathered values out to
the unsharded parameters and never writes them back). The error is at most half a
quantization level of each block, every gather afresh, with no state to checkpoint: a
resume restores the master shards and reproduces the same weights bitwise.

Example:
    >>> import torch
    >>> from gradcomm.comm import run_ranks
    >>> def fn(t):
    ...     ag = QuantizedAllGather(side_group=t)
    ...     x = torch.arange(4, dtype=torch.float32) + 4 * t.rank
    ...     out = torch.empty(8)
    ...     ag(out, x, None, async_op=True).wait()
    ...     return out.tolist()
    >>> run_ranks(2, fn)[1]
    [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather

from ... import arrays, compressors
from ...collectives.allgather import allgatherv
from ...compressors.payload import Payload
from ...errors import ConfigError, DeadlineError

#: the weight codecs ``compress_fsdp(weights=...)`` knows
WEIGHT_CODECS = ("int8",)
#: the param dtypes the quantized all-gather takes (coded in float32)
PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class _Worker:
    """One daemon thread running submitted jobs in order (one per gather transport)."""

    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._loop, name="gradcomm-allgather", daemon=True).start()

    def submit(self, job: Callable[[], None]) -> Future:
        done: Future = Future()
        self.jobs.put((job, done))
        return done

    def close(self) -> None:
        """End the thread after the jobs already submitted (its frame keeps the last
        job, whose closure holds the transport and its group)."""
        self.jobs.put(None)

    def _loop(self) -> None:
        while True:
            item = self.jobs.get()
            if item is None:
                return
            job, done = item
            try:
                done.set_result(job())
            except BaseException as exc:    # handed to wait() on the caller's thread
                done.set_exception(exc)


class PendingGather(dist.Work):
    """The ``Work`` a quantized all-gather returns; ``wait()`` re-raises the worker's
    error and gives up with DeadlineError after ``timeout`` seconds."""

    def __init__(self, done: Future, timeout: float) -> None:
        super().__init__()
        self.done, self.timeout = done, timeout

    def wait(self, timeout: Any = None) -> bool:
        try:
            self.done.result(timeout=self.timeout)
        except FutureTimeout:
            raise DeadlineError(f"the quantized weight all-gather did not finish within "
                                f"{self.timeout:g} s (a rank is missing or stalled)") from None
        return True

    def is_completed(self) -> bool:
        return self.done.done()


class QuantizedAllGather(AllGather):
    """FSDP2's parameter all-gather with each shard quantized blockwise (``bits``,
    ``bucket_size``); ``side_group``: the group (or Transport) gradcomm's messages use
    (None: the group FSDP2 passes; :func:`compress_fsdp` gives one of the gathers' own);
    ``overlap``: exchange on the worker thread and return a Work (True), inside the call
    (False), or where FSDP2 can compute before it waits (None, the default)."""

    def __init__(self, bits: int = 8, bucket_size: int = 256, side_group: Any = None,
                 overlap: bool | None = None) -> None:
        self.codec = compressors.get("int8", bits=bits, bucket_size=bucket_size)
        self.side_group, self.overlap = side_group, overlap
        self.calls = self.bytes_sent = 0

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device
                 ) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: Any, async_op: bool = False) -> PendingGather | None:
        from ...comm import get_transport

        if input_tensor.dtype not in PARAM_DTYPES or input_tensor.device.type != "cpu":
            raise ConfigError(
                f"weights='int8' gathers CPU float32, bfloat16 or float16 parameters; got "
                f"{input_tensor.dtype} on {input_tensor.device} (a mixed-dtype module or "
                "fsdp_pre_all_gather extensions gather raw bytes): leave weights=None "
                "there for FSDP2's own all-gather, or give the module one param_dtype")
        if output_tensor.dtype != input_tensor.dtype:
            raise ConfigError(f"all-gather output {output_tensor.dtype} for an input of "
                              f"{input_tensor.dtype}")
        t = get_transport(group if self.side_group is None else self.side_group)
        n = input_tensor.numel()
        if output_tensor.numel() != n * t.size:
            raise ConfigError(f"all-gather output of {output_tensor.numel()} elements for "
                              f"{t.size} shards of {n}")
        self.calls += 1
        # the input is a view of this rank's slot of the output: copy it before decoding
        x = input_tensor.detach().reshape(-1).to(torch.float32, copy=True).numpy()

        def job() -> None:
            self._exchange(t, x, output_tensor)

        overlap = self.overlap
        if overlap is None:         # async unshards, or a prefetch issued inside backward
            overlap = async_op or torch._C._current_graph_task_id() != -1
        if not overlap:
            job()
            return None
        worker = _worker(t)
        # every job ahead of this one may take its own deadline
        return PendingGather(worker.submit(job), t.timeout * (1 + worker.jobs.qsize()))

    def _exchange(self, t: Any, x: np.ndarray, output_tensor: torch.Tensor) -> None:
        n = x.size
        mine = self.codec.compress(x, seed=(0,)).to_bytes()
        before = t.stats.bytes_sent
        blocks = allgatherv(t, mine, max_nbytes=mine.size)
        self.bytes_sent += t.stats.bytes_sent - before
        wide = output_tensor.dtype == torch.float32
        out = arrays.host_view(output_tensor.reshape(-1)) if wide else \
            np.empty(n * t.size, np.float32)
        for r, b in enumerate(blocks):
            self.codec.decompress(Payload.from_bytes(b), out=out[r * n:(r + 1) * n])
        if not wide:                                # round to the param dtype once
            output_tensor.reshape(-1).copy_(torch.from_numpy(out))

    def __repr__(self) -> str:
        return f"QuantizedAllGather({self.codec!r})"


#: the worker of each gather transport (by id; the transport kept alive alongside)
_WORKERS: dict[int, tuple[Any, _Worker]] = {}
_LOCK = threading.Lock()


def _worker(t: Any) -> _Worker:
    with _LOCK:
        got = _WORKERS.get(id(t))
        made = got is None or got[0] is not t
        if made:
            got = _WORKERS[id(t)] = (t, _Worker())
    if made:
        from ...comm import torch_teardown

        torch_teardown.before_destroy(_forget)
    return got[1]


def _forget(group: Any) -> None:
    """End the workers of the transports over torch group ``group`` (None: over any),
    as torch destroys it, so that nothing here keeps a destroyed group, and its gloo
    threads, alive."""
    from ...comm.torch_dist import TorchTransport

    with _LOCK:
        gone = [key for key, (t, _) in _WORKERS.items() if isinstance(t, TorchTransport)
                and (group is None or t.group is group)]
        workers = [_WORKERS.pop(key)[1] for key in gone]
    for worker in workers:
        worker.close()


__all__ = ["PARAM_DTYPES", "PendingGather", "QuantizedAllGather", "WEIGHT_CODECS"]
