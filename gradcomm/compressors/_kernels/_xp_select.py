"""Top-k / random-k kernels written once for numpy, torch and cupy arrays (CPU or CUDA).

The array-generic twins of :mod:`._numpy`'s ``abs_keys``, ``topk_select``, ``scatter``,
``randomk_indices`` and ``all_finite``: the same indices, values and return codes, byte
for byte, on any array kind and device (re-exported by :mod:`._xp`; the random-k draws
come from :mod:`._xp_stream`). Written against the array-API namespace of the input
(:func:`gradcomm.arrays.namespace`); what it lacks comes from :mod:`gradcomm.arrays`.
Every selection is deterministic (no atomics, no unstable
sort), so a GPU gives the bytes the CPU gives:

- **top-k**: integer keys of ``|x|`` (the float bits without the sign: NaN above +inf),
  the threshold ``t`` = the k-th largest key by a selection (``kth_smallest``), then the
  positions with key >= t in index order, dropping the last ties beyond k.
- **scatter**: the index check, then plain indexed writes; NaN sums take the host's
  NaN bits (GPUs return a canonical NaN).
- **random-k**: the draws of the reference (Philox stream, ``floor(u * n / 2^64)`` computed
  exactly in int64 pieces: torch has no uint64 arithmetic), the first ``m`` distinct draws
  found through a stable argsort (first occurrences, ordered by position).

Example:
    >>> import numpy as np
    >>> idx, vals = topk_select(np.array([1, -5, 3, -3, 0], np.float32), 2)
    >>> idx.tolist(), vals.tolist()
    ([1, 2], [-5.0, 3.0])
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ... import arrays
from ...errors import ConfigError
from ._kth_smallest import kth_smallest
from ._xp_stream import philox_words

_M16 = 0xFFFF
_SIGNLESS = {2: ("int16", 0x7FFF), 4: ("int32", 0x7FFFFFFF), 8: ("int64", (1 << 63) - 1)}


def _default_nans() -> dict[str, tuple[int, int]]:
    """Per bit layout: (quiet bit, bits of the NaN this host's numpy gives for inf - inf),
    as signed integers of the float's item size."""
    out = {}
    for f, (name, _) in (("float16", _SIGNLESS[2]), ("float32", _SIGNLESS[4]),
                         ("float64", _SIGNLESS[8])):
        inf = np.array([np.inf], f)
        with np.errstate(all="ignore"):
            d = int((inf + -inf).view(name)[0])
        out[name] = (1 << (np.finfo(f).nmant - 1), d)
    return out


_NAN_BITS = _default_nans()


def _dev(x: Any) -> Any:
    import array_api_compat

    return array_api_compat.device(x)


@arrays.device_scoped
def abs_keys(x: Any) -> Any:
    """Integer keys ordered like ``|x|``, NaN above +inf (float16/32/64): the float bits
    with the sign cleared, as the signed integer of x's item size (non-negative, so the
    same bytes as the reference's unsigned keys).

    Example:
        >>> import numpy as np
        >>> abs_keys(np.array([-1.0, np.inf, np.nan], np.float32)).tolist()
        [1065353216, 2139095040, 2143289344]
    """
    name, mask = _SIGNLESS[_itemsize(x)]
    return arrays.bitcast(x, name) & mask


def _itemsize(x: Any) -> int:
    return {"float16": 2, "float32": 4, "float64": 8}[arrays.dtype_name(x)]


@arrays.device_scoped
def topk_select(x: Any, k: int) -> tuple[Any, Any]:
    """The ``k`` largest ``|x|`` (NaN largest; ties to the lower index), index order.

    Returns (indices as int64, values in x's dtype), arrays of x's kind and device.

    Example:
        >>> import numpy as np
        >>> idx, vals = topk_select(np.array([2, -2, 2, 1], np.float16), 2)
        >>> idx.tolist(), vals.tolist()
        ([0, 1], [2.0, -2.0])
    """
    xp = arrays.namespace(x)
    n = arrays.size(x)
    k = min(k, n)
    if k == n:
        return xp.arange(n, dtype=xp.int64, device=_dev(x)), xp.asarray(x, copy=True)
    if k == 0:
        return xp.zeros(0, dtype=xp.int64, device=_dev(x)), xp.asarray(x[:0], copy=True)
    keys = abs_keys(x)
    t = kth_smallest(keys, n - k)            # the k-th largest key
    cand = xp.nonzero(keys >= t)[0]                 # ascending; >= k of them
    extra = arrays.size(cand) - k
    if extra:                                       # ties at t: keep the first ones
        eq = xp.take(keys, cand) == t
        seen = xp.cumulative_sum(xp.astype(eq, xp.int64))
        keep = ~eq | (seen <= seen[-1] - extra)
        cand = xp.take(cand, xp.nonzero(keep)[0])
    idx = xp.astype(cand, xp.int64, copy=False)
    return idx, xp.take(x, idx)


@arrays.device_scoped
def scatter(out: Any, idx: Any, vals: Any, add: bool) -> int:
    """``out[idx] = vals`` (or ``+=``) after checking 0 <= idx < n, strictly increasing.

    Returns 0, or 1 (nothing written) when the indices are invalid. On a device the check
    costs one synchronisation (a reduction read back as a Python bool), the only one.
    With ``add``, a NaN sum gets the bits numpy gives on this host whatever the device (a
    NaN ``out`` element quietened, else a NaN value quietened, else the host's NaN of
    inf - inf; for NaN + NaN numpy's own pick varies between its SIMD and scalar loops,
    ours is ``out``'s): on host arrays where a sum is NaN, elsewhere always (no
    synchronisation to find out).

    Example:
        >>> import numpy as np
        >>> out = np.zeros(4, np.float32)
        >>> scatter(out, np.array([1, 3]), np.array([5, 6], np.float32), False), out.tolist()
        (0, [0.0, 5.0, 0.0, 6.0])
        >>> scatter(out, np.array([3, 1]), np.array([5, 6], np.float32), True), out.tolist()
        (1, [0.0, 5.0, 0.0, 6.0])
    """
    m = arrays.size(idx)
    if m == 0:
        return 0
    xp = arrays.namespace(out)
    ok = (idx[0] >= 0) & (idx[m - 1] < arrays.size(out))
    if m > 1:
        ok = ok & xp.all(idx[1:] > idx[:-1])
    if not bool(ok):
        return 1
    i = xp.astype(idx, xp.int64, copy=False)
    if not add:
        out[i] = vals
        return 0
    a = xp.take(out, i)
    with np.errstate(all="ignore"):                 # numpy: inf - inf and the like
        r = a + vals
    nan = xp.isnan(r)
    if not arrays.is_host(r) or bool(xp.any(nan)):
        r = _host_nans(a, vals, r, nan)
    out[i] = r
    return 0


def _host_nans(a: Any, b: Any, r: Any, nan: Any) -> Any:
    """``r = a + b`` with the NaN results given the bits the reference's host (numpy on a
    CPU) gives them: a NaN ``a`` quietened, else a NaN ``b`` quietened, else the host's
    default NaN (inf - inf). GPUs return a canonical NaN and torch's CPU kernel may take
    the second operand's payload: without this, NaN bits would differ."""
    xp = arrays.namespace(r)
    name, _ = _SIGNLESS[_itemsize(r)]
    quiet, default = _NAN_BITS[name]
    ai, bi = arrays.bitcast(a, name), arrays.bitcast(b, name)
    fix = xp.where(xp.isnan(a), ai | quiet,
                   xp.where(xp.isnan(b), bi | quiet, xp.full_like(ai, default)))
    return arrays.bitcast(xp.where(nan, fix, arrays.bitcast(r, name)), arrays.dtype_name(r))


@arrays.device_scoped
def randomk_indices(key: np.ndarray, n: int, k: int, like: Any = None) -> Any:
    """The ``k`` of ``range(n)`` that random-k keeps, ascending (int64, of ``like``'s kind
    and device; host numpy if None): the reference's draws (see
    :func:`._numpy.randomk_indices`), the first ``m = min(k, n - k)`` distinct ones kept
    (``k <= n / 2``) or left out.

    Example:
        >>> import numpy as np
        >>> from gradcomm.compressors._kernels import _numpy
        >>> key = np.array([1, 2, 3, 4], np.uint32)
        >>> got = randomk_indices(key, 100, 7, np.zeros(1))
        >>> got.tolist() == _numpy.randomk_indices(key, 100, 7).tolist()
        True
    """
    like = np.zeros(0, np.uint8) if like is None else like
    xp = arrays.namespace(like)
    dev = _dev(like)
    k = min(k, n)
    if k == n:
        return xp.arange(n, dtype=xp.int64, device=dev)
    if n > 1 << 62:
        raise ConfigError(f"random-k supports up to 2^62 elements, got {n}")
    m = min(k, n - k)
    if m == 0:
        return xp.zeros(0, dtype=xp.int64, device=dev)
    draws = xp.zeros(0, dtype=xp.int64, device=dev)
    batch = max(64, 2 * m)
    while True:
        d = arrays.size(draws)
        words = philox_words(key, 2 * d, 2 * batch, like)
        draws = xp.concat([draws, _draw(words[0::2], words[1::2], n)])
        order = xp.argsort(draws, stable=True)       # equal draws keep their draw order
        s = xp.take(draws, order)
        first = xp.concat([xp.ones(1, dtype=xp.bool, device=dev), s[1:] != s[:-1]])
        pos = xp.take(order, xp.nonzero(first)[0])   # where each value is first drawn
        if arrays.size(pos) >= m:
            chosen = xp.take(draws, xp.sort(pos)[:m])
            break
        batch = arrays.size(draws)
    if m == k:
        return xp.sort(chosen)
    keep = xp.ones(n, dtype=xp.bool, device=dev)
    # a 0-d device False: torch writes a Python scalar through a blocking host copy
    keep[chosen] = xp.zeros((), dtype=xp.bool, device=dev)
    return xp.astype(xp.nonzero(keep)[0], xp.int64, copy=False)


def _draw(lo: Any, hi: Any, n: int) -> Any:
    """The reference's draw of each word pair (int64 arrays of 32-bit values), exactly:
    ``floor((hi * 2^32 + lo) * n / 2^64)`` for n < 2^32, from products of at most 48 bits
    (n split in 16-bit halves); ``(hi * 2^32 + lo) mod n`` above, by shifts that stay
    below 2^63.

    Example:
        >>> import numpy as np
        >>> w = np.array([0xFFFFFFFF, 0xFFFFFFFF, 0, 1 << 31], np.int64)
        >>> _draw(w[0::2], w[1::2], 1000).tolist(), _draw(w[0::2], w[1::2], 3 << 40).tolist()
        ([999, 500], [1099511627775, 2199023255552])
    """
    if n < 1 << 32:
        n1, n0 = n >> 16, n & _M16
        a = (lo * n1 + ((lo * n0) >> 16)) >> 16          # floor(lo * n / 2^32)
        return (hi * n1 + ((hi * n0 + a) >> 16)) >> 16
    step = 63 - (n - 1).bit_length()                    # r < n: r << step < 2^63
    r, left = hi, 32
    while left:
        s = min(step, left)
        r = (r << s) % n
        left -= s
    return (r + lo) % n


@arrays.device_scoped
def all_finite(x: Any) -> bool:
    """Whether no element of ``x`` is NaN or +-inf (one synchronisation on a device).

    Example:
        >>> import numpy as np
        >>> all_finite(np.array([1.0, np.inf])), all_finite(np.zeros(0))
        (False, True)
    """
    xp = arrays.namespace(x)
    return bool(xp.all(xp.isfinite(x)))
