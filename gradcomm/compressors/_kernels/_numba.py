"""numba kernels: the same definitions as :mod:`._numpy`, fused per bucket, at memory speed.

Every function mirrors its numpy twin operation for operation (no fastmath, so no
reassociation or FMA contraction), which is what makes the bytes identical. Loops run over
slices starting at 0 (numba then proves indices non-negative and LLVM vectorizes them);
min/max go through integer keys (float min/max reductions do not vectorize).
JIT-compiled on first use and cached on disk (``cache=True``).

Example (the bytes of the numpy twin):
    >>> import numpy as np
    >>> from gradcomm.compressors._kernels import _numpy
    >>> x = np.linspace(-2, 3, 20, dtype=np.float32)
    >>> a, b = [(np.empty(3, np.float32), np.empty(3, np.float32), np.empty(3, np.uint8))
    ...         for _ in range(2)]
    >>> onebit_encode(x, 8, *a); _numpy.onebit_encode(x, 8, *b)
    >>> all(np.array_equal(u, v) for u, v in zip(a, b))
    True
"""

from __future__ import annotations

import sys
from enum import IntEnum

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

if sys.byteorder != "little":                            # pragma: no cover
    raise ImportError("the numba kernels assume a little-endian machine")

NAME = "numba"
_F32_NAN = np.float32(np.nan)
_KEY_PINF = np.int32(0x7F800000)
_KEY_NINF = np.int32(-0x7F800001)
_FLT_MAX = float(np.finfo(np.float32).max)
LANES = 64
_JIT = dict(cache=True, nogil=True, error_model="numpy")
#: this module has fused encoders (the ``*_fused`` functions): ``y = x + e`` is encoded;
#: then ``e = y - decode`` and/or ``d = decode`` in the same pass over each bucket
FUSED = True
_NONE32 = np.zeros(1, np.float32)                      # stands for an absent e or d
_NOACC = np.zeros(0)                                   # no tally: lanes not accumulated
#: elements per block of the 16-bit casts when they tally the residual's norm
_CAST_BLOCK = 4096


def _onto(add, base, out):
    """Whether a decode adds onto another array than ``out``: then the kernels take
    ``base``, else None (``out`` itself, a compilation of its own)."""
    return add and base is not None and base is not out


class Fuse(IntEnum):
    """What one pass of an encoder does beside encoding: the kernels' ``mode`` (passed as
    an int; the plain encoders pass ``e = d = None`` with PLAIN, which numba compiles
    apart, the error-feedback code pruned)."""

    PLAIN = 0               #: encode x
    RESIDUAL = 1            #: encode y = x + e, then e = y - decoded
    DECODED = 2             #: d = decoded
    BOTH = 3                #: RESIDUAL and DECODED
    DECODED_INTO_X = 6      #: DECODED with d = x (16-bit casts: an aliased d defeats
    BOTH_INTO_X = 7         #: BOTH with d = x      vectorization, so x is written instead)


_PLAIN = Fuse.PLAIN.value                               # the plain encoders' mode


def _mode(x: np.ndarray, residual: np.ndarray | None, decoded: np.ndarray | None,
          into_x: bool = False) -> tuple[int, np.ndarray, np.ndarray]:
    """``(mode, e, d)`` for a fused call: absent arrays stand in as ``_NONE32``; with
    ``into_x`` (the 16-bit casts) a ``decoded`` that is ``x`` itself is written as x."""
    mode = Fuse.PLAIN
    if residual is not None:
        mode = Fuse.RESIDUAL
    if decoded is not None:
        mode = Fuse.BOTH if mode == Fuse.RESIDUAL else Fuse.DECODED
        if into_x and decoded.ctypes.data == x.ctypes.data:
            mode = Fuse.BOTH_INTO_X if mode == Fuse.BOTH else Fuse.DECODED_INTO_X
            decoded = None
    return (int(mode), _NONE32 if residual is None else residual,
            _NONE32 if decoded is None else decoded)


# --- random stream --------------------------------------------------------------------

@njit(inline="always", **_JIT)
def _philox(c0, c1, c2, c3, k0, k1):
    for _ in range(10):
        p0 = np.uint64(0xD2511F53) * np.uint64(c0)
        p1 = np.uint64(0xCD9E8D57) * np.uint64(c2)
        c0, c1, c2, c3 = (np.uint32(p1 >> np.uint64(32)) ^ np.uint32(c1) ^ np.uint32(k0),
                          np.uint32(p1 & np.uint64(0xFFFFFFFF)),
                          np.uint32(p0 >> np.uint64(32)) ^ np.uint32(c3) ^ np.uint32(k1),
                          np.uint32(p0 & np.uint64(0xFFFFFFFF)))
        k0 = np.uint32(np.uint32(k0) + np.uint32(0x9E3779B9))
        k1 = np.uint32(np.uint32(k1) + np.uint32(0xBB67AE85))
    return np.uint32(c0), np.uint32(c1), np.uint32(c2), np.uint32(c3)


@njit(inline="always", **_JIT)
def _block(key, b):
    """Block ``b`` (uint64) of the stream of ``key`` (four uint32 words, array or tuple)."""
    return _philox(np.uint32(b & np.uint64(0xFFFFFFFF)), np.uint32(b >> np.uint64(32)),
                   key[2], key[3], key[0], key[1])


@njit(inline="always", **_JIT)
def _put_block(key, b, out, j):
    """out[4j .. 4j+3] = block ``b`` of the stream."""
    w0, w1, w2, w3 = _block(key, b)
    out[4 * j] = w0
    out[4 * j + 1] = w1
    out[4 * j + 2] = w2
    out[4 * j + 3] = w3


@njit(**_JIT)
def _fill_words(key, block0, out):
    """out[4j .. 4j+3] = block ``block0 + j`` of the stream."""
    k = (key[0], key[1], key[2], key[3])            # not reloaded after each store to out
    for j in range(out.size // 4):
        _put_block(k, np.uint64(block0 + j), out, j)


def philox_words(key: np.ndarray, start: int, count: int, like: object = None) -> np.ndarray:
    """Words ``start .. start+count-1`` of the Philox4x32-10 stream keyed by ``key`` (host
    arrays: ``like`` is not used here)."""
    b0 = start // 4
    nblk = (start + count + 3) // 4 - b0
    buf = np.empty(nblk * 4, np.uint32)
    _fill_words(key.astype(np.uint32), b0, buf)
    return buf[start - 4 * b0:start - 4 * b0 + count].copy()


@njit(**_JIT)
def _fill_bucket_words(key, start, m, w):
    """w[0 : 4*ceil(m/8)] = stream words of elements start .. start+m-1 (start % 8 == 0);
    element i's dither is then ``_u(w.view(uint16)[i])``."""
    g0 = start // 8
    for t in range((m + 7) // 8):
        _put_block(key, np.uint64(g0 + t), w, t)


@njit(inline="always", **_JIT)
def _u(h):
    return np.float32(h) * np.float32(1.52587890625e-05) + np.float32(7.62939453125e-06)


# --- bit packing ----------------------------------------------------------------------

@njit(**_JIT)
def _pack_into(c, m, bits, out):
    """codes c[0:m] -> out[0:ceil(m*bits/8)] (out starts at a group boundary)."""
    if bits == 8:
        for i in range(m):
            out[i] = c[i]
        return
    full = m // 8
    if bits == 1:
        for t in range(full):
            out[t] = (c[8 * t] | (c[8 * t + 1] << 1) | (c[8 * t + 2] << 2) |
                      (c[8 * t + 3] << 3) | (c[8 * t + 4] << 4) | (c[8 * t + 5] << 5) |
                      (c[8 * t + 6] << 6) | (c[8 * t + 7] << 7))
    elif bits == 2:
        for t in range(2 * full):
            out[t] = (c[4 * t] | (c[4 * t + 1] << 2) | (c[4 * t + 2] << 4) |
                      (c[4 * t + 3] << 6))
    elif bits == 4:
        for t in range(4 * full):
            out[t] = c[2 * t] | (c[2 * t + 1] << 4)
    else:
        for t in range(full):
            w = np.uint64(0)
            for j in range(8):
                w |= np.uint64(c[8 * t + j]) << np.uint64(bits * j)
            for q in range(bits):
                out[t * bits + q] = np.uint8((w >> np.uint64(8 * q)) & np.uint64(0xFF))
    r = m - 8 * full
    if r:
        w = np.uint64(0)
        for j in range(r):
            w |= np.uint64(c[8 * full + j]) << np.uint64(bits * j)
        for q in range((r * bits + 7) // 8):
            out[full * bits + q] = np.uint8((w >> np.uint64(8 * q)) & np.uint64(0xFF))


@njit(**_JIT)
def _unpack_into(p, m, bits, c):
    """inverse of _pack_into: p[0:ceil(m*bits/8)] -> c[0:m]."""
    if bits == 8:
        for i in range(m):
            c[i] = p[i]
        return
    full = m // 8
    mask = np.uint8((1 << bits) - 1)
    if bits == 1:
        for t in range(full):
            byte = p[t]
            for j in range(8):
                c[8 * t + j] = (byte >> np.uint8(j)) & np.uint8(1)
    elif bits == 2:
        for t in range(2 * full):
            byte = p[t]
            for j in range(4):
                c[4 * t + j] = (byte >> np.uint8(2 * j)) & np.uint8(3)
    elif bits == 4:
        for t in range(4 * full):
            byte = p[t]
            c[2 * t] = byte & np.uint8(15)
            c[2 * t + 1] = byte >> np.uint8(4)
    else:
        for t in range(full):
            w = np.uint64(0)
            for q in range(bits):
                w |= np.uint64(p[t * bits + q]) << np.uint64(8 * q)
            for j in range(8):
                c[8 * t + j] = np.uint8(w >> np.uint64(bits * j)) & mask
    r = m - 8 * full
    if r:
        w = np.uint64(0)
        for q in range((r * bits + 7) // 8):
            w |= np.uint64(p[full * bits + q]) << np.uint64(8 * q)
        for j in range(r):
            c[8 * full + j] = np.uint8(w >> np.uint64(bits * j)) & mask


@njit(**_JIT)
def _pack(codes, bits, out):
    _pack_into(codes, codes.size, bits, out)


@njit(**_JIT)
def _unpack(packed, n, bits, out):
    _unpack_into(packed, n, bits, out)


def pack(codes: np.ndarray, bits: int, out: np.ndarray | None = None) -> np.ndarray:
    if out is None:
        out = np.empty((codes.size * bits + 7) // 8, np.uint8)
    _pack(codes, bits, out)
    return out


def unpack(packed: np.ndarray, n: int, bits: int) -> np.ndarray:
    out = np.empty(n, np.uint8)
    _unpack(packed, n, bits, out)
    return out


def dither(key: np.ndarray, start: int, count: int, like: object = None) -> np.ndarray:
    """float32 dither ``(d + 0.5) / 2^16`` of elements ``start .. start+count-1``, from
    this module's stream (the encoders draw it inline, bucket by bucket)."""
    if count == 0:
        return np.zeros(0, np.float32)
    w0 = start // 2
    words = philox_words(key, w0, (start + count + 1) // 2 - w0)
    d = words.view(np.uint16)[start - 2 * w0:start - 2 * w0 + count]
    return d.astype(np.float32) * np.float32(2.0 ** -16) + np.float32(2.0 ** -17)


# --- float casts ------------------------------------------------------------------------

def _unary(name, src, dst, op):
    """An intrinsic ``name(x)`` of type ``dst(src)``: the LLVM value ``op(builder, x)``."""
    def typer(typingctx, x):
        if x != src:
            return None
        return dst(src), lambda context, builder, signature, args: op(builder, args[0])
    typer.__name__ = typer.__qualname__ = name
    return intrinsic(typer)


_I16, _I32, _F16, _F32 = ir.IntType(16), ir.IntType(32), ir.HalfType(), ir.FloatType()
#: IEEE float32 -> float16 bits (LLVM fptrunc: F16C's vcvtps2ph on x86), and back
_f32_to_f16_bits = _unary("_f32_to_f16_bits", types.float32, types.uint16,
                          lambda b, x: b.bitcast(b.fptrunc(x, _F16), _I16))
_f16_bits_to_f32 = _unary("_f16_bits_to_f32", types.uint16, types.float32,
                          lambda b, x: b.fpext(b.bitcast(x, _F16), _F32))
#: the float32 whose bits are the uint32 ``x``, and back
_u32_as_f32 = _unary("_u32_as_f32", types.uint32, types.float32,
                     lambda b, x: b.bitcast(x, _F32))
_f32_as_u32 = _unary("_f32_as_u32", types.float32, types.uint32,
                     lambda b, x: b.bitcast(x, _I32))


@njit(inline="always", **_JIT)
def _f16_round(y):
    """(half bits, their float32 value) of float32 ``y``: NaN becomes the canonical NaN
    of its sign, which widens to the canonical float32 NaN."""
    h = _f32_to_f16_bits(y)
    if y != y:
        h = np.uint16(0xFE00) if np.signbit(y) else np.uint16(0x7E00)
    return h, _f16_bits_to_f32(h)


@njit(inline="always", **_JIT)
def _bf16_round(y):
    """(bfloat16 bits, their float32 value) of float32 ``y``: round to nearest even; a NaN
    keeps its sign and top payload bits, made quiet."""
    b = _f32_as_u32(y)
    if (b & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
        h = np.uint16((b >> np.uint32(16)) | np.uint32(0x40))
    else:
        h = np.uint16((b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1)))
                      >> np.uint32(16))
    return h, _bf16_widen(h)


@njit(inline="always", **_JIT)
def _round16_loop(x, v, e, d, mode, rnd):
    """v = the 16-bit codes of y (x, + e under RESIDUAL), e = y - decoded (RESIDUAL),
    decoded into d (DECODED) or into x (the INTO_X modes), ``rnd`` giving (bits, their
    float32 value) of a float32. One loop per mode (inlined into each cast's kernel, so
    ``rnd`` is fixed there and no branch is left in the loops)."""
    n = x.size
    if mode == Fuse.PLAIN:
        for i in range(n):
            v[i] = rnd(x[i])[0]
    elif mode == Fuse.RESIDUAL:
        for i in range(n):
            y = x[i] + e[i]
            h, f = rnd(y)
            v[i] = h
            e[i] = y - f
    elif mode == Fuse.DECODED:
        for i in range(n):
            h, f = rnd(x[i])
            v[i] = h
            d[i] = f
    elif mode == Fuse.DECODED_INTO_X:
        for i in range(n):
            h, f = rnd(x[i])
            v[i] = h
            x[i] = f
    elif mode == Fuse.BOTH_INTO_X:
        for i in range(n):
            y = x[i] + e[i]
            h, f = rnd(y)
            v[i] = h
            e[i] = y - f
            x[i] = f
    else:
        for i in range(n):
            y = x[i] + e[i]
            h, f = rnd(y)
            v[i] = h
            e[i] = y - f
            d[i] = f


@njit(inline="always", **_JIT)
def _round16(x, v, e, d, mode, rnd, acc, acc_x):
    """:func:`_round16_loop`, and with lanes ``acc`` / ``acc_x`` (not empty) block by
    block, each block's new e / its input x squared into them while it is in cache."""
    n = x.size
    if acc.size == 0 and acc_x.size == 0:
        _round16_loop(x, v, e, d, mode, rnd)
        return
    whole = d.size == n
    for s in range(0, n, _CAST_BLOCK):
        m = min(_CAST_BLOCK, n - s)
        if acc_x.size:
            _acc_sq(acc_x, x[s:s + m], s)           # before the INTO_X modes write x
        _round16_loop(x[s:s + m], v[s:s + m], e[s:s + m], d[s:s + m] if whole else d[:0],
                      mode, rnd)
        if acc.size:
            _acc_sq(acc, e[s:s + m], s)


@njit(**_JIT)
def _f16_encode(x, v, e, d, mode, acc, acc_x):
    _round16(x, v, e, d, mode, _f16_round, acc, acc_x)


@njit(**_JIT)
def _bf16_encode(x, v, e, d, mode, acc, acc_x):
    _round16(x, v, e, d, mode, _bf16_round, acc, acc_x)


def _f32_to_f16(x, out):
    _f16_encode(x, out, _NONE32, _NONE32, _PLAIN, _NOACC, _NOACC)


@njit(**_JIT)
def _f16_to_f32(h, out):
    ob = out.view(np.uint32)
    for i in range(h.size):
        v = h[i]
        f = _f16_bits_to_f32(v)
        out[i] = f
        if f != f:
            ob[i] = np.uint32(0xFFC00000) if v & np.uint16(0x8000) else np.uint32(0x7FC00000)


@njit(**_JIT)
def _f16_to_f32_add(h, base, out):
    # a NaN sum is some NaN (its payload is not canonicalised: the loop vectorizes)
    if base is None:        # out itself: a loop of its own (one that reads base aliasing
        for i in range(h.size):     # out runs scalar, where the half casts are library
            out[i] = _f16_bits_to_f32(h[i]) + out[i]        # calls: 12x slower)
    else:
        for i in range(h.size):
            out[i] = _f16_bits_to_f32(h[i]) + base[i]


def _probe_f16() -> bool:
    """True if LLVM lowers the half casts here (a CPU without F16C needs a libcall)."""
    try:
        x = np.array([1.5, -np.inf, 65520.0, 1e-7, np.nan], np.float32)
        h = np.empty(5, np.uint16)
        _f32_to_f16(x, h)
        y = np.empty(5, np.float32)
        _f16_to_f32(h, y)
        return h.tolist() == [0x3E00, 0xFC00, 0x7C00, 0x0002, 0x7E00] and y[0] == 1.5
    except Exception:                                    # pragma: no cover - exotic CPUs
        return False


_F16_OK: list[bool] = []


def f32_to_f16(x, out):
    if not _F16_OK:
        _F16_OK.append(_probe_f16())
    if _F16_OK[0]:
        _f32_to_f16(x, out)
    else:                                                # pragma: no cover
        from . import _numpy
        _numpy.f32_to_f16(x, out)


def f16_to_f32(h, out, add=False, base=None):
    """``out = widen(h)`` (``out = widen(h) + base`` with ``add``; ``base`` defaults to
    ``out``)."""
    if not _F16_OK:
        _F16_OK.append(_probe_f16())
    if not _F16_OK[0]:                                   # pragma: no cover
        from . import _numpy
        _numpy.f16_to_f32(h, out, add, base)
    elif add:
        _f16_to_f32_add(h, base if _onto(add, base, out) else None, out)
    else:
        _f16_to_f32(h, out)


def f32_to_bf16(x, out):
    _bf16_encode(x, out, _NONE32, _NONE32, _PLAIN, _NOACC, _NOACC)


@njit(**_JIT)
def _bf16_to_f32(h, out):
    ob = out.view(np.uint32)
    for i in range(h.size):
        ob[i] = np.uint32(h[i]) << np.uint32(16)


@njit(inline="always", **_JIT)
def _bf16_widen(h):
    return _u32_as_f32(np.uint32(np.uint32(h) << np.uint32(16)))


@njit(**_JIT)
def _bf16_to_f32_add(h, base, out):
    if base is None:                                    # out itself (as fp16's)
        for i in range(h.size):
            out[i] = _bf16_widen(h[i]) + out[i]
    else:
        for i in range(h.size):
            out[i] = _bf16_widen(h[i]) + base[i]


def bf16_to_f32(h, out, add=False, base=None):
    """``out = widen(h)`` (``out = widen(h) + base`` with ``add``; ``base`` defaults to
    ``out``)."""
    if add:
        _bf16_to_f32_add(h, base if _onto(add, base, out) else None, out)
    else:
        _bf16_to_f32(h, out)


# --- bucket statistics ------------------------------------------------------------------

@njit(inline="always", **_JIT)
def _fold(acc):
    h = LANES // 2
    while h:
        for j in range(h):
            acc[j] += acc[j + h]
        h //= 2
    return acc[0]


@njit(inline="always", **_JIT)
def _key_minmax(xs, m):
    """The least and greatest integer keys of float32 xs[0:m] (keys order as the floats)."""
    lo_k = np.int32(0x7FFFFFFF)
    hi_k = np.int32(-0x80000000)
    for i in range(m):
        v = np.int32(_f32_as_u32(xs[i]))
        k = v ^ ((v >> np.int32(31)) & np.int32(0x7FFFFFFF))
        lo_k = min(lo_k, k)
        hi_k = max(hi_k, k)
    return np.int32(lo_k), np.int32(hi_k)


@njit(inline="always", **_JIT)
def _unkey(k):
    """The float32 of key ``k``."""
    return _u32_as_f32(np.uint32(k ^ ((k >> np.int32(31)) & np.int32(0x7FFFFFFF))))


@njit(inline="always", **_JIT)
def _acc_sq(acc, v, s):
    """acc[(s + i) % 64] += float64(v[i])**2 for i in 0 .. v.size-1, in order (the lanes of
    :func:`._numpy.sq_norm` for an array whose element s is v[0])."""
    m = v.size
    h = min(m, (LANES - s % LANES) % LANES)
    for i in range(h):
        w = np.float64(v[i])
        acc[(s + i) % LANES] += w * w
    full = (m - h) // LANES
    for t in range(full):
        r = v[h + t * LANES:h + (t + 1) * LANES]
        for j in range(LANES):
            w = np.float64(r[j])
            acc[j] += w * w
    for i in range(h + full * LANES, m):
        w = np.float64(v[i])
        acc[(s + i) % LANES] += w * w


# --- error feedback around a bucket ----------------------------------------------------------
# Every bucketed encoder is one kernel ``(x, ..., e, d, mode)``. Its ``*_fused`` function
# calls it with a :class:`Fuse` mode (RESIDUAL: encode y = x + e, then e = y - decoded;
# DECODED: d = decoded; or BOTH), in the
# same pass over each bucket. The plain encoder passes e = d = None: numba compiles that
# apart, with the error-feedback code pruned (the fused path's per-bucket array views
# would cost ~10% at 256-element buckets).
_ONEBIT, _MINMAX, _FIXED, _SIGNLEVEL = 0, 1, 2, 3


@njit(**_JIT)
def _value(kind, ci, a, b, k):
    """The float32 that code ``ci`` (uint8) stands for in codec ``kind``, given the bucket's
    float32 ``a``, ``b`` and uint8 ``k``. Not inlined by numba (that would type every
    branch at each of its call sites); LLVM inlines it and folds the constant ``kind``."""
    if kind == _ONEBIT:                 # a where the bit is set, else b
        return a if ci else b
    if kind == _MINMAX:                 # lo + ci * unit
        return a + np.float32(ci) * b
    if kind == _FIXED:                  # (ci - L) * step; code k is NaN
        return _F32_NAN if ci == k else (np.float32(ci) - a) * b
    v = np.float32(ci & k) * a          # signlevel: level ci & k in units a, sign bit above k
    return -v if ci > k else v


@njit(inline="always", **_JIT)
def _decode_codes(kind, c, m, a, b, k, o, add):
    """o[0:m] = the values of codes c[0:m] (+ o with add)."""
    if add:
        for i in range(m):
            o[i] = _value(kind, c[i], a, b, k) + o[i]
    else:
        for i in range(m):
            o[i] = _value(kind, c[i], a, b, k)


@njit(inline="always", **_JIT)
def _decode_codes_onto(kind, c, m, a, b, k, o, bo):
    """o[0:m] = the values of codes c[0:m] + bo[0:m], ``bo`` another array than ``o``.
    Its callers branch on ``base is None`` at their top (``base`` is an argument, so numba
    compiles only one side): a loop that reads ``bo`` aliasing ``o`` runs scalar, and a
    runtime test of base in the shared helper slowed the in-place decoders 1.3-2.5x."""
    for i in range(m):
        o[i] = _value(kind, c[i], a, b, k) + bo[i]


@njit(inline="always", **_JIT)
def _ef_input(x, e, s, m, mode, ys):
    """Bucket ``s .. s+m`` of what is encoded: ``x``, or ``y = x + e`` (into ys) under
    RESIDUAL."""
    xs = x[s:s + m]
    if e is None or not mode & Fuse.RESIDUAL:
        return xs
    es = e[s:s + m]
    for i in range(m):
        ys[i] = xs[i] + es[i]
    return ys[:m]


@njit(inline="always", **_JIT)
def _ef_output(kind, c, a, b, k, ys, e, d, s, m, mode, acc):
    """After bucket ``s .. s+m`` of ``y`` was encoded to codes ``c`` (decoded as
    :func:`_value` says): ``d = decoded`` (DECODED) and ``e = y - decoded`` (RESIDUAL),
    in one pass, and the new e's squares into the lanes ``acc`` (if not empty); nothing
    in the plain encoder (e None)."""
    if e is None or d is None or mode == Fuse.PLAIN:
        return
    if mode == Fuse.BOTH:
        ds, es = d[s:s + m], e[s:s + m]
        for i in range(m):
            dv = _value(kind, c[i], a, b, k)
            ds[i] = dv
            es[i] = ys[i] - dv
    elif mode == Fuse.DECODED:
        _decode_codes(kind, c, m, a, b, k, d[s:s + m], False)
        return
    else:
        es = e[s:s + m]
        for i in range(m):
            es[i] = ys[i] - _value(kind, c[i], a, b, k)
    if acc.size:
        _acc_sq(acc, e[s:s + m], s)


# --- int8: per-bucket min/max --------------------------------------------------------------

@njit(**_JIT)
def _minmax_encode(x, bs, bits, stochastic, key, lo_out, unit_out, packed, e, d, mode, acc):
    n = x.size
    L = (1 << bits) - 1
    fL = np.float32(L)
    zero = np.float32(0.0)
    c = np.empty(min(bs, n), np.uint8)
    ys = np.empty(min(bs, n) if mode & Fuse.RESIDUAL else 0, np.float32)
    w = np.empty(min(bs, n) // 2 + 4, np.uint32)
    wh = w.view(np.uint16)
    for b in range((n + bs - 1) // bs):
        s = b * bs
        m = min(bs, n - s)
        xs = _ef_input(x, e, s, m, mode, ys)
        lo_k, hi_k = _key_minmax(xs, m)
        bad = hi_k >= _KEY_PINF or lo_k <= _KEY_NINF
        lo = _unkey(lo_k)
        hi = _unkey(hi_k)
        rng = np.float64(hi) - np.float64(lo)
        ok = (not bad) and rng > 0
        lo_out[b] = _F32_NAN if bad else lo
        unit_out[b] = _F32_NAN if bad else np.float32(rng / L)
        if not ok:
            for i in range(m):
                c[i] = 0
        else:
            inv = np.float32(min(L / rng, _FLT_MAX))
            if stochastic:
                _fill_bucket_words(key, s, m, w)
                for i in range(m):
                    q = np.floor((xs[i] - lo) * inv + _u(wh[i]))
                    c[i] = np.uint8(min(max(q, zero), fL))
            else:
                for i in range(m):
                    q = np.floor((xs[i] - lo) * inv + np.float32(0.5))
                    c[i] = np.uint8(min(max(q, zero), fL))
        _pack_into(c, m, bits, packed[(s // 8) * bits:])
        _ef_output(_MINMAX, c, lo_out[b], unit_out[b], np.uint8(0), xs, e, d, s, m, mode, acc)


def minmax_encode(x, bs, bits, stochastic, key, lo_out, unit_out, packed):
    if x.size:
        _minmax_encode(x, bs, bits, stochastic, key, lo_out, unit_out, packed, None, None, _PLAIN,
                       _NOACC)


@njit(**_JIT)
def _minmax_decode(packed, n, bs, bits, lo, unit, out, add, base):
    c = np.empty(min(bs, n), np.uint8)
    k = np.uint8(0)
    for b in range((n + bs - 1) // bs):
        s = b * bs
        m = min(bs, n - s)
        o = out[s:s + m]
        if bits != 8:
            _unpack_into(packed[(s // 8) * bits:], m, bits, c)
        if base is None:            # an argument: numba compiles one branch or the other
            if bits == 8:
                _decode_codes(_MINMAX, packed[s:s + m], m, lo[b], unit[b], k, o, add)
            else:
                _decode_codes(_MINMAX, c, m, lo[b], unit[b], k, o, add)
        elif bits == 8:
            _decode_codes_onto(_MINMAX, packed[s:s + m], m, lo[b], unit[b], k, o, base[s:s + m])
        else:
            _decode_codes_onto(_MINMAX, c, m, lo[b], unit[b], k, o, base[s:s + m])
    return 0


def minmax_decode(packed, n, bs, bits, lo, unit, out, add=False, base=None):
    if not n:
        return 0
    return _minmax_decode(packed, n, bs, bits, lo, unit, out, add,
                          base if _onto(add, base, out) else None)


# --- int8 with a fixed, shared scale ----------------------------------------------------------

_FIXED_BLOCK = 4096


@njit(inline="always", **_JIT)
def _fixed_code(v, u, mul, fL, nan):
    """The code of ``v`` (dither ``u``): ``floor(v * mul + u)`` clamped to +-L, + L; ``nan``
    for NaN and +-inf."""
    q = min(max(np.floor(v * mul + u), -fL), fL) + fL
    return np.uint8(q) if np.isfinite(v) else nan


@njit(**_JIT)
def _fixed_encode(x, bits, scale, stochastic, key, packed, e, d, mode, acc):
    n = x.size
    L = (1 << (bits - 1)) - 1
    fL = np.float32(L)
    mul = np.float32(min(L / scale, _FLT_MAX))
    step = np.float32(scale / L)
    nan_code = np.uint8(2 * L + 1)
    c = np.empty(_FIXED_BLOCK, np.uint8)
    ys = np.empty(_FIXED_BLOCK if mode & Fuse.RESIDUAL else 0, np.float32)
    w = np.empty(_FIXED_BLOCK // 2 + 4, np.uint32)
    wh = w.view(np.uint16)
    for s in range(0, n, _FIXED_BLOCK):
        m = min(_FIXED_BLOCK, n - s)
        xs = _ef_input(x, e, s, m, mode, ys)
        if stochastic:          # two loops: LLVM does not always unswitch a select on it
            _fill_bucket_words(key, s, m, w)
            for i in range(m):
                c[i] = _fixed_code(xs[i], _u(wh[i]), mul, fL, nan_code)
        else:
            for i in range(m):
                c[i] = _fixed_code(xs[i], np.float32(0.5), mul, fL, nan_code)
        _pack_into(c, m, bits, packed[(s // 8) * bits:])
        _ef_output(_FIXED, c, fL, step, nan_code, xs, e, d, s, m, mode, acc)


def fixed_encode(x, bits, scale, stochastic, key, packed):
    if x.size:
        _fixed_encode(x, bits, scale, stochastic, key, packed, None, None, _PLAIN, _NOACC)


@njit(**_JIT)
def _fixed_decode(packed, n, bits, scale, out, add):
    L = (1 << (bits - 1)) - 1
    step = np.float32(scale / L)
    c = np.empty(_FIXED_BLOCK, np.uint8)
    for s in range(0, n, _FIXED_BLOCK):
        m = min(_FIXED_BLOCK, n - s)
        _unpack_into(packed[(s // 8) * bits:], m, bits, c)
        _decode_codes(_FIXED, c, m, np.float32(L), step, np.uint8(2 * L + 1), out[s:s + m], add)
    return 0


def fixed_decode(packed, n, bits, scale, out, add=False, base=None):
    if _onto(add, base, out):               # the shared-scale mode: the copy, then the add
        out[...] = base
    return _fixed_decode(packed, n, bits, scale, out, add) if n else 0


# --- qsgd / terngrad -----------------------------------------------------------------------

@njit(**_JIT)
def _signlevel_encode(x, bs, s_, bits, l2, key, scale_out, packed, e, d, mode, acc):
    n = x.size
    c = np.empty(min(bs, n), np.uint8)
    ys = np.empty(min(bs, n) if mode & Fuse.RESIDUAL else 0, np.float32)
    w = np.empty(min(bs, n) // 2 + 4, np.uint32)
    wh = w.view(np.uint16)
    sq = np.zeros(LANES)
    sbit = np.uint8(1 << (bits - 1))
    lmask = np.uint8(sbit - 1)
    fs = np.float32(s_)
    for b in range((n + bs - 1) // bs):
        s = b * bs
        m = min(bs, n - s)
        xs = _ef_input(x, e, s, m, mode, ys)
        if l2:
            sq[:] = 0.0
            full = m // LANES
            for t in range(full):
                r = xs[t * LANES:(t + 1) * LANES]
                for j in range(LANES):
                    v = np.float64(r[j])
                    sq[j] += v * v
            for j in range(m - full * LANES):
                v = np.float64(xs[full * LANES + j])
                sq[j] += v * v
            total = _fold(sq)
            bad = not np.isfinite(total)
            scale = np.float32(0.0) if bad else np.float32(np.sqrt(total))
        else:
            mk = np.int32(0)
            for i in range(m):
                mk = max(mk, np.int32(_f32_as_u32(xs[i])) & np.int32(0x7FFFFFFF))
            bad = mk >= _KEY_PINF
            scale = _u32_as_f32(np.uint32(0 if bad else mk))
        ok = (not bad) and scale > 0
        scale_out[b] = _F32_NAN if bad else scale
        if not ok:
            for i in range(m):
                c[i] = 0
        else:
            mul = np.float32(min(s_ / np.float64(scale), _FLT_MAX))
            _fill_bucket_words(key, s, m, w)
            for i in range(m):
                v = xs[i]
                lv = np.uint8(min(np.floor(abs(v) * mul + _u(wh[i])), fs))
                c[i] = lv | (sbit if (v < 0 and lv > 0) else np.uint8(0))
        _pack_into(c, m, bits, packed[(s // 8) * bits:])
        unit = np.float32(np.float64(scale_out[b]) / s_)
        _ef_output(_SIGNLEVEL, c, unit, unit, lmask, xs, e, d, s, m, mode, acc)


def signlevel_encode(x, bs, levels, bits, l2, key, scale_out, packed):
    if x.size:
        _signlevel_encode(x, bs, levels, bits, l2, key, scale_out, packed, None, None, _PLAIN,
                          _NOACC)


@njit(inline="always", **_JIT)
def _signlevel_codes(packed, s, m, bits, s_, scale_b, lmask, c):
    """Bucket ``s .. s+m``'s codes into ``c``: its unit, and how many of its levels
    exceed ``s_`` (a corrupt payload)."""
    _unpack_into(packed[(s // 8) * bits:], m, bits, c)
    nbad = 0
    for i in range(m):
        lv = c[i] & lmask
        nbad += lv > s_
    return np.float32(np.float64(scale_b) / s_), nbad


@njit(**_JIT)
def _signlevel_decode(packed, n, bs, s_, bits, scale, out, add, base):
    c = np.empty(min(bs, n), np.uint8)
    lmask = np.uint8((1 << (bits - 1)) - 1)
    nbad = 0
    for b in range((n + bs - 1) // bs):
        s = b * bs
        m = min(bs, n - s)
        unit, bad = _signlevel_codes(packed, s, m, bits, s_, scale[b], lmask, c)
        nbad += bad
        if base is None:            # an argument: numba compiles one branch or the other
            _decode_codes(_SIGNLEVEL, c, m, unit, unit, lmask, out[s:s + m], add)
        else:
            _decode_codes_onto(_SIGNLEVEL, c, m, unit, unit, lmask, out[s:s + m],
                               base[s:s + m])
    return nbad


def signlevel_decode(packed, n, bs, levels, bits, scale, out, add=False, base=None):
    if not n:
        return 0
    return int(_signlevel_decode(packed, n, bs, levels, bits, scale, out, add,
                                 base if _onto(add, base, out) else None))


# --- onebit ----------------------------------------------------------------------------------

@njit(**_JIT)
def _onebit_encode(x, bs, pos_out, neg_out, packed, e, d, mode, acc):
    n = x.size
    c = np.empty(min(bs, n), np.uint8)
    ys = np.empty(min(bs, n) if mode & Fuse.RESIDUAL else 0, np.float32)
    ps = np.zeros(LANES)
    ns = np.zeros(LANES)
    cn = np.zeros(LANES, np.int32)
    for b in range((n + bs - 1) // bs):
        s = b * bs
        m = min(bs, n - s)
        xs = _ef_input(x, e, s, m, mode, ys)
        ps[:] = 0.0
        ns[:] = 0.0
        cn[:] = 0
        full = m // LANES
        for t in range(full):
            r = xs[t * LANES:(t + 1) * LANES]
            for j in range(LANES):
                v = np.float64(r[j])
                ps[j] += max(v, 0.0)
                ns[j] += min(v, 0.0)
                cn[j] += r[j] >= np.float32(0.0)
        for j in range(m - full * LANES):
            v = np.float64(xs[full * LANES + j])
            ps[j] += max(v, 0.0)
            ns[j] += min(v, 0.0)
            cn[j] += xs[full * LANES + j] >= np.float32(0.0)
        psum = _fold(ps)
        nsum = _fold(ns)
        cnt = 0
        for j in range(LANES):
            cnt += cn[j]
        if not (np.isfinite(psum) and np.isfinite(nsum)):
            pos_out[b] = _F32_NAN
            neg_out[b] = _F32_NAN
            for i in range(m):
                c[i] = 0
        else:
            pos_out[b] = np.float32(psum / cnt) if cnt > 0 else np.float32(0.0)
            neg_out[b] = np.float32(nsum / (m - cnt)) if m - cnt > 0 else np.float32(0.0)
            for i in range(m):
                c[i] = xs[i] >= np.float32(0.0)
        _pack_into(c, m, 1, packed[s // 8:])
        _ef_output(_ONEBIT, c, pos_out[b], neg_out[b], np.uint8(0), xs, e, d, s, m, mode, acc)


def onebit_encode(x, bs, pos_out, neg_out, packed):
    if x.size:
        _onebit_encode(x, bs, pos_out, neg_out, packed, None, None, _PLAIN, _NOACC)


@njit(**_JIT)
def _onebit_decode(packed, n, bs, pos, neg, out, add, base):
    fold = add and base is None     # base: an argument, None or not in each compilation
    for b in range((n + bs - 1) // bs):
        s = b * bs
        m = min(bs, n - s)
        p = packed[s // 8:]
        o = out[s:s + m]
        pb, nb_ = pos[b], neg[b]
        full = m // 8
        if fold:
            for t in range(full):
                byte = p[t]
                for j in range(8):
                    o[8 * t + j] = (pb if (byte >> np.uint8(j)) & np.uint8(1) else nb_) + \
                        o[8 * t + j]
        else:
            for t in range(full):
                byte = p[t]
                for j in range(8):
                    o[8 * t + j] = pb if (byte >> np.uint8(j)) & np.uint8(1) else nb_
        for i in range(8 * full, m):
            v = pb if (p[i >> 3] >> np.uint8(i & 7)) & np.uint8(1) else nb_
            o[i] = v + o[i] if fold else v
        if base is not None:        # onto base: the plain decode, then the add while o is
            bo = base[s:s + m]      # in cache (a fused loop measured 1.6x slower)
            for i in range(m):
                o[i] += bo[i]
    return 0


def onebit_decode(packed, n, bs, pos, neg, out, add=False, base=None):
    if not n:
        return 0
    return _onebit_decode(packed, n, bs, pos, neg, out, add,
                          base if _onto(add, base, out) else None)


# --- fused compression (error feedback, round trips) ----------------------------------------

def _lanes(tally, residual):
    """Lanes to accumulate the new residual's squares in (empty: no tally asked)."""
    return np.zeros(LANES) if tally is not None and residual is not None else _NOACC


def _tally(tally, acc, n, at=0):
    """``tally[at:at + 2] += (sq_norm, n)`` from the lanes ``acc`` (nothing if empty)."""
    if acc.size:
        from ._numpy import fold_lanes
        tally[at] += fold_lanes(acc)
        tally[at + 1] += n


def _input_lanes(tally):
    """Lanes for the input's squares: a tally of four asks for them (``tally[2:4]``)."""
    return np.zeros(LANES) if tally is not None and tally.size > 2 else _NOACC


def f32_to_f16_fused(x, out, residual=None, decoded=None, tally=None):
    """:func:`f32_to_f16` of ``y = x (+ residual)``, leaving ``residual = y - decoded``
    and/or ``decoded`` (which may be ``x``) in the same pass; ``tally`` (float64[2]):
    ``+= (sq_norm(residual), n)`` of the new residual, in the same pass; float64[4]: also
    ``tally[2:4] += (sq_norm(x), n)`` of the input (before the residual joins it)."""
    if x.size:
        mode, e, d = _mode(x, residual, decoded, into_x=True)
        acc, acc_x = _lanes(tally, residual), _input_lanes(tally)
        _f16_encode(x, out, e, d, mode, acc, acc_x)
        _tally(tally, acc, x.size)
        _tally(tally, acc_x, x.size, 2)


def f32_to_bf16_fused(x, out, residual=None, decoded=None, tally=None):
    """:func:`f32_to_bf16` fused likewise."""
    if x.size:
        mode, e, d = _mode(x, residual, decoded, into_x=True)
        acc, acc_x = _lanes(tally, residual), _input_lanes(tally)
        _bf16_encode(x, out, e, d, mode, acc, acc_x)
        _tally(tally, acc, x.size)
        _tally(tally, acc_x, x.size, 2)


def minmax_encode_fused(x, bs, bits, stochastic, key, lo_out, unit_out, packed,
                        residual=None, decoded=None, tally=None):
    """:func:`minmax_encode` of ``y = x (+ residual)``, leaving ``residual = y - decoded``
    and/or ``decoded`` (may be ``x``) per bucket: the bytes of the plain kernels composed;
    ``tally`` as for :func:`f32_to_f16_fused`."""
    if x.size:
        mode, e, d = _mode(x, residual, decoded)
        acc = _lanes(tally, residual)
        _minmax_encode(x, bs, bits, stochastic, key, lo_out, unit_out, packed, e, d, mode, acc)
        _tally(tally, acc, x.size)


def fixed_encode_fused(x, bits, scale, stochastic, key, packed, residual=None, decoded=None,
                       tally=None):
    """:func:`fixed_encode` fused likewise."""
    if x.size:
        mode, e, d = _mode(x, residual, decoded)
        acc = _lanes(tally, residual)
        _fixed_encode(x, bits, scale, stochastic, key, packed, e, d, mode, acc)
        _tally(tally, acc, x.size)


def signlevel_encode_fused(x, bs, levels, bits, l2, key, scale_out, packed, residual=None,
                           decoded=None, tally=None):
    """:func:`signlevel_encode` fused likewise."""
    if x.size:
        mode, e, d = _mode(x, residual, decoded)
        acc = _lanes(tally, residual)
        _signlevel_encode(x, bs, levels, bits, l2, key, scale_out, packed, e, d, mode, acc)
        _tally(tally, acc, x.size)


def onebit_encode_fused(x, bs, pos_out, neg_out, packed, residual=None, decoded=None,
                        tally=None):
    """:func:`onebit_encode` fused likewise."""
    if x.size:
        mode, e, d = _mode(x, residual, decoded)
        acc = _lanes(tally, residual)
        _onebit_encode(x, bs, pos_out, neg_out, packed, e, d, mode, acc)
        _tally(tally, acc, x.size)


# --- squared norms (the divergence guard's) ---------------------------------------------------

@njit(**_JIT)
def _sq_lanes(a, acc):
    _acc_sq(acc, a, 0)


@njit(**_JIT)
def _copy_sq_lanes(src, dst, acc):
    n = src.size
    for s in range(0, n, _CAST_BLOCK):
        m = min(_CAST_BLOCK, n - s)
        d = dst[s:s + m]
        r = src[s:s + m]
        for i in range(m):
            d[i] = r[i]
        _acc_sq(acc, d, s)


def sq_norm(a):
    """:func:`._numpy.sq_norm` (float32 / float64 arrays here; others there)."""
    from ._numpy import fold_lanes
    return fold_lanes(sq_lanes(a, np.zeros(LANES)))


def sq_lanes(a, acc):
    """:func:`._numpy.sq_lanes` (float32 / float64 arrays here; others there)."""
    from ._numpy import sq_lanes as reference
    a = a.reshape(-1)
    if a.dtype not in (np.float32, np.float64) or not a.flags.c_contiguous:
        return reference(a, acc)
    _sq_lanes(a, acc)
    return acc


def copy_sq_norm(src, dst):
    """``dst[...] = src`` and its :func:`sq_norm` in one pass (flat float32 / float64)."""
    from ._numpy import copy_sq_norm as reference, fold_lanes
    if src.dtype not in (np.float32, np.float64) or src.dtype != dst.dtype or \
            not (src.flags.c_contiguous and dst.flags.c_contiguous) or src.size != dst.size:
        return reference(src, dst)
    acc = np.zeros(LANES)
    _copy_sq_lanes(src, dst, acc)
    return fold_lanes(acc)


# --- DGC's momentum correction ---------------------------------------------------------------

@njit(**_JIT)
def _velocity_in(u, x, m):
    for i in range(u.size):
        v = u[i] * m + x[i]
        u[i] = v
        x[i] = v


@njit(**_JIT)
def _momentum_undo(o, prev, now, m):
    for i in range(o.size):
        v = o[i]
        now[i] = v
        o[i] = v - prev[i] * m


def _flat_pair(*arrays_) -> bool:
    a0 = arrays_[0]
    return a0.dtype in (np.float32, np.float64) and all(
        a.dtype == a0.dtype and a.size == a0.size and a.flags.c_contiguous for a in arrays_)


def velocity_in(u, x, m):
    """:func:`._numpy.velocity_in` in one pass (flat float32 / float64; others there)."""
    if not _flat_pair(u, x):
        from ._numpy import velocity_in as reference
        return reference(u, x, m)
    _velocity_in(u.reshape(-1), x.reshape(-1), u.dtype.type(m))


def momentum_undo(o, prev, now, m):
    """:func:`._numpy.momentum_undo` in one pass (``prev`` left as it was)."""
    if not _flat_pair(o, prev, now):
        from ._numpy import momentum_undo as reference
        return reference(o, prev, now, m)
    _momentum_undo(o.reshape(-1), prev.reshape(-1), now.reshape(-1), o.dtype.type(m))


# --- 1-bit Adam's compressed step -------------------------------------------------------------

@njit(**_JIT)
def _adam_floor_denom(g, v, d, c2, bc2):
    for i in range(v.size):
        s = g[i] * g[i] * c2
        w = v[i]
        if w == w and (s != s or s > w):      # numpy's maximum: NaN from either side
            w = s
        v[i] = w
        d[i] = w / bc2


@njit(**_JIT)
def _adam_precondition(m, d, x, eps):
    for i in range(m.size):
        e = d[i] + eps
        d[i] = e
        x[i] = m[i] / e


@njit(**_JIT)
def _adam_release(z, d, m, step, bc1, replace):
    for i in range(z.size):
        if replace:
            m[i] = z[i] * d[i]
        step[i] = z[i] / bc1


def adam_floor_denom(g, v, d, c2, bc2):
    """:func:`._numpy.adam_floor_denom` in one pass (flat float32 / float64)."""
    if not _flat_pair(g, v, d):
        from ._numpy import adam_floor_denom as reference
        return reference(g, v, d, c2, bc2)
    t = v.dtype.type
    _adam_floor_denom(g.reshape(-1), v.reshape(-1), d.reshape(-1), t(c2), t(bc2))


def adam_precondition(m, d, x, eps):
    """:func:`._numpy.adam_precondition` in one pass."""
    if not _flat_pair(m, d, x):
        from ._numpy import adam_precondition as reference
        return reference(m, d, x, eps)
    _adam_precondition(m.reshape(-1), d.reshape(-1), x.reshape(-1), d.dtype.type(eps))


def adam_release(z, d, m, step, bc1, replace):
    """:func:`._numpy.adam_release` in one pass."""
    if not _flat_pair(z, d, m, step):
        from ._numpy import adam_release as reference
        return reference(z, d, m, step, bc1, replace)
    _adam_release(z.reshape(-1), d.reshape(-1), m.reshape(-1), step.reshape(-1),
                  z.dtype.type(bc1), bool(replace))


# --- topk / randomk ------------------------------------------------------------------------

_SAMPLE = 1 << 14


def abs_keys(x: np.ndarray) -> np.ndarray:
    """Unsigned integer keys ordered like ``|x|``, NaN above +inf: the numpy path's (a view
    and a mask, nothing to compile)."""
    from . import _numpy
    return _numpy.abs_keys(x)


@njit(**_JIT)
def _topk_candidates(keys, mask, t, cand):
    """Indices with ``keys & mask >= t`` into cand (capacity cand.size); returns the count
    (which may exceed the capacity: then cand holds the first ones only)."""
    c = 0
    cap = cand.size
    for i in range(keys.size):
        if keys[i] & mask >= t:
            if c < cap:
                cand[c] = i
            c += 1
    return c


@njit(**_JIT)
def _topk_take(ck, cand, t, need, idx_out):
    """Candidates with key > t, plus the first ``need`` with key == t, in index order."""
    o = 0
    for j in range(cand.size):
        kj = ck[j]
        if kj > t or (kj == t and need > 0):
            if kj == t:
                need -= 1
            idx_out[o] = cand[j]
            o += 1
    return o


@njit(**_JIT)
def _masked_gather(keys, mask, idx, out):
    for j in range(idx.size):
        out[j] = keys[idx[j]] & mask


@njit(**_JIT)
def _gather(x, idx, out):
    for j in range(idx.size):
        out[j] = x[idx[j]]


@njit(**_JIT)
def _add_candidates(x, e, mask, t, cand):
    """e = e + x, and the indices with ``bits(e) & mask >= t`` into cand, in one pass
    (as :func:`_topk_candidates` of the new e)."""
    c = 0
    cap = cand.size
    for i in range(e.size):
        y = e[i] + x[i]
        e[i] = y
        if _f32_as_u32(y) & mask >= t:
            if c < cap:
                cand[c] = i
            c += 1
    return c


def _threshold(sample, n, k):
    """(key threshold of the candidates, their capacity) from a key sample (None: the
    sample cannot bound the selection)."""
    f = k * _SAMPLE / n
    r = int(f + 4.0 * f ** 0.5 + 2)
    if r >= _SAMPLE:
        return None
    return np.partition(sample, _SAMPLE - r)[_SAMPLE - r], min(n, int(2 * r * n / _SAMPLE) + 1024)


def topk_select_add(x: np.ndarray, e: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """``e += x``, then :func:`topk_select` of ``e``: the same indices and values, with the
    addition and the candidates' pass fused (float32; other dtypes step by step)."""
    n = e.size
    k = min(k, n)
    if e.dtype != np.float32 or x.dtype != np.float32 or k == n or k == 0 or \
            n < 4 * _SAMPLE or k > n // 8:
        np.add(e, x, out=e)
        return topk_select(e, k)
    step = n // _SAMPLE
    mask = np.uint32(0x7FFFFFFF)
    with np.errstate(all="ignore"):                       # the sample of y = e + x
        ys = e[::step][:_SAMPLE] + x[::step][:_SAMPLE]
    got = _threshold(ys.view(np.uint32) & mask, n, k)
    if got is None:
        np.add(e, x, out=e)
        return topk_select(e, k)
    t, cap = got
    cand = np.empty(cap, np.int64)
    c = _add_candidates(x, e, mask, t, cand)
    if c < k or c > cap:                       # unlucky sample or adversarial data
        from . import _numpy
        return _numpy.topk_select(e, k)
    return _take(e, e.view(np.uint32), mask, cand[:c], k)


def topk_select(x: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Same result as the numpy path, from a sampled threshold (DGC) and one pass."""
    from . import _numpy
    n = x.size
    k = min(k, n)
    if k == n or k == 0 or n < 4 * _SAMPLE or k > n // 8:
        return _numpy.topk_select(x, k)
    keys = x.view(f"u{x.itemsize}")
    mask = keys.dtype.type((1 << (8 * x.itemsize - 1)) - 1)
    step = n // _SAMPLE
    sample = keys[::step][:_SAMPLE] & mask
    got = _threshold(sample, n, k)
    if got is None:
        return _numpy.topk_select(x, k)
    t, cap = got
    cand = np.empty(cap, np.int64)
    c = _topk_candidates(keys, mask, t, cand)
    if c < k or c > cap:                       # unlucky sample or adversarial data
        return _numpy.topk_select(x, k)
    return _take(x, keys, mask, cand[:c], k)


def _take(x, keys, mask, cand, k):
    """The k largest of the candidates ``cand`` (every index with a key >= the threshold,
    ascending): (indices, values)."""
    c = cand.size
    ck = np.empty(c, keys.dtype)
    _masked_gather(keys, mask, cand, ck)
    t = np.partition(ck, c - k)[c - k]              # the k-th largest key
    idx = np.empty(k, np.int64)
    _topk_take(ck, cand, t, k - int(np.count_nonzero(ck > t)), idx)
    vals = np.empty(k, x.dtype)
    _gather(keys, idx, vals.view(keys.dtype))            # bit copies (numba has no float16)
    return idx, vals


@njit(**_JIT)
def _scatter(out, idx, vals, add):
    n = out.size
    prev = -1
    for j in range(idx.size):
        i = idx[j]
        if i <= prev or i >= n:
            return 1
        prev = i
    for j in range(idx.size):
        if add:
            out[idx[j]] += vals[j]
        else:
            out[idx[j]] = vals[j]
    return 0


def scatter(out, idx, vals, add):
    if not idx.size:
        return 0
    if out.dtype == np.float16:
        if add:
            from . import _numpy
            return _numpy.scatter(out, idx, vals, add)
        out, vals = out.view(np.uint16), vals.view(np.uint16)
    return int(_scatter(out, idx, vals, add))


@njit(inline="always", **_JIT)
def _draw(lo, hi, n):
    """floor(u * n / 2^64) for u = hi * 2^32 + lo (exact, n < 2^32); u mod n above."""
    if n < 4294967296:
        nn = np.uint64(n)
        return (np.uint64(hi) * nn + ((np.uint64(lo) * nn) >> np.uint64(32))) >> np.uint64(32)
    return (np.uint64(lo) | (np.uint64(hi) << np.uint64(32))) % np.uint64(n)


@njit(**_JIT)
def _randomk_mark(key, n, m, bitmap):
    """Mark the first m distinct draws in bitmap (uint64 words)."""
    got = 0
    b = np.uint64(0)
    while got < m:
        w0, w1, w2, w3 = _block(key, b)
        b += np.uint64(1)
        got += _mark(bitmap, _draw(w0, w1, n))
        if got < m:
            got += _mark(bitmap, _draw(w2, w3, n))


@njit(inline="always", **_JIT)
def _mark(bitmap, r):
    """Set bit ``r`` of bitmap; 1 if it was clear, else 0."""
    word = r >> np.uint64(6)
    bit = np.uint64(1) << (r & np.uint64(63))
    if bitmap[word] & bit:
        return 0
    bitmap[word] |= bit
    return 1


def _cttz_ir(builder, x):
    i64 = ir.IntType(64)
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(i64, [i64, ir.IntType(1)]),
                                        "llvm.cttz.i64")
    return builder.call(fn, [x, ir.Constant(ir.IntType(1), 0)])


#: count of trailing zero bits of a uint64 (llvm.cttz)
_cttz = _unary("_cttz", types.uint64, types.uint64, _cttz_ir)


@njit(**_JIT)
def _bitmap_indices(bitmap, n, want, out):
    o = 0
    flip = np.uint64(0) if want else ~np.uint64(0)
    last = bitmap.size - 1
    for wi in range(bitmap.size):
        v = bitmap[wi] ^ flip
        if wi == last and n % 64:
            v &= (np.uint64(1) << np.uint64(n % 64)) - np.uint64(1)
        while v:
            out[o] = 64 * wi + np.int64(_cttz(v))
            o += 1
            v &= v - np.uint64(1)
    return o


def randomk_indices(key: np.ndarray, n: int, k: int, like: object = None) -> np.ndarray:
    k = min(k, n)
    if k == n:
        return np.arange(n, dtype=np.int64)
    m = min(k, n - k)
    bitmap = np.zeros((n + 63) // 64, np.uint64)
    _randomk_mark(key.astype(np.uint32), n, m, bitmap)
    out = np.empty(k, np.int64)
    _bitmap_indices(bitmap, n, 1 if m == k else 0, out)
    return out


@njit(**_JIT)
def _all_finite(xi, mask, inf):
    mk = xi.dtype.type(0)
    for i in range(xi.size):
        mk = max(mk, xi[i] & mask)
    return mk < inf


def all_finite(x: np.ndarray) -> bool:
    if x.dtype == np.float32:
        return bool(_all_finite(x.view(np.uint32), np.uint32(0x7FFFFFFF), np.uint32(0x7F800000)))
    return bool(np.isfinite(x).all())


def finite16(h: np.ndarray, bf16: bool = False) -> bool:
    """:func:`._numpy.finite16` in one pass (the largest magnitude's bits below inf's)."""
    inf = np.uint16(0x7F80 if bf16 else 0x7C00)
    return bool(_all_finite(h, np.uint16(0x7FFF), inf)) if h.size else True
