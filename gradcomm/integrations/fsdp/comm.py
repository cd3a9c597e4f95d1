"""The torch ``ReduceScatter`` that FSDP2 calls, and the replicate-dimension hook of HSDP.

:class:`CompressedReduceScatter` implements ``allocate(size, dtype=, device=)`` and
``__call__(output_tensor, input_tensor, group, op, async_op=False)`` of
``torch.distributed.fsdp``'s ``ReduceScatter``. FSDP2 hands it the flat padded gradient
of one FSDPModule in the reduce dtype (``MixedPrecisionPolicy(reduce_dtype=)``) and
``op``: ``AVG`` (mean over the shard group), ``SUM`` (FSDP divides itself, e.g. for
float16), or ``PREMUL_SUM(1/f)`` after ``set_gradient_divide_factor(f)`` (the input is
multiplied by ``1/f``, then summed, as NCCL does). Without a codec it runs torch's own
``reduce_scatter_single`` (what FSDP2's default runs: bitwise parity). With one it runs
:func:`gradcomm.compressed.reduce_scatter.compressed_reduce_scatter` on the shard group,
the module's error-feedback residual kept under its key in the state's
:class:`~gradcomm.error_feedback.ErrorFeedback`, where the gradient lives (host for CPU
gradients; the device for CUDA ones).

:class:`ReplicateHook` is the ``set_all_reduce_hook`` of HSDP built from 1-D FSDP on the
shard sub-mesh: it averages the reduce-scattered shard over the replicate group through
the compressed allreduce (residual under ``"<key>#replicate"``).

Example:
    >>> rs = CompressedReduceScatter(None)
    >>> rs.allocate((3,), dtype=__import__("torch").float32, device="cpu").shape
    torch.Size([3])
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

from ... import arrays
from ...compressed import compressed_allreduce
from ...compressed.reduce_scatter import compressed_reduce_scatter
from ...compressors.base import Compressor
from ...error_feedback import ErrorFeedback
from ...errors import ConfigError


def _host_flat(x: torch.Tensor) -> Any:
    """A flat storage view (numpy) of CPU tensor ``x`` or a device-native flat copy."""
    if x.device.type == "cpu":
        return arrays.host_view(x.reshape(-1))
    b = arrays.backend(x)
    meta = b.meta(x)
    return b.to_flat(x, meta, arrays.placement(meta, codecs=True))


def _write(out: torch.Tensor, shard: Any) -> None:
    if out.device.type == "cpu" and arrays.is_host(shard):
        arrays.host_view(out.reshape(-1))[...] = shard
        return
    meta = arrays.Meta("torch", arrays.dtype_name(out), (out.numel(),), str(out.device))
    out.reshape(-1).copy_(arrays.from_flat(arrays.clone(shard), meta))


class CompressedReduceScatter(ReduceScatter):
    """FSDP2's reduce-scatter through ``codec`` (None: torch's own, bitwise).

    ``guard``: a :class:`~gradcomm.compressed.guard.Guard`: after each call the ranks agree
    whether the module's residuals went non-finite or past the bound, and reset them
    (used only with error feedback).
    ``ef``: the error-feedback store (None: a private one, enabled with ``codec``);
    ``key``: this module's name in it; ``group`` (an ``FSDPParamGroup``, optional): where
    the gradient divide factor of ``PREMUL_SUM`` is read; ``side_group``: a gloo group over
    the same ranks for gradcomm's messages (None: the group FSDP2 passes), so they never
    share a group with FSDP2's own asynchronous collectives (the next module's all-gather
    is prefetched during backward); :func:`compress_fsdp` always gives one.
    """

    def __init__(self, codec: Compressor | None, *, ef: ErrorFeedback | None = None,
                 key: str = "default", algorithm: str = "auto", seed: int = 0,
                 group: Any = None, side_group: Any = None, guard: Any = None) -> None:
        self.codec, self.key, self.algorithm, self.seed = codec, key, algorithm, seed
        self.ef = ef if ef is not None else ErrorFeedback(enabled=codec is not None)
        self.guard = guard if self.ef.enabled else None
        self.param_group, self.side_group = group, side_group
        self.shard_rank = 0
        self.calls = self.bytes_sent = 0
        self._checked: set[tuple[int, str, int]] = set()

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device
                 ) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def _op(self, op: Any, x: torch.Tensor) -> str:
        if op == dist.ReduceOp.AVG:
            return "mean"
        if op == dist.ReduceOp.SUM:
            return "sum"
        factor = getattr(self.param_group, "gradient_divide_factor", None)
        if factor is None:
            raise ConfigError(f"reduce op {op!r}: a gradient divide factor needs the "
                              "reduce-scatter installed by compress_fsdp (it reads the "
                              "factor from the module)")
        x.mul_(1.0 / float(factor))             # PREMUL_SUM(1/f): scale, then sum
        return "sum"

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, op: Any, async_op: bool = False) -> Any:
        self.calls += 1
        if self.codec is None:
            rs = getattr(dist, "reduce_scatter_single", None)
            if rs is None:
                return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op,
                                                  group=group, async_op=async_op)
            return rs(output=output_tensor, input=input_tensor, group=group, op=op,
                      async_op=async_op)
        from ...comm import get_transport

        t = get_transport(group if self.side_group is None else self.side_group)
        how = self._op(op, input_tensor)
        buf = _host_flat(input_tensor)
        dtype = arrays.dtype_name(input_tensor)
        sig = (id(group), dtype, int(input_tensor.numel()))
        first = sig not in self._checked
        before = t.stats.bytes_sent
        if self.guard is not None:
            self.guard.observe(self.key, buf)
        shard = compressed_reduce_scatter(
            t, buf, dtype, op=how, algorithm=self.algorithm, compressor=self.codec,
            check=first, seed=self.seed, residuals=self.ef, key=self.key)
        self._checked.add(sig)
        self.bytes_sent += t.stats.bytes_sent - before
        if self.guard is not None and self.guard.check(t, self.key,
                                                       self.ef.residuals_of(self.key), shard):
            self.ef.clear(self.key)             # every rank alike (the guard agreed)
        _write(output_tensor, shard)
        return None

    def __repr__(self) -> str:
        return (f"CompressedReduceScatter({self.codec!r}, key={self.key!r}, "
                f"error_feedback={self.ef.enabled})")


class ReplicateHook:
    """``set_all_reduce_hook``: the shard averaged over ``group`` (the replicate
    dimension) through ``codec``; residual ``"<key>#replicate"`` in ``ef``."""

    def __init__(self, codec: Compressor | None, group: Any, ef: ErrorFeedback, key: str,
                 algorithm: str = "allgather", seed: int = 0) -> None:
        self.codec, self.group, self.ef, self.key = codec, group, ef, key + "#replicate"
        self.algorithm, self.seed = algorithm, seed
        self._checked = False

    def __call__(self, reduce_output: torch.Tensor) -> None:
        from ...comm import get_transport

        t = get_transport(self.group)
        if self.codec is None:
            dist.all_reduce(reduce_output, op=dist.ReduceOp.SUM, group=self.group)
            reduce_output.div_(t.size)
            return
        buf = _host_flat(reduce_output)
        res = compressed_allreduce(t, buf, arrays.dtype_name(reduce_output), op="mean",
                                   algorithm=self.algorithm, compressor=self.codec,
                                   check=not self._checked, seed=self.seed,
                                   residuals=self.ef, key=self.key)
        self._checked = True
        _write(reduce_output, res)


__all__ = ["CompressedReduceScatter", "ReplicateHook"]
