"""Compressors: stateless codecs with self-describing wire payloads, one file each.

==========  ==========  ===========================================================
codec       reduction   wire (n float32 elements)
==========  ==========  ===========================================================
none        summable    4n
fp16        summable    2n (IEEE half; overflow to +-inf: divide before reducing)
bf16        summable    2n
int8        gathered    n*bits/8 + 8 bytes per bucket (per-bucket min/max)
int8        summable    n*bits/8 with ``scale=`` (shared symmetric scale)
qsgd        gathered    n*(1 + bitlen(s))/8 + 4 bytes per bucket
terngrad    gathered    n/4 + 4 bytes per bucket
topk        gathered    8k (int32 indices, values)
randomk     summable    4k (positions regenerated from the shared seed)
onebit      gathered    n/8 + 8 bytes per bucket
powersgd    summable    4r(rows + cols) per rows x cols matrix, in two rounds (rank r)
==========  ==========  ===========================================================

``powersgd`` is stateful: its own collective (:mod:`gradcomm.compressed.powersgd`) sums
the factors ``P`` then ``Q`` in two dense rounds (any dense algorithm, ``native``
included) and keeps each key's warm-start ``Q`` with the error-feedback state. A tensor
of 2+ dims is viewed as ``(shape[0], rest)`` (``allreduce``, ``Allreduce`` and the DDP
hook pass the shape); a flat one as a near-square matrix; parts too small to gain are
sent uncompressed.

Common contract (:class:`~.base.Compressor`): ``compress(x, *, seed=None, out=None,
residual=None, decoded=None) -> Payload`` for a flat float16/32/64 array (``out``: an
earlier payload whose buffers may be reused; ``residual``/``decoded``: error feedback and
the round trip, :func:`~.base.compose`); ``decompress(p, out=None, *, add=False)``
restores the input's dtype and count (``add``: into ``out``); ``decompress_sum(payloads,
out=None)``; ``max_nbytes(n, dtype)`` bounds ``compress(x).nbytes`` exactly;
``get_config()`` rebuilds the codec through :func:`get`. What a codec can do beyond that
(``sparse``, ``contractive``, ``uses_shape``, ``reuses_out``, ``fuses_feedback``, ...) is
declared on its class. Stochastic codecs draw from a counter-based stream keyed by
``seed`` (None, an int or a tuple of ints): the same seed gives the same bytes anywhere.
Decoding validates everything a peer sent and raises
:class:`~gradcomm.errors.PayloadError` otherwise.

**Non-finite inputs propagate, never raise**: if ``x`` holds NaN or +-inf, the decoded
output holds a non-finite value too, so a loss scaler that checks the reduced gradient
sees the overflow. fp16/bf16 map each element IEEE-style; the bucketed codecs (int8,
qsgd, terngrad, onebit) decode the whole bucket to NaN (shared-scale int8: the element);
topk ranks NaN and +-inf above every finite magnitude; randomk sends NaN for every value.
The one exception is a codec configured to send nothing (``k = 0``).

Example:
    >>> import gradcomm.compressors as C
    >>> "topk" in C.names()
    True
    >>> C.get("none").name
    'none'
"""

from __future__ import annotations

import importlib
from typing import Any

from .base import Compressor, Payload

#: codec name -> (module under gradcomm.compressors, class defining it)
_CLASSES = {
    "none": ("none", "NoneCompressor"), "fp16": ("fp16", "Fp16Compressor"),
    "bf16": ("bf16", "Bf16Compressor"), "int8": ("int8", "Int8Compressor"),
    "qsgd": ("qsgd", "QSGDCompressor"), "terngrad": ("terngrad", "TernGradCompressor"),
    "topk": ("topk", "TopKCompressor"), "randomk": ("randomk", "RandomKCompressor"),
    "onebit": ("onebit", "OneBitCompressor"), "powersgd": ("powersgd", "PowerSGD"),
}


def names() -> tuple[str, ...]:
    """Names of the codecs this installation provides."""
    return tuple(n for n in _CLASSES if _load(n) is not None)


def _load(name: str) -> type[Compressor] | None:
    """The class of codec ``name`` (KeyError if unknown), None if its module is absent."""
    module_name, cls_name = _CLASSES[name]
    try:
        module = importlib.import_module(f"{__name__}.{module_name}")
    except ModuleNotFoundError as exc:
        if exc.name == f"{__name__}.{module_name}":
            return None
        raise
    cls: type[Compressor] = vars(module)[cls_name]
    return cls


def get(name: str | Compressor, **options: Any) -> Compressor:
    """A compressor by name with its options; an instance is returned as is."""
    if isinstance(name, Compressor):
        if options:
            raise TypeError(f"options {sorted(options)} given with a Compressor instance")
        return name
    cls = _load(name) if isinstance(name, str) and name in _CLASSES else None
    if cls is None:
        raise KeyError(f"unknown compressor {name!r}; known: {', '.join(names())}")
    return cls(**options)


__all__ = ["Compressor", "Payload", "get", "names"]
