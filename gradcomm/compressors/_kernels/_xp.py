"""Array-generic kernels: the numpy reference's bytes on numpy, torch and cupy arrays.

One implementation of every codec kernel, written against the array-API namespace of its
inputs (:func:`gradcomm.arrays.namespace`), so the codecs run where the data is: numpy,
torch CPU/CUDA or cupy. Every function produces exactly the bytes of :mod:`._numpy` (its
module docstring defines them): the same float32/float64 operations in the same order,
one operation per array call (nothing can be contracted into an FMA), the 64-lane bucket
sums as explicit vector adds in the reference order (never ``sum``, whose order is
unspecified on a GPU), and integer work in int32/int64/uint8 only (torch has no
arithmetic on uint16/32/64). The random stream is :mod:`._xp_stream`'s and the top-k /
random-k kernels :mod:`._xp_select`'s (both re-exported: this module is the whole path).

Signatures are those of :class:`~._protocol.Kernels` (``like``: an array whose kind and
device the result gets). Arrays of one call share kind and device; ``key`` is always a
host numpy uint32[4]; outputs are written in place; counts come back as Python ints.

Example:
    >>> import numpy as np
    >>> codes = np.array([1, 2, 3], np.uint8)
    >>> unpack(pack(codes, 2), 3, 2).tolist(), pack(codes, 2).tolist()
    ([1, 2, 3], [57])
    >>> dither(np.array([1, 2, 3, 4], np.uint32), 0, 3, codes).dtype.name
    'float32'
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ... import arrays
# the top-k / random-k kernels and the random stream live next door; this module is the
# whole xp kernel path (it re-exports them)
from ._xp_select import abs_keys, all_finite, randomk_indices, scatter, topk_select  # noqa: F401
from ._xp_stream import _cat, _dev, _kernel, dither, philox_words

NAME = "xp"
FUSED = False
LANES = 64
FLT_MAX = float(np.finfo(np.float32).max)
KEY_PINF = 0x7F800000                    # key(+inf); larger keys are NaNs
KEY_NINF = -0x7F800001                   # key(-inf); smaller keys are NaNs
#: elements per pass (whole buckets), bounding the temporaries: on a GPU few, large calls
#: (each array call is a kernel launch); on a CPU ~1M (measured no slower than larger runs)
_CHUNK_GPU, _CHUNK_CPU = 1 << 24, 1 << 20




# --- helpers ------------------------------------------------------------------------------

def _assign(out: Any, v: Any) -> None:
    """``out[...] = v`` in place (numpy, torch, cupy alike): ``v`` an array of ``out``'s
    kind and device, broadcast and cast to ``out``'s dtype, or a Python scalar."""
    out[...] = v


def _put(v: Any, out: Any, add: bool, nan: Any = None, nan_v: Any = None,
         base: Any = None) -> None:
    """``out = v`` or, with ``add``, ``out = v + base`` (``base`` defaults to ``out``);
    then, where ``nan``, ``nan_v``:
    the NaN bits x86 arithmetic gives the reference (CUDA gives its canonical NaN). Where
    ``v`` and ``out`` are both NaN the reference itself is not consistent (numpy's vector
    loop keeps the first operand's bits, its scalar tail the second's)."""
    if add:
        v = v + (out if base is None else base)
    if nan is not None:
        v = arrays.namespace(v).where(nan, nan_v, v)
    _assign(out, v)


def _quieted(v: Any) -> Any:
    """float32 ``v`` with the quiet bit set in its NaNs (what x86 arithmetic returns for a
    NaN operand)."""
    xp = arrays.namespace(v)
    b = arrays.bitcast(v, "int32")
    return arrays.bitcast(xp.where(xp.isnan(v), b | 0x400000, b), "float32")


def _const(xp: Any, value: float, dtype: Any, dev: Any) -> Any:
    """A 0-d array on ``dev`` (a typed scalar for ``where``/``minimum``: no library's
    promotion rules; and a divisor on the data's device: see the int8 section). Made by
    ``full``, a fill kernel: ``asarray`` of a Python scalar is a host-to-device copy,
    which torch makes blocking (it synchronises the stream)."""
    return xp.full((), value, dtype=dtype, device=dev)


def _clip(xp: Any, v: Any, lo: float, hi: float) -> Any:
    """``clip(v, lo, hi)`` of a float32 array (NaN stays NaN) as ``minimum(maximum())``
    with 0-d bounds: ``array_api_compat``'s cupy ``clip`` works through boolean-mask
    writes (each a synchronisation) and numpy's through promotion rules."""
    dev = _dev(v)
    return xp.minimum(xp.maximum(v, _const(xp, lo, v.dtype, dev)), _const(xp, hi, v.dtype, dev))


def _store_u16(out: Any, r: Any) -> None:
    """Write int32 values 0..65535 into the uint16 array ``out`` (through int16 bits)."""
    xp = arrays.namespace(r)
    _assign(arrays.bitcast(out, "int16"), xp.astype((r ^ 0x8000) - 0x8000, xp.int16))


def _u16(h: Any) -> Any:
    """uint16 bits as int32 values 0..65535."""
    xp = arrays.namespace(h)
    return xp.astype(arrays.bitcast(h, "int16"), xp.int32) & 0xFFFF


def _rows(xp: Any, a: Any, n: int, bs: int) -> list[tuple[int, int, Any]]:
    """``a[:n]`` cut into 2-D views of whole buckets: ``(first bucket, first element,
    (n // bs, bs) view)`` and, for a partial last bucket, ``(.., .., (1, n % bs) view)``."""
    full, tail = divmod(n, bs)
    parts = []
    if full:
        parts.append((0, 0, xp.reshape(a[:full * bs], (full, bs))))
    if tail:
        parts.append((full, full * bs, xp.reshape(a[full * bs:n], (1, tail))))
    return parts


def _key(xi: Any) -> Any:
    """Order-preserving int32 key of float32 bits (an involution)."""
    return xi ^ ((xi >> 31) & 0x7FFFFFFF)


def _lane_sums(xp: Any, v: Any, n: int, bs: int) -> Any:
    """Per-bucket float64 sums of ``v`` in the reference's 64-lane order."""
    dev = _dev(v)
    sums = []
    for _, _, p in _rows(xp, v, n, bs):
        r, m = p.shape
        g = -(-m // LANES)
        if g * LANES != m:                 # +0.0 pads: a lane sum from +0.0 is never -0.0
            p = xp.concat([p, xp.zeros((r, g * LANES - m), dtype=xp.float64, device=dev)],
                          axis=1)
        lanes = xp.reshape(p, (r, g, LANES))
        acc = xp.zeros((r, LANES), dtype=xp.float64, device=dev)
        for t in range(g):
            acc = acc + lanes[:, t, :]
        h = LANES // 2
        while h:
            acc = acc[:, :h] + acc[:, h:2 * h]
            h //= 2
        sums.append(acc[:, 0])
    return _cat(xp, sums)


def _chunks(a: Any, n: int, bs: int):
    """(start, count) of runs of whole buckets of about _CHUNK_GPU / _CHUNK_CPU elements,
    for arrays on ``a``'s device."""
    elems = _CHUNK_CPU if str(_dev(a)) == "cpu" else _CHUNK_GPU
    c = max(bs, (elems // bs) * bs)
    for s in range(0, n, c):
        yield s, min(c, n - s)


# --- bit packing ----------------------------------------------------------------------

@_kernel
def pack(codes: Any, bits: int, out: Any = None) -> Any:
    """``bits``-bit codes (uint8, each < 2**bits) into a little-endian bit stream."""
    xp, dev = arrays.namespace(codes), _dev(codes)
    n = arrays.size(codes)
    nbytes = (n * bits + 7) // 8
    if bits == 8:
        res = codes
    else:                          # 8 codes = ``bits`` bytes: one int (< 2^56) per group
        g = (n + 7) // 8
        wide = xp.int32 if bits <= 3 else xp.int64
        c = xp.astype(codes, wide)
        if g * 8 != n:
            c = xp.concat([c, xp.zeros(g * 8 - n, dtype=wide, device=dev)])
        c = xp.reshape(c, (g, 8))
        w = c[:, 0]
        for j in range(1, 8):
            w = w | (c[:, j] << (bits * j))
        res = [(w >> (8 * i)) & 0xFF for i in range(bits)]
        res = xp.astype(xp.reshape(xp.stack(res, axis=1), (-1,))[:nbytes], xp.uint8)
    if out is None:
        return xp.asarray(res, copy=True) if res is codes else res
    _assign(out, res)
    return out


@_kernel
def unpack(packed: Any, n: int, bits: int) -> Any:
    """Inverse of :func:`pack`: ``n`` codes of ``bits`` bits as uint8."""
    xp, dev = arrays.namespace(packed), _dev(packed)
    if bits == 8:
        return xp.asarray(packed[:n], copy=True)
    if n == 0:
        return xp.zeros(0, dtype=xp.uint8, device=dev)
    g = (n + 7) // 8
    wide = xp.int32 if bits <= 3 else xp.int64
    p = xp.astype(packed[:min(arrays.size(packed), g * bits)], wide)
    if arrays.size(p) != g * bits:
        p = xp.concat([p, xp.zeros(g * bits - arrays.size(p), dtype=wide, device=dev)])
    p = xp.reshape(p, (g, bits))
    w = p[:, 0]
    for i in range(1, bits):
        w = w | (p[:, i] << (8 * i))
    mask = (1 << bits) - 1
    codes = xp.stack([(w >> (bits * j)) & mask for j in range(8)], axis=1)
    return xp.astype(xp.reshape(codes, (-1,))[:n], xp.uint8)


# --- float casts ------------------------------------------------------------------------

def _to_odd_f32(x: Any) -> Any:
    """float64 -> float32 rounded to odd (inexact results get an odd last bit): a float16
    rounding of it equals the direct float64 -> float16 rounding (no double rounding)."""
    xp = arrays.namespace(x)
    f = xp.astype(x, xp.float32)
    back = xp.astype(f, xp.float64)
    bits = arrays.bitcast(f, "int32")
    fix = (back != x) & xp.isfinite(back) & ((bits & 1) == 0)
    # the other neighbour of x: one step away from zero when |x| > |f|, else towards it
    step = xp.where(xp.abs(x) > xp.abs(back), _const(xp, 1, xp.int32, _dev(x)),
                    _const(xp, -1, xp.int32, _dev(x)))
    return arrays.bitcast(xp.where(fix, bits + step, bits), "float32")


@_kernel
def f32_to_f16(x: Any, out: Any) -> None:
    """Round float32/64 to float16 bits in ``out`` (uint16; IEEE, to nearest even; overflow
    gives +-inf; NaN becomes the canonical quiet NaN ``0x7E00`` with its sign)."""
    xp, dev = arrays.namespace(x), _dev(x)
    x16 = xp.astype(_to_odd_f32(x) if arrays.dtype_name(x) == "float64" else x, xp.float16)
    nan = xp.where(xp.signbit(x), _const(xp, -0x200, xp.int16, dev),    # 0xFE00
                   _const(xp, 0x7E00, xp.int16, dev))
    _assign(arrays.bitcast(out, "int16"), xp.where(xp.isnan(x), nan,
                                                   arrays.bitcast(x16, "int16")))


@_kernel
def f16_to_f32(h: Any, out: Any, add: bool = False, base: Any = None) -> None:
    """Widen float16 bits (uint16) to float32 (exact; NaN becomes the canonical quiet NaN
    with its sign); ``add``: ``out = widen(h) + base`` (``base`` defaults to ``out``)."""
    xp, dev = arrays.namespace(h), _dev(h)
    w = xp.astype(arrays.bitcast(h, "float16"), xp.float32)
    u = _u16(h)
    nan = ((u & 0x7C00) == 0x7C00) & ((u & 0x3FF) != 0)
    canon = xp.where(u >= 0x8000, _const(xp, -0x400000, xp.int32, dev),   # 0xFFC00000
                     _const(xp, 0x7FC00000, xp.int32, dev))
    _put(w, out, add, nan, arrays.bitcast(canon, "float32"), base)


@_kernel
def f32_to_bf16(x: Any, out: Any) -> None:
    """Round float32 to bfloat16 bits in ``out`` (uint16; to nearest even; NaN stays a
    quiet NaN)."""
    xp = arrays.namespace(x)
    b = arrays.bitcast(x, "int32")
    hi, lo = (b >> 16) & 0xFFFF, b & 0xFFFF
    r = (hi + ((lo + (0x7FFF + (hi & 1))) >> 16)) & 0xFFFF    # the reference's uint32 sum
    _store_u16(out, xp.where(x != x, hi | 0x40, r))


@_kernel
def bf16_to_f32(h: Any, out: Any, add: bool = False, base: Any = None) -> None:
    """Widen bfloat16 bits (uint16) to float32 (exact); ``add``: ``out = widen(h) + base``
    (``base`` defaults to ``out``)."""
    xp = arrays.namespace(h)
    wide = arrays.bitcast(xp.astype(arrays.bitcast(h, "int16"), xp.int32) * 65536,
                          "float32")                                  # = bits << 16
    if add:
        _put(wide, out, add, xp.isnan(wide), _quieted(wide), base)
    else:
        _assign(out, wide)


def finite16(h: Any, bf16: bool = False) -> bool:
    """Whether every half (``bf16``: bfloat16) of bits ``h`` (uint16) is finite."""
    xp = arrays.namespace(h)
    mask = 0x7F80 if bf16 else 0x7C00
    bits = xp.astype(arrays.bitcast(h, "int16"), xp.int32)
    return not bool(xp.any((bits & mask) == mask))


# --- int8: per-bucket min/max --------------------------------------------------------------
# Divisions take a 0-d array of the data's device, never a Python scalar: torch on CUDA
# turns ``t / 3.0`` into ``t * (1 / 3.0)``, and ``3.0 / t`` into ``reciprocal(t) * 3.0``
# everywhere; both round differently from an IEEE division.

def _minmax_encode(x: Any, start: int, bs: int, bits: int, stochastic: bool,
                   key: np.ndarray, lo_out: Any, unit_out: Any, packed: Any) -> None:
    n, L = arrays.size(x), (1 << bits) - 1
    if n == 0:
        return
    xp, dev = arrays.namespace(x), _dev(x)
    f32, f64 = xp.float32, xp.float64
    k = _rows(xp, _key(arrays.bitcast(x, "int32")), n, bs)
    lo_k = _cat(xp, [xp.min(p, axis=1) for _, _, p in k])
    hi_k = _cat(xp, [xp.max(p, axis=1) for _, _, p in k])
    bad = (hi_k >= KEY_PINF) | (lo_k <= KEY_NINF)
    lo = arrays.bitcast(_key(lo_k), "float32")              # the key is an involution
    hi = arrays.bitcast(_key(hi_k), "float32")
    rng = xp.astype(hi, f64) - xp.astype(lo, f64)
    ok = ~bad & (rng > 0)
    one, lev = _const(xp, 1.0, f64, dev), _const(xp, L, f64, dev)
    inv = xp.minimum(xp.divide(lev, xp.where(ok, rng, one)), _const(xp, FLT_MAX, f64, dev))
    zero, nan = _const(xp, 0.0, f32, dev), _const(xp, math.nan, f32, dev)
    inv = xp.where(ok, xp.astype(inv, f32), zero)
    _assign(lo_out, xp.where(bad, nan, lo))
    _assign(unit_out, xp.where(bad, nan, xp.astype(xp.divide(rng, lev), f32)))
    lo = xp.where(ok, lo, zero)
    u = _rows(xp, dither(key, start, n, x), n, bs) if stochastic else None
    codes = []
    for i, (b, _, p) in enumerate(_rows(xp, x, n, bs)):
        r = p.shape[0]
        y = (p - lo[b:b + r, None]) * inv[b:b + r, None]
        q = _clip(xp, xp.floor(y + (u[i][2] if stochastic else 0.5)), 0, L)
        q = xp.where(ok[b:b + r, None], q, zero)
        codes.append(xp.reshape(xp.astype(q, xp.uint8), (-1,)))
    pack(_cat(xp, codes), bits, packed)


def _minmax_decode(packed: Any, n: int, bs: int, bits: int, lo: Any, unit: Any, out: Any,
                   add: bool = False, base: Any = None) -> int:
    xp = arrays.namespace(packed)
    c = xp.astype(unpack(packed, n, bits), xp.float32)
    nan, lo_q = xp.isnan(lo), _quieted(lo)     # x86: lo + NaN keeps lo's NaN, quieted
    for b, e, p in _rows(xp, c, n, bs):
        r, m = p.shape
        v = lo[b:b + r, None] + p * unit[b:b + r, None]
        if add:
            v = v + xp.reshape((out if base is None else base)[e:e + r * m], (r, m))
        _assign(out[e:e + r * m], xp.reshape(xp.where(nan[b:b + r, None],
                                                      lo_q[b:b + r, None], v), (-1,)))
    return 0


# --- int8 with a fixed, shared scale (summable) ------------------------------------------

def _fixed_encode(x: Any, start: int, bits: int, scale: float, stochastic: bool,
                  key: np.ndarray, packed: Any) -> None:
    n, L = arrays.size(x), (1 << (bits - 1)) - 1
    xp, dev = arrays.namespace(x), _dev(x)
    mul = float(np.float32(min(L / scale, FLT_MAX)))       # float32 values: exact scalars
    t = x * mul
    u = dither(key, start, n, x) if stochastic else 0.5
    q = _clip(xp, xp.floor(t + u), -L, L) + L
    q = xp.where(xp.isfinite(x), q, _const(xp, 2 * L + 1, xp.float32, dev))   # the NaN code
    pack(xp.astype(q, xp.uint8), bits, packed)


def _fixed_decode(packed: Any, n: int, bits: int, scale: float, out: Any,
                  add: bool = False, base: Any = None) -> int:
    L = (1 << (bits - 1)) - 1
    xp = arrays.namespace(packed)
    c = unpack(packed, n, bits)
    step = float(np.float32(scale / L))
    v = (xp.astype(c, xp.float32) - float(L)) * step
    _put(v, out, add, c == 2 * L + 1, _const(xp, math.nan, xp.float32, _dev(packed)), base)
    return 0


# --- qsgd / terngrad: sign + level, per-bucket scale ------------------------------------------

def _signlevel_encode(x: Any, start: int, bs: int, s: int, bits: int, l2: bool,
                      key: np.ndarray, scale_out: Any, packed: Any) -> None:
    n = arrays.size(x)
    if n == 0:
        return
    xp, dev = arrays.namespace(x), _dev(x)
    f32, f64 = xp.float32, xp.float64
    if l2:
        x64 = xp.astype(x, f64)
        total = _lane_sums(xp, x64 * x64, n, bs)
        bad = ~xp.isfinite(total)
        scale = xp.astype(xp.sqrt(xp.where(bad, _const(xp, 0.0, f64, dev), total)), f32)
    else:
        a = _rows(xp, arrays.bitcast(x, "int32") & 0x7FFFFFFF, n, bs)
        m = _cat(xp, [xp.max(p, axis=1) for _, _, p in a])
        bad = m >= KEY_PINF
        scale = arrays.bitcast(xp.where(bad, _const(xp, 0, xp.int32, dev), m), "float32")
    ok = ~bad & (scale > 0)
    one = _const(xp, 1.0, f64, dev)
    mul = xp.divide(_const(xp, s, f64, dev), xp.where(ok, xp.astype(scale, f64), one))
    mul = xp.astype(xp.minimum(mul, _const(xp, FLT_MAX, f64, dev)), f32)
    zero = _const(xp, 0.0, f32, dev)
    mul = xp.where(ok, mul, zero)
    _assign(scale_out, xp.where(bad, _const(xp, math.nan, f32, dev), scale))
    u = _rows(xp, dither(key, start, n, x), n, bs)
    top = _const(xp, s, f32, dev)
    codes = []
    for i, (b, _, p) in enumerate(_rows(xp, x, n, bs)):
        r = p.shape[0]
        y = xp.abs(p) * mul[b:b + r, None]
        level = xp.minimum(xp.floor(y + u[i][2]), top)
        level = xp.astype(xp.where(ok[b:b + r, None], level, zero), xp.int32)
        sign = xp.astype((p < 0) & (level > 0), xp.int32) << (bits - 1)
        codes.append(xp.reshape(xp.astype(level | sign, xp.uint8), (-1,)))
    pack(_cat(xp, codes), bits, packed)


def _signlevel_decode(packed: Any, n: int, bs: int, s: int, bits: int, scale: Any,
                      out: Any, add: bool = False, base: Any = None) -> int:
    """Returns the number of codes whose level exceeds ``s`` (a corrupt payload)."""
    xp, dev = arrays.namespace(packed), _dev(packed)
    c = xp.astype(unpack(packed, n, bits), xp.int32)
    level = c & ((1 << (bits - 1)) - 1)
    unit = xp.astype(xp.divide(xp.astype(scale, xp.float64), _const(xp, s, xp.float64, dev)),
                     xp.float32)
    nan, unit_q = xp.isnan(unit), _quieted(unit)      # x86: level * NaN gives NaN quieted
    for b, e, p in _rows(xp, level, n, bs):
        r, m = p.shape
        neg = xp.reshape(c[e:e + r * m], (r, m)) >> (bits - 1) != 0
        v = xp.astype(p, xp.float32) * unit[b:b + r, None]
        v = xp.where(neg, -v, v)
        if add:
            v = v + xp.reshape((out if base is None else base)[e:e + r * m], (r, m))
        uq = unit_q[b:b + r, None]
        v = xp.where(nan[b:b + r, None], xp.where(neg, -uq, uq), v)
        _assign(out[e:e + r * m], xp.reshape(v, (-1,)))
    return int(xp.count_nonzero(level > s))


# --- onebit: sign bit, per-bucket means of the two groups ---------------------------------

def _onebit_encode(x: Any, start: int, bs: int, pos_out: Any, neg_out: Any,
                   packed: Any) -> None:
    n = arrays.size(x)
    if n == 0:
        return
    xp, dev = arrays.namespace(x), _dev(x)
    f32, f64 = xp.float32, xp.float64
    x64 = xp.astype(x, f64)
    zero64 = _const(xp, 0.0, f64, dev)
    up = x >= 0
    psum = _lane_sums(xp, xp.maximum(x64, zero64), n, bs)    # NaN propagates to both
    nsum = _lane_sums(xp, xp.minimum(x64, zero64), n, bs)
    ups = _rows(xp, up, n, bs)
    cnt = _cat(xp, [xp.sum(xp.astype(p, xp.int64), axis=1) for _, _, p in ups])
    size = _cat(xp, [xp.full(p.shape[0], p.shape[1], dtype=xp.int64, device=dev)
                     for _, _, p in ups])
    bad = ~(xp.isfinite(psum) & xp.isfinite(nsum))
    one = _const(xp, 1, xp.int64, dev)
    pos = xp.where(cnt > 0, xp.divide(psum, xp.astype(xp.maximum(cnt, one), f64)), zero64)
    rest = size - cnt
    neg = xp.where(rest > 0, xp.divide(nsum, xp.astype(xp.maximum(rest, one), f64)), zero64)
    nan = _const(xp, math.nan, f32, dev)
    _assign(pos_out, xp.where(bad, nan, xp.astype(pos, f32)))
    _assign(neg_out, xp.where(bad, nan, xp.astype(neg, f32)))
    bit = [xp.reshape(p & ~bad[b:b + p.shape[0], None], (-1,)) for b, _, p in ups]
    pack(xp.astype(_cat(xp, bit), xp.uint8), 1, packed)


def _onebit_decode(packed: Any, n: int, bs: int, pos: Any, neg: Any, out: Any,
                   add: bool = False, base: Any = None) -> int:
    xp = arrays.namespace(packed)
    bit = unpack(packed, n, 1) != 0
    if add:                                  # x86: v + out keeps v's NaN, quieted
        pos, neg = _quieted(pos), _quieted(neg)
    for b, e, p in _rows(xp, bit, n, bs):
        r, m = p.shape
        v = xp.reshape(xp.where(p, pos[b:b + r, None], neg[b:b + r, None]), (-1,))
        if add:
            _put(v, out[e:e + r * m], add, xp.isnan(v), v,
                 None if base is None else base[e:e + r * m])
        else:
            _assign(out[e:e + r * m], v)
    return 0


# --- chunk drivers (the public quantizer kernels) ----------------------------------------

@_kernel
def minmax_encode(x, bs, bits, stochastic, key, lo_out, unit_out, packed) -> None:
    for s, m in _chunks(x, arrays.size(x), bs):
        b, nb, p = s // bs, -(-m // bs), s * bits // 8
        _minmax_encode(x[s:s + m], s, bs, bits, stochastic, key, lo_out[b:b + nb],
                       unit_out[b:b + nb], packed[p:p + (m * bits + 7) // 8])


def _part(base: Any, s: int, m: int) -> Any:
    """``base[s:s + m]`` of a decode-add's ``base`` (None: the output itself)."""
    return None if base is None else base[s:s + m]


@_kernel
def minmax_decode(packed, n, bs, bits, lo, unit, out, add=False, base=None) -> int:
    for s, m in _chunks(packed, n, bs):
        b, nb, p = s // bs, -(-m // bs), s * bits // 8
        _minmax_decode(packed[p:p + (m * bits + 7) // 8], m, bs, bits, lo[b:b + nb],
                       unit[b:b + nb], out[s:s + m], add, _part(base, s, m))
    return 0


@_kernel
def fixed_encode(x, bits, scale, stochastic, key, packed) -> None:
    for s, m in _chunks(x, arrays.size(x), 8):
        p = s * bits // 8
        _fixed_encode(x[s:s + m], s, bits, scale, stochastic, key,
                      packed[p:p + (m * bits + 7) // 8])


@_kernel
def fixed_decode(packed, n, bits, scale, out, add=False, base=None) -> int:
    for s, m in _chunks(packed, n, 8):
        p = s * bits // 8
        _fixed_decode(packed[p:p + (m * bits + 7) // 8], m, bits, scale, out[s:s + m], add,
                      _part(base, s, m))
    return 0


@_kernel
def signlevel_encode(x, bs, levels, bits, l2, key, scale_out, packed) -> None:
    for s, m in _chunks(x, arrays.size(x), bs):
        b, nb, p = s // bs, -(-m // bs), s * bits // 8
        _signlevel_encode(x[s:s + m], s, bs, levels, bits, l2, key, scale_out[b:b + nb],
                          packed[p:p + (m * bits + 7) // 8])


@_kernel
def signlevel_decode(packed, n, bs, levels, bits, scale, out, add=False, base=None) -> int:
    bad = 0
    for s, m in _chunks(packed, n, bs):
        b, nb, p = s // bs, -(-m // bs), s * bits // 8
        bad += _signlevel_decode(packed[p:p + (m * bits + 7) // 8], m, bs, levels, bits,
                                 scale[b:b + nb], out[s:s + m], add, _part(base, s, m))
    return bad


@_kernel
def onebit_encode(x, bs, pos_out, neg_out, packed) -> None:
    for s, m in _chunks(x, arrays.size(x), bs):
        b, nb = s // bs, -(-m // bs)
        _onebit_encode(x[s:s + m], s, bs, pos_out[b:b + nb], neg_out[b:b + nb],
                       packed[s // 8:s // 8 + (m + 7) // 8])


@_kernel
def onebit_decode(packed, n, bs, pos, neg, out, add=False, base=None) -> int:
    for s, m in _chunks(packed, n, bs):
        b, nb = s // bs, -(-m // bs)
        _onebit_decode(packed[s // 8:s // 8 + (m + 7) // 8], m, bs, pos[b:b + nb],
                       neg[b:b + nb], out[s:s + m], add, _part(base, s, m))
    return 0


# --- squared norms (the divergence guard's) ----------------------------------------------

def sq_norm(a) -> float:
    """``sum(a * a)`` in float64 over the reference's 64 lanes, folded in its order; each
    lane is summed by the library's ``sum`` (its order is unspecified, so the value may
    differ from the reference's in the last bits)."""
    xp = arrays.namespace(a)
    n = arrays.size(a)
    full = n // LANES
    acc = xp.zeros((LANES,), dtype=xp.float64, device=_dev(a))
    v = xp.astype(a, xp.float64)
    v = v * v
    if full:
        acc = acc + xp.sum(xp.reshape(v[:full * LANES], (full, LANES)), axis=0)
    if n > full * LANES:
        tail = v[full * LANES:]
        acc = _cat(xp, [acc[:n - full * LANES] + tail, acc[n - full * LANES:]])
    h = LANES // 2
    while h:
        acc = _cat(xp, [acc[:h] + acc[h:2 * h], acc[2 * h:]])
        h //= 2
    return float(acc[0])


def copy_sq_norm(src, dst) -> float:
    """``dst[...] = src`` and :func:`sq_norm` of it."""
    _assign(dst, src)
    return sq_norm(dst)


def velocity_in(u, x, m: float) -> None:
    """``u = u * m + x``, then ``x[...] = u``, in place (torch / cupy: the scalar ``m``
    is taken in the arrays' dtype, as numpy's is)."""
    u *= m
    u += x
    _assign(x, u)


def momentum_undo(o, prev, now, m: float) -> None:
    """``now[...] = o``, then ``o -= prev * m``, in place (``prev`` holds the product)."""
    _assign(now, o)
    prev *= m
    o -= prev


def adam_floor_denom(g, v, d, c2: float, bc2: float) -> None:
    """``v = maximum(v, g * g * c2)``, then ``d = v / bc2``, in place (one operation per
    call, as numpy's)."""
    xp = arrays.namespace(v)
    _assign(d, g * g)
    d *= c2
    _assign(v, xp.maximum(v, d))
    _assign(d, v / bc2)


def adam_precondition(m, d, x, eps: float) -> None:
    """``d += eps``, then ``x = m / d``, in place."""
    d += eps
    _assign(x, m / d)


def adam_release(z, d, m, step, bc1: float, replace: bool) -> None:
    """``m = z * d`` if ``replace``, then ``step = z / bc1``, in place."""
    if replace:
        _assign(m, z * d)
    _assign(step, z / bc1)
