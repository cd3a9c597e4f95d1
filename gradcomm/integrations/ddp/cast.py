"""The DDP hook's cast route: a 16-bit cast payload summed by the library's own allreduce.

For ``fp16`` and ``bf16`` the payload is nothing but the 16-bit values, so on a transport
whose library allreduce is faster than gradcomm's own algorithms on the same bytes
(``Transport.native_preferred``: gloo) the hook sums the payload there, as PyTorch's
``fp16_compress_hook`` does: each rank encodes its unit once (its own rounding error kept
as the residual: error feedback), the library sums the 16-bit values (rounding after
each addition, in its own order, the same bytes on every rank), and the sum is widened
back into the unit. Per rank, the wire carries what gradcomm's ring would: the 16-bit
values, 2(p-1)/p of them.

Example (in-process ranks; their native sum adds in rank order):
    >>> import numpy as np
    >>> from gradcomm import compressors
    >>> from gradcomm.comm import run_ranks
    >>> def fn(t):
    ...     x = np.array([0.1, 1000.3, -2.0], np.float32) * (t.rank + 1)
    ...     return allreduce(t, x, compressors.get("fp16"), None, "u").tolist()
    >>> run_ranks(2, fn)[0]
    [0.2998046875, 3002.0, -6.0]
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ...compressed.state import session
from ...compressors.base import Compressor
from ...compressors.payload import Payload
from ...comm.base import Transport
from ...error_feedback import ResidualStore, contractive

#: codec name -> (the library dtype its payload sums as, the payload buffer's numpy dtype)
CAST_CODECS = {"fp16": ("float16", np.float16), "bf16": ("bfloat16", np.uint16)}


def wire_dtype(t: Transport, codec: Compressor | None, x: Any) -> str | None:
    """The library dtype to sum ``codec``'s payload of flat host float32 ``x`` as on
    ``t`` (None: not this route: another codec, a device or float64 unit, one rank, a
    transport that prefers gradcomm's algorithms or cannot sum the dtype)."""
    if codec is None or codec.name not in CAST_CODECS or t.size == 1:
        return None
    if not t.native_preferred or not isinstance(x, np.ndarray) or x.dtype != np.float32:
        return None
    wire = CAST_CODECS[codec.name][0]
    return wire if t.native_supports(wire, "sum") else None


def allreduce(t: Transport, x: np.ndarray, codec: Compressor, ef: ResidualStore | None,
              key: str) -> np.ndarray:
    """``x = Σ_ranks decode(encode(x))`` (flat host float32, in place; returned): the
    payload summed by ``t.native_allreduce`` as its 16-bit dtype. ``ef`` (enabled): the
    store whose ``key`` receives ``x - decode(encode(x))`` (``x`` already holds the
    residual added before: the DDP hook's :meth:`~.residuals.ParameterResiduals.open`)."""
    name, n = codec.name, x.size
    wire, held = CAST_CODECS[name]
    feedback = ef is not None and ef.enabled and codec.lossy and contractive(codec)
    with session(t) as scratch:
        payload = Payload(name, {}, {"v": scratch.floats(0, n, held)})
        decoded = scratch.floats(1, n, np.float32) if feedback else None
        payload = codec.compress(x, out=payload, decoded=decoded)
        if feedback:
            assert ef is not None and decoded is not None
            ef.update(key, x, decoded)
        t.native_allreduce(payload.buffers["v"], "sum", wire)
        codec.decompress(payload, out=x)
    return x


__all__ = ["CAST_CODECS", "allreduce", "wire_dtype"]
