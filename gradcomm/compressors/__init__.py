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
from typing import Any, Sequence

from ..errors import UnknownNameError, UnknownOptionError
from ._options import check_keywords, closest
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
    """A compressor by name with its options; an instance is returned as is.

    An unknown name is an :class:`~gradcomm.errors.UnknownNameError` (a ConfigError and a
    KeyError), an option the codec does not take an
    :class:`~gradcomm.errors.UnknownOptionError` (a ConfigError and a TypeError); both
    name what is known and the closest match.

    Example:
        >>> get("top-k")
        Traceback (most recent call last):
        ...
        gradcomm.errors.UnknownNameError: unknown compressor 'top-k' (did you mean 'topk'?); known: none, fp16, bf16, int8, qsgd, terngrad, topk, randomk, onebit, powersgd
    """
    check_options(name, options)
    if isinstance(name, Compressor):
        return name
    cls = _load(name)
    assert cls is not None
    return cls(**options)


def check_options(name: Any, options: Any, also: Sequence[str] = ()) -> None:
    """Raise what :func:`get` raises for an unknown ``name`` or an option its codec does not
    take, without building it; ``also``: names the caller takes beside the codec's (they
    are suggested as closest matches, not accepted)."""
    if isinstance(name, Compressor):
        if options:
            raise UnknownOptionError(f"options {sorted(options)} given with a Compressor "
                                     f"instance ({name!r}): set them when creating it")
        return
    cls = _load(name) if isinstance(name, str) and name in _CLASSES else None
    if cls is None:
        raise UnknownNameError(f"unknown compressor {name!r}{closest(name, _CLASSES)}; "
                               f"known: {', '.join(names())}")
    check_keywords(f"compressor {name!r}", options, cls.options, also)


__all__ = ["Compressor", "Payload", "check_options", "get", "names"]
