"""A quantized parameter all-gather for FSDP2 (the shape of ZeRO++'s qwZ): a prototype.

``compress_fsdp(model, "int8", weights="int8")`` installs :class:`QuantizedAllGather` on
every FSDPModule (``set_custom_all_gather``). FSDP2 calls it with the flat local shard of
the module's parameters (param dtype, float32 only here) as ``input_tensor`` and the flat
``world_size x`` output; every rank

1. quantizes its shard blockwise with the int8 codec (deterministic rounding, one min/max
   per block of ``bucket_size`` elements: about ``1 + 8/bucket_size`` bytes per element
   instead of 4),
2. all-gathers the payloads (:func:`gradcomm.collectives.allgather.allgatherv` over a
   gloo side group), and
3. decodes every rank's payload into its slot of the output, its own too, so that every
   rank computes with the same (dequantized) weights.

Only what forward and backward compute with is quantized: the sharded master parameters,
the gradients and the optimizer step stay exact (FSDP2 copies the gathered values out to
the unsharded parameters and never writes them back). The error is at most half a
quantization level of each block, every step afresh (no feedback: the master weights
carry no error).

Example:
    >>> import torch
    >>> from gradcomm.comm import run_ranks
    >>> def fn(t):
    ...     ag = QuantizedAllGather(side_group=t)
    ...     x = torch.arange(4, dtype=torch.float32) + 4 * t.rank
    ...     out = torch.empty(8)
    ...     ag(out, x, None)
    ...     return out.tolist()
    >>> run_ranks(2, fn)[1]
    [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather

from ... import arrays, compressors
from ...collectives.allgather import allgatherv
from ...compressors.payload import Payload
from ...errors import ConfigError

#: the weight codecs ``compress_fsdp(weights=...)`` knows
WEIGHT_CODECS = ("int8",)


class QuantizedAllGather(AllGather):
    """FSDP2's parameter all-gather with each shard quantized blockwise (``bits``,
    ``bucket_size``); ``side_group``: the group (or Transport) gradcomm's messages use
    (None: the group FSDP2 passes)."""

    def __init__(self, bits: int = 8, bucket_size: int = 256, side_group: Any = None
                 ) -> None:
        self.codec = compressors.get("int8", bits=bits, bucket_size=bucket_size)
        self.side_group = side_group
        self.calls = self.bytes_sent = 0

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device
                 ) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: Any, async_op: bool = False) -> None:
        from ...comm import get_transport

        if input_tensor.dtype != torch.float32 or input_tensor.device.type != "cpu":
            raise ConfigError(f"weights='int8' is a CPU float32 prototype; got "
                              f"{input_tensor.dtype} on {input_tensor.device} (leave "
                              "weights=None for FSDP2's own all-gather)")
        t = get_transport(group if self.side_group is None else self.side_group)
        self.calls += 1
        n = input_tensor.numel()
        x = np.array(arrays.host_view(input_tensor.reshape(-1)), copy=True)
        # the input is a view of this rank's slot of the output: encode before decoding
        mine = self.codec.compress(x, seed=(0,)).to_bytes()
        before = t.stats.bytes_sent
        blocks = allgatherv(t, mine, max_nbytes=mine.size)
        self.bytes_sent += t.stats.bytes_sent - before
        out = arrays.host_view(output_tensor.reshape(-1))
        if out.size != n * t.size:
            raise ConfigError(f"all-gather output of {out.size} elements for {t.size} "
                              f"shards of {n}")
        for r, b in enumerate(blocks):
            self.codec.decompress(Payload.from_bytes(b), out=out[r * n:(r + 1) * n])

    def __repr__(self) -> str:
        return f"QuantizedAllGather({self.codec!r})"


__all__ = ["QuantizedAllGather", "WEIGHT_CODECS"]
