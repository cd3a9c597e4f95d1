"""The Philox4x32-10 random stream on any array kind (numpy, torch, cupy; CPU or CUDA).

The words and dither of :mod:`._numpy`'s stream, byte for byte, computed where the data
is: in int64 (torch has no uint32/uint64 arithmetic; the 32x32-bit products wrap in int64
exactly as in uint64, and the high word is masked after the arithmetic shift). Used by
the quantizers of :mod:`._xp` and the random-k draws of :mod:`._xp_select`; also the
helpers every xp kernel shares (:func:`_kernel`, :func:`_dev`, :func:`_cat`).

Example:
    >>> import numpy as np
    >>> from gradcomm.compressors._kernels import _numpy
    >>> key = np.array([1, 2, 3, 4], np.uint32)
    >>> philox_words(key, 5, 6).tolist() == _numpy.philox_words(key, 5, 6).tolist()
    True
"""

from __future__ import annotations

from typing import Any

import array_api_compat
import numpy as np

from ... import arrays
from ._numpy import _quiet

_M32 = 0xFFFFFFFF
_PM0, _PM1 = 0xD2511F53, 0xCD9E8D57
_PW0, _PW1 = 0x9E3779B9, 0xBB67AE85
#: Philox blocks per batch (4 words each)
_BLOCKS = 1 << 22
#: where a result goes when the caller gives no ``like``: host numpy
_HOST = np.zeros(0, np.uint8)


# --- helpers shared by the xp kernels -----------------------------------------------------

def _kernel(fn: Any) -> Any:
    """A public kernel: numpy's floating-point warnings off (NaN and inf are handled), and
    on cupy, run on the device of the data (cupy creates arrays and launches kernels on
    the *current* device, and ``array_api_compat``'s cupy creation functions ignore
    ``device=``)."""
    return _quiet(arrays.device_scoped(fn))


def _dev(a: Any) -> Any:
    """``a``'s device, for the namespace's creation functions."""
    return array_api_compat.device(a)


def _cat(xp: Any, parts: list) -> Any:
    return parts[0] if len(parts) == 1 else xp.concat(parts)


# --- random stream --------------------------------------------------------------------

def _philox(c0: Any, c1: Any, c2: Any, c3: Any, k0: int, k1: int) -> tuple:
    """Philox4x32-10 rounds on int64 arrays (or Python ints) of 32-bit values."""
    for _ in range(10):
        p0, p1 = c0 * _PM0, c2 * _PM1          # int64 wraps mod 2^64 like uint64
        c0, c1, c2, c3 = (((p1 >> 32) & _M32) ^ c1 ^ k0, p1 & _M32,
                          ((p0 >> 32) & _M32) ^ c3 ^ k1, p0 & _M32)
        k0, k1 = (k0 + _PW0) & _M32, (k1 + _PW1) & _M32
    return c0, c1, c2, c3


@_kernel
def philox_words(key: np.ndarray, start: int, count: int, like: Any = None) -> Any:
    """Words ``start .. start+count-1`` of the Philox4x32-10 stream keyed by ``key``, as
    int64 values 0..2^32-1 in an array of ``like``'s kind and device (host numpy if None).

    Example:
        >>> import numpy as np
        >>> from gradcomm.compressors._kernels import _numpy
        >>> key = np.array([1, 2, 3, 4], np.uint32)
        >>> philox_words(key, 5, 6, np.zeros(1)).tolist() == _numpy.philox_words(key, 5, 6).tolist()
        True
    """
    like = _HOST if like is None else like
    xp, dev = arrays.namespace(like), _dev(like)
    if count <= 0:
        return xp.zeros(0, dtype=xp.int64, device=dev)
    k0, k1, c2, c3 = (int(v) for v in key)
    first, end = start // 4, (start + count + 3) // 4
    parts = []
    for b0 in range(first, end, _BLOCKS):
        b1 = min(end, b0 + _BLOCKS)
        blocks = xp.arange(b0, b1, dtype=xp.int64, device=dev)
        lo, hi = (blocks, 0) if b1 <= 1 << 32 else (blocks & _M32, blocks >> 32)
        out = _philox(lo, hi, c2, c3, k0, k1)
        parts.append(xp.reshape(xp.stack(out, axis=1), (-1,)))
    off = start - 4 * first
    return _cat(xp, parts)[off:off + count]


@_kernel
def dither(key: np.ndarray, start: int, count: int, like: Any = None) -> Any:
    """float32 dither ``(d + 0.5) / 2^16`` of elements ``start .. start+count-1``, as an
    array of ``like``'s kind and device (host numpy if None)."""
    like = _HOST if like is None else like
    xp = arrays.namespace(like)
    if count == 0:
        return xp.zeros(0, dtype=xp.float32, device=_dev(like))
    w0 = start // 2
    words = philox_words(key, w0, (start + count + 1) // 2 - w0, like)
    halves = xp.reshape(xp.stack([words & 0xFFFF, words >> 16], axis=1), (-1,))
    d = halves[start - 2 * w0:start - 2 * w0 + count]
    return xp.astype(d, xp.float32) * (2.0 ** -16) + (2.0 ** -17)   # both exact
