"""Pure-numpy kernels: the reference definition of every codec's bytes.

Always available and always correct; :mod:`._numba` implements the same functions with the
same floating-point operations in the same order, so both give identical bytes (tested).

Definitions shared by both paths:

- **random stream**: Philox4x32-10 (Salmon et al., SC'11), keyed by four uint32 words
  ``(k0, k1, c2, c3)`` from :func:`~gradcomm.compressors.base.seed_words`: word ``m`` of
  the stream is output ``m % 4`` of the block with counter ``(m // 4 mod 2^32, m // 2^34,
  c2, c3)`` and key ``(k0, k1)``. Counter-based: any slice is computed directly.
- **dither** of element ``i``: 16-bit half ``i % 2`` (low half first) of word ``i // 2``,
  used as the float32 ``u = (d + 0.5) / 2^16`` in ``q = floor(y + u)`` (stochastic
  rounding; its bias is below 2^-16 of a quantization step).
- **per-element arithmetic** in float32 (``y = (x - lo) * inv`` and the like), with
  per-bucket factors computed in float64, clamped to the float32 range, then rounded.
- **bit packing** of ``b``-bit codes: code ``i`` occupies bits ``i*b .. i*b+b-1`` of a
  little-endian bit stream, ``ceil(n*b/8)`` bytes.
- **bucket statistics**: min/max through an order-preserving integer key of the float
  bits (exact, NaN detected); sums in float64 over 64 lanes (element ``j`` of a bucket
  goes to lane ``j % 64``, each lane summed in order from +0.0, then lanes folded as
  ``acc[:h] += acc[h:2h]`` for h = 32, 16, ..., 1).

Example:
    >>> import numpy as np
    >>> codes = np.array([1, 2, 3], np.uint8)
    >>> unpack(pack(codes, 2), 3, 2).tolist(), pack(codes, 2).tolist()
    ([1, 2, 3], [57])
"""

from __future__ import annotations

import functools

import numpy as np

NAME = "numpy"
#: no one-pass fused encoders here: codecs compose error feedback step by step
FUSED = False
_M32 = np.uint64(0xFFFFFFFF)
_PM0, _PM1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
_PW0, _PW1 = np.uint64(0x9E3779B9), np.uint64(0xBB67AE85)
KEY_PINF = np.int32(0x7F800000)          # key(+inf); larger keys are NaNs
KEY_NINF = np.int32(-0x7F800001)         # key(-inf); smaller keys are NaNs
FLT_MAX = float(np.finfo(np.float32).max)
LANES = 64
_CHUNK = 1 << 20
_CHUNK_ELEMS = 1 << 16


def _quiet(fn):
    """Run ``fn`` without numpy's floating-point warnings (NaN/inf inputs are handled)."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with np.errstate(all="ignore"):
            return fn(*args, **kwargs)
    return wrapper


# --- random stream --------------------------------------------------------------------

def philox_blocks(c0: np.ndarray, c1: np.ndarray, c2: np.ndarray, c3: np.ndarray,
                  k0: int, k1: int) -> np.ndarray:
    """Philox4x32-10 of counters (c0, c1, c2, c3) (uint64 arrays of 32-bit values) under key
    (k0, k1): the four output words of each counter, flattened (uint32)."""
    k0, k1 = np.uint64(k0), np.uint64(k1)
    for _ in range(10):
        p0, p1 = _PM0 * c0, _PM1 * c2
        c0, c1, c2, c3 = ((p1 >> np.uint64(32)) ^ c1 ^ k0, p1 & _M32,
                          (p0 >> np.uint64(32)) ^ c3 ^ k1, p0 & _M32)
        k0, k1 = (k0 + _PW0) & _M32, (k1 + _PW1) & _M32
    return np.stack([c0, c1, c2, c3], axis=1).astype(np.uint32).reshape(-1)


def philox_words(key: np.ndarray, start: int, count: int, like: object = None) -> np.ndarray:
    """Words ``start .. start+count-1`` of the Philox4x32-10 stream keyed by ``key``
    (host arrays: ``like`` is not used here)."""
    out = np.empty(count, np.uint32)
    done = 0
    while done < count:
        b0 = (start + done) // 4
        b1 = min((start + count + 3) // 4, b0 + _CHUNK)
        blocks = np.arange(b0, b1, dtype=np.uint64)
        words = philox_blocks(blocks & _M32, blocks >> np.uint64(32),
                              np.full(blocks.size, key[2], np.uint64),
                              np.full(blocks.size, key[3], np.uint64), key[0], key[1])
        lo = start + done - 4 * b0
        take = min(count - done, words.size - lo)
        out[done:done + take] = words[lo:lo + take]
        done += take
    return out


def dither(key: np.ndarray, start: int, count: int, like: object = None) -> np.ndarray:
    """float32 dither ``(d + 0.5) / 2^16`` of elements ``start .. start+count-1``."""
    if count == 0:
        return np.zeros(0, np.float32)
    w0 = start // 2
    words = philox_words(key, w0, (start + count + 1) // 2 - w0)
    d = words.astype("<u4").view("<u2")[start - 2 * w0:start - 2 * w0 + count]
    return d.astype(np.float32) * np.float32(2.0 ** -16) + np.float32(2.0 ** -17)


# --- bit packing ----------------------------------------------------------------------

def pack(codes: np.ndarray, bits: int, out: np.ndarray | None = None) -> np.ndarray:
    """``bits``-bit codes (uint8, each < 2**bits) into a little-endian bit stream."""
    n = codes.size
    nbytes = (n * bits + 7) // 8
    if bits in (1, 2, 4, 8):
        per = 8 // bits
        if bits == 8:
            res = codes
        elif bits == 1:
            res = np.packbits(codes, bitorder="little")
        else:
            c = np.zeros(nbytes * per, np.uint8)
            c[:n] = codes
            c = c.reshape(nbytes, per)
            res = c[:, 0].copy()
            for j in range(1, per):
                res |= c[:, j] << np.uint8(bits * j)
        if out is None:
            return res.copy() if res is codes else res
        out[...] = res
        return out
    g = (n + 7) // 8
    c = np.zeros(g * 8, np.uint64)
    c[:n] = codes
    c = c.reshape(g, 8)
    w = np.zeros(g, np.uint64)
    for j in range(8):
        w |= c[:, j] << np.uint64(bits * j)
    res = w.astype("<u8").view(np.uint8).reshape(g, 8)[:, :bits].reshape(-1)[:nbytes]
    if out is None:
        return res
    out[...] = res
    return out


def unpack(packed: np.ndarray, n: int, bits: int) -> np.ndarray:
    """Inverse of :func:`pack`: ``n`` codes of ``bits`` bits as uint8."""
    if bits == 8:
        return packed[:n].copy()
    if bits == 1:
        return np.unpackbits(packed, count=n, bitorder="little")
    if bits in (2, 4):
        per = 8 // bits
        shifts = (np.arange(per, dtype=np.uint8) * np.uint8(bits)).reshape(1, per)
        return ((packed.reshape(-1, 1) >> shifts) & np.uint8((1 << bits) - 1)).reshape(-1)[:n]
    g = (n + 7) // 8
    flat = np.zeros(g * bits, np.uint8)
    flat[:packed.size] = packed
    buf = np.zeros((g, 8), np.uint8)
    buf[:, :bits] = flat.reshape(g, bits)
    w = buf.view("<u8").reshape(g, 1).astype(np.uint64)
    shifts = (np.arange(8, dtype=np.uint64) * np.uint64(bits)).reshape(1, 8)
    return ((w >> shifts) & np.uint64((1 << bits) - 1)).astype(np.uint8).reshape(-1)[:n]


# --- bucket statistics ----------------------------------------------------------------

def _starts(n: int, bs: int) -> np.ndarray:
    return np.arange(0, n, bs)


def _key(x32: np.ndarray) -> np.ndarray:
    xi = x32.view(np.int32)
    return xi ^ ((xi >> 31) & np.int32(0x7FFFFFFF))


def _lane_sums(v: np.ndarray, n: int, bs: int) -> np.ndarray:
    """Per-bucket sums of float64 ``v`` (length n), in the 64-lane order."""
    full = n // bs
    parts = []
    if full:
        parts.append(_row_lane_sums(v[:full * bs].reshape(full, bs)))
    if n % bs:
        parts.append(_row_lane_sums(v[full * bs:].reshape(1, -1)))
    return np.concatenate(parts)


def _row_lane_sums(rows: np.ndarray) -> np.ndarray:
    r, m = rows.shape
    g = (m + LANES - 1) // LANES
    pad = np.zeros((r, g * LANES))
    pad[:, :m] = rows
    lanes = pad.reshape(r, g, LANES)
    if g <= 1024:
        acc = np.zeros((r, LANES))
        for t in range(g):
            acc += lanes[:, t, :]
    else:
        acc = np.cumsum(lanes, axis=1)[:, -1, :] + 0.0   # + 0.0: same sign of zero
    h = LANES // 2
    while h:
        acc[:, :h] += acc[:, h:2 * h]
        h //= 2
    return acc[:, 0]


def _per_elem(v: np.ndarray, n: int, bs: int) -> np.ndarray:
    """Per-bucket values repeated per element (n elements in ``v.size`` buckets)."""
    return np.full(n, v[0], v.dtype) if v.size == 1 else np.repeat(v, bs)[:n]


def _chunks(n: int, bs: int):
    """(start, count) of runs of whole buckets of about _CHUNK elements: temporaries stay
    in cache, and any bucket size (or a hostile one) costs memory in proportion to n."""
    c = max(bs, (_CHUNK_ELEMS // bs) * bs)
    for s in range(0, n, c):
        yield s, min(c, n - s)


# --- float casts ------------------------------------------------------------------------

@_quiet
def f32_to_f16(x: np.ndarray, out: np.ndarray) -> None:
    """Round float32/64 to float16 bits (IEEE, to nearest even; overflow gives +-inf;
    NaN becomes the canonical quiet NaN ``0x7E00`` with its sign)."""
    with np.errstate(over="ignore", invalid="ignore"):
        out.view(np.float16)[...] = x
    nan = x != x
    if nan.any():
        out[nan] = np.where(np.signbit(x[nan]), 0xFE00, 0x7E00).astype(np.uint16)


@_quiet
def f16_to_f32(h: np.ndarray, out: np.ndarray, add: bool = False,
               base: np.ndarray | None = None) -> None:
    """Widen float16 bits to float32 (exact; NaN becomes the canonical quiet NaN);
    ``add``: ``out = widen(h) + base`` (``base`` defaults to ``out``)."""
    if add:
        base = out if base is None else base
        for s, m in _chunks(h.size, 8):
            tmp = np.empty(m, np.float32)
            f16_to_f32(h[s:s + m], tmp)
            np.add(tmp, base[s:s + m], out=out[s:s + m])
        return
    out[...] = h.view(np.float16)
    nan = (h & np.uint16(0x7C00)) == 0x7C00
    nan &= (h & np.uint16(0x3FF)) != 0
    if nan.any():
        out.view(np.uint32)[nan] = np.where(h[nan] & np.uint16(0x8000), 0xFFC00000,
                                            0x7FC00000).astype(np.uint32)


def f32_to_bf16(x: np.ndarray, out: np.ndarray) -> None:
    """Round float32 to bfloat16 bits (to nearest even; NaN stays a quiet NaN)."""
    bits = x.view(np.uint32)
    r = ((bits + (np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1)))) >> 16).astype(np.uint16)
    nan = x != x
    r[nan] = ((bits[nan] >> 16) | np.uint32(0x40)).astype(np.uint16)
    out[...] = r


@_quiet
def bf16_to_f32(h: np.ndarray, out: np.ndarray, add: bool = False,
                base: np.ndarray | None = None) -> None:
    """Widen bfloat16 bits to float32 (exact); ``add``: ``out = widen(h) + base``
    (``base`` defaults to ``out``)."""
    if add:
        base = out if base is None else base
        for s, m in _chunks(h.size, 8):
            wide = (h[s:s + m].astype(np.uint32) << 16).view(np.float32)
            np.add(wide, base[s:s + m], out=out[s:s + m])
        return
    out.view(np.uint32)[...] = h.astype(np.uint32) << 16


def finite16(h: np.ndarray, bf16: bool = False) -> bool:
    """Whether every half (``bf16``: bfloat16) of bits ``h`` (uint16) is finite: none
    has its exponent bits all set.

    Example:
        >>> h = np.array([1.0, 65504.0, np.inf], np.float16).view(np.uint16)
        >>> finite16(h[:2]), finite16(h), finite16(np.array([0x7F80], np.uint16), True)
        (True, False, False)
    """
    mask = np.uint16(0x7F80 if bf16 else 0x7C00)
    return not any(np.any(np.bitwise_and(h[s:s + m], mask) == mask)
                   for s, m in _chunks(h.size, 2))


# --- int8: per-bucket min/max --------------------------------------------------------------

@_quiet
def _minmax_encode(x: np.ndarray, start: int, bs: int, bits: int, stochastic: bool,
                   key: np.ndarray, lo_out: np.ndarray, unit_out: np.ndarray,
                   packed: np.ndarray) -> None:
    n, L = x.size, (1 << bits) - 1
    if n == 0:
        return
    k = _key(x)
    lo_k = np.minimum.reduceat(k, _starts(n, bs))
    hi_k = np.maximum.reduceat(k, _starts(n, bs))
    bad = (hi_k >= KEY_PINF) | (lo_k <= KEY_NINF)
    lo = _key(lo_k.view(np.float32)).view(np.float32)   # the key is an involution
    hi = _key(hi_k.view(np.float32)).view(np.float32)
    rng = hi.astype(np.float64) - lo.astype(np.float64)
    ok = ~bad & (rng > 0)
    inv = np.zeros(rng.size, np.float32)
    inv[ok] = np.minimum(L / rng[ok], FLT_MAX).astype(np.float32)
    lo_out[...] = np.where(bad, np.float32(np.nan), lo)
    unit_out[...] = np.where(bad, np.float32(np.nan), (rng / L).astype(np.float32))
    with np.errstate(invalid="ignore", over="ignore"):
        y = (x - _per_elem(np.where(ok, lo, 0).astype(np.float32), n, bs)) * \
            _per_elem(inv, n, bs)
        u = dither(key, start, n) if stochastic else np.float32(0.5)
        q = np.clip(np.floor(y + u), 0, L)
    q[_per_elem(~ok, n, bs)] = 0
    pack(q.astype(np.uint8), bits, packed)


def _put(v: np.ndarray, out: np.ndarray, add: bool, base: np.ndarray | None = None) -> None:
    """``out = v`` or, with ``add``, ``out = v + base`` (``base`` defaults to ``out``)."""
    if add:
        np.add(v, out if base is None else base, out=out)
    else:
        out[...] = v


@_quiet
def _minmax_decode(packed: np.ndarray, n: int, bs: int, bits: int, lo: np.ndarray,
                   unit: np.ndarray, out: np.ndarray, add: bool = False,
                   base: np.ndarray | None = None) -> int:
    c = unpack(packed, n, bits).astype(np.float32)
    _put(_per_elem(lo, n, bs) + c * _per_elem(unit, n, bs), out, add, base)
    return 0


# --- int8 with a fixed, shared scale (summable) ------------------------------------------

@_quiet
def _fixed_encode(x: np.ndarray, start: int, bits: int, scale: float, stochastic: bool,
                  key: np.ndarray, packed: np.ndarray) -> None:
    n, L = x.size, (1 << (bits - 1)) - 1
    mul = np.float32(min(L / scale, FLT_MAX))
    with np.errstate(invalid="ignore", over="ignore"):
        t = x * mul
        u = dither(key, start, n) if stochastic else np.float32(0.5)
        q = np.clip(np.floor(t + u), -L, L) + L
    q[~np.isfinite(x)] = 2 * L + 1                      # the NaN code
    pack(q.astype(np.uint8), bits, packed)


@_quiet
def _fixed_decode(packed: np.ndarray, n: int, bits: int, scale: float,
                  out: np.ndarray, add: bool = False, base: np.ndarray | None = None) -> int:
    """Returns the number of invalid codes (above 2L + 1 cannot occur; none are invalid)."""
    L = (1 << (bits - 1)) - 1
    c = unpack(packed, n, bits)
    step = np.float32(scale / L)
    v = (c.astype(np.float32) - np.float32(L)) * step
    v[c == 2 * L + 1] = np.nan
    _put(v, out, add, base)
    return 0


# --- qsgd / terngrad: sign + level, per-bucket scale ------------------------------------------

@_quiet
def _signlevel_encode(x: np.ndarray, start: int, bs: int, s: int, bits: int, l2: bool,
                      key: np.ndarray, scale_out: np.ndarray, packed: np.ndarray) -> None:
    n = x.size
    if n == 0:
        return
    if l2:
        x64 = x.astype(np.float64)
        total = _lane_sums(x64 * x64, n, bs)
        bad = ~np.isfinite(total)
        scale = np.sqrt(np.where(bad, 0.0, total)).astype(np.float32)
    else:
        m = np.maximum.reduceat(x.view(np.int32) & np.int32(0x7FFFFFFF), _starts(n, bs))
        bad = m >= KEY_PINF
        scale = np.where(bad, 0, m).astype(np.int32).view(np.float32)
    ok = ~bad & (scale > 0)
    mul = np.zeros(scale.size, np.float32)
    mul[ok] = np.minimum(s / scale[ok].astype(np.float64), FLT_MAX).astype(np.float32)
    scale_out[...] = np.where(bad, np.float32(np.nan), scale)
    with np.errstate(invalid="ignore", over="ignore"):
        y = np.abs(x) * _per_elem(mul, n, bs)
        level = np.minimum(np.floor(y + dither(key, start, n)), s)
    level[_per_elem(~ok, n, bs)] = 0
    level = level.astype(np.uint8)
    sign = (x < 0) & (level > 0)
    pack(level | (sign.astype(np.uint8) << np.uint8(bits - 1)), bits, packed)


@_quiet
def _signlevel_decode(packed: np.ndarray, n: int, bs: int, s: int, bits: int,
                      scale: np.ndarray, out: np.ndarray, add: bool = False,
                      base: np.ndarray | None = None) -> int:
    """Returns the number of codes whose level exceeds ``s`` (a corrupt payload)."""
    c = unpack(packed, n, bits)
    level = c & np.uint8((1 << (bits - 1)) - 1)
    unit = (scale.astype(np.float64) / s).astype(np.float32)
    v = level.astype(np.float32) * _per_elem(unit, n, bs)
    _put(np.where(c >> np.uint8(bits - 1) != 0, -v, v), out, add, base)
    return int(np.count_nonzero(level > s))


# --- onebit: sign bit, per-bucket means of the two groups ---------------------------------

@_quiet
def _onebit_encode(x: np.ndarray, start: int, bs: int, pos_out: np.ndarray,
                   neg_out: np.ndarray, packed: np.ndarray) -> None:
    n = x.size
    if n == 0:
        return
    x64 = x.astype(np.float64)
    up = x >= 0
    psum = _lane_sums(np.maximum(x64, 0.0), n, bs)       # NaN propagates to both
    nsum = _lane_sums(np.minimum(x64, 0.0), n, bs)
    cnt = np.add.reduceat(up.astype(np.int64), _starts(n, bs))
    size = np.minimum(bs, n - _starts(n, bs))
    bad = ~(np.isfinite(psum) & np.isfinite(nsum))
    with np.errstate(invalid="ignore", divide="ignore"):
        pos = np.where(cnt > 0, psum / np.maximum(cnt, 1), 0.0).astype(np.float32)
        neg = np.where(size - cnt > 0, nsum / np.maximum(size - cnt, 1), 0.0).astype(np.float32)
    pos_out[...] = np.where(bad, np.float32(np.nan), pos)
    neg_out[...] = np.where(bad, np.float32(np.nan), neg)
    bit = up & ~_per_elem(bad, n, bs)
    pack(bit.astype(np.uint8), 1, packed)


@_quiet
def _onebit_decode(packed: np.ndarray, n: int, bs: int, pos: np.ndarray, neg: np.ndarray,
                   out: np.ndarray, add: bool = False, base: np.ndarray | None = None) -> int:
    bit = unpack(packed, n, 1).astype(bool)
    _put(np.where(bit, _per_elem(pos, n, bs), _per_elem(neg, n, bs)), out, add, base)
    return 0


# --- chunk drivers (the public quantizer kernels) ----------------------------------------

def minmax_encode(x, bs, bits, stochastic, key, lo_out, unit_out, packed) -> None:
    for s, m in _chunks(x.size, bs):
        b, nb, p = s // bs, -(-m // bs), s * bits // 8
        _minmax_encode(x[s:s + m], s, bs, bits, stochastic, key, lo_out[b:b + nb],
                       unit_out[b:b + nb], packed[p:p + (m * bits + 7) // 8])


def _part(base: np.ndarray | None, s: int, m: int) -> np.ndarray | None:
    """``base[s:s + m]`` of a decode-add's ``base`` (None: the output itself)."""
    return None if base is None else base[s:s + m]


def minmax_decode(packed, n, bs, bits, lo, unit, out, add=False, base=None) -> int:
    for s, m in _chunks(n, bs):
        b, nb, p = s // bs, -(-m // bs), s * bits // 8
        _minmax_decode(packed[p:p + (m * bits + 7) // 8], m, bs, bits, lo[b:b + nb],
                       unit[b:b + nb], out[s:s + m], add, _part(base, s, m))
    return 0


def fixed_encode(x, bits, scale, stochastic, key, packed) -> None:
    for s, m in _chunks(x.size, 8):
        p = s * bits // 8
        _fixed_encode(x[s:s + m], s, bits, scale, stochastic, key,
                      packed[p:p + (m * bits + 7) // 8])


def fixed_decode(packed, n, bits, scale, out, add=False, base=None) -> int:
    for s, m in _chunks(n, 8):
        p = s * bits // 8
        _fixed_decode(packed[p:p + (m * bits + 7) // 8], m, bits, scale, out[s:s + m], add,
                      _part(base, s, m))
    return 0


def signlevel_encode(x, bs, levels, bits, l2, key, scale_out, packed) -> None:
    for s, m in _chunks(x.size, bs):
        b, nb, p = s // bs, -(-m // bs), s * bits // 8
        _signlevel_encode(x[s:s + m], s, bs, levels, bits, l2, key, scale_out[b:b + nb],
                          packed[p:p + (m * bits + 7) // 8])


def signlevel_decode(packed, n, bs, levels, bits, scale, out, add=False, base=None) -> int:
    bad = 0
    for s, m in _chunks(n, bs):
        b, nb, p = s // bs, -(-m // bs), s * bits // 8
        bad += _signlevel_decode(packed[p:p + (m * bits + 7) // 8], m, bs, levels, bits,
                                 scale[b:b + nb], out[s:s + m], add, _part(base, s, m))
    return bad


def onebit_encode(x, bs, pos_out, neg_out, packed) -> None:
    for s, m in _chunks(x.size, bs):
        b, nb = s // bs, -(-m // bs)
        _onebit_encode(x[s:s + m], s, bs, pos_out[b:b + nb], neg_out[b:b + nb],
                       packed[s // 8:s // 8 + (m + 7) // 8])


def onebit_decode(packed, n, bs, pos, neg, out, add=False, base=None) -> int:
    for s, m in _chunks(n, bs):
        b, nb = s // bs, -(-m // bs)
        _onebit_decode(packed[s // 8:s // 8 + (m + 7) // 8], m, bs, pos[b:b + nb],
                       neg[b:b + nb], out[s:s + m], add, _part(base, s, m))
    return 0


# --- topk / randomk ------------------------------------------------------------------------

def abs_keys(x: np.ndarray) -> np.ndarray:
    """Unsigned integer keys ordered like ``|x|``, NaN above +inf (float16/32/64)."""
    u = x.view(f"u{x.itemsize}")
    return u & u.dtype.type((1 << (8 * x.itemsize - 1)) - 1)


def topk_select(x: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The ``k`` largest ``|x|`` (NaN largest; ties to the lower index), index order.

    Returns (indices as int64, values in x's dtype).
    """
    n = x.size
    k = min(k, n)
    if k == n:
        return np.arange(n, dtype=np.int64), x.copy()
    if k == 0:
        return np.zeros(0, np.int64), x[:0].copy()
    keys = abs_keys(x)
    t = np.partition(keys, n - k)[n - k]
    gt = np.flatnonzero(keys > t)
    eq = np.flatnonzero(keys == t)[:k - gt.size]
    idx = np.sort(np.concatenate([gt, eq]))
    return idx, x[idx]


def scatter(out: np.ndarray, idx: np.ndarray, vals: np.ndarray, add: bool) -> int:
    """``out[idx] = vals`` (or ``+=``) after checking 0 <= idx < n, strictly increasing.

    Returns 0, or 1 (nothing written) when the indices are invalid.
    """
    if idx.size:
        if idx[0] < 0 or idx[-1] >= out.size or (idx.size > 1 and not (np.diff(idx) > 0).all()):
            return 1
        if add:
            out[idx] += vals
        else:
            out[idx] = vals
    return 0


def randomk_indices(key: np.ndarray, n: int, k: int, like: object = None) -> np.ndarray:
    """The ``k`` of ``range(n)`` that random-k keeps, ascending (int64). (``like``, where
    the device kernels put the indices, is ignored: here they are host arrays.)

    Draw ``j`` is ``floor(u_j * n / 2^64)`` (``u_j mod n`` for n >= 2^32) with ``u_j`` the
    little-endian pair of stream words ``2j, 2j+1``; with ``m = min(k, n - k)`` the first
    ``m`` distinct draws are kept (``k <= n / 2``) or left out (``k > n / 2``).
    """
    k = min(k, n)
    if k == n:
        return np.arange(n, dtype=np.int64)
    m = min(k, n - k)
    draws = np.zeros(0, np.uint64)
    batch = max(64, 2 * m)
    while True:
        words = philox_words(key, 2 * draws.size, 2 * batch)
        draws = np.concatenate([draws, _draw(words, n)])
        uniq, first = np.unique(draws, return_index=True)
        if uniq.size >= m:
            chosen = draws[np.sort(first)[:m]].astype(np.int64)
            break
        batch = draws.size
    if m == k:
        return np.sort(chosen)
    keep = np.ones(n, bool)
    keep[chosen] = False
    return np.flatnonzero(keep)


def _draw(words: np.ndarray, n: int) -> np.ndarray:
    lo = words[0::2].astype(np.uint64)
    hi = words[1::2].astype(np.uint64)
    if n < 1 << 32:
        nn = np.uint64(n)
        return (hi * nn + ((lo * nn) >> np.uint64(32))) >> np.uint64(32)
    return (lo | (hi << np.uint64(32))) % np.uint64(n)


def all_finite(x: np.ndarray) -> bool:
    return bool(np.isfinite(x).all())


# --- squared norms (the divergence guard's) -------------------------------------------------
# ``sq_norm(a)``: float64 squares of the elements (exact for float32), element ``i`` into
# lane ``i % 64``, each lane summed in order from +0.0, lanes folded as the bucket sums are.
# The numba fused encoders add the same sum of their residual to a tally in their pass.

_NORM_ROWS = 1 << 14


def fold_lanes(acc: np.ndarray) -> float:
    """``acc`` (float64[64] lane sums) folded as ``acc[:h] += acc[h:2h]``, h = 32 .. 1."""
    acc = np.array(acc, np.float64)
    h = LANES // 2
    while h:
        acc[:h] += acc[h:2 * h]
        h //= 2
    return float(acc[0])


def sq_norm(a: np.ndarray) -> float:
    """``sum(a * a)`` of a flat float array in float64, in the 64-lane order (NaN or inf
    if ``a`` holds one)."""
    acc = np.zeros(LANES)
    return fold_lanes(sq_lanes(a, acc))


@_quiet
def sq_lanes(a: np.ndarray, acc: np.ndarray) -> np.ndarray:
    """The lanes of :func:`sq_norm`: ``a``'s squares added to the float64[64] lane sums
    ``acc``, element ``i`` into lane ``i % 64``; returns the new sums (``acc`` may be
    replaced). A long array may come in slices, in order: the same sums if each but the
    last holds a multiple of 64 elements."""
    a = a.reshape(-1)
    n = a.size
    full = n // LANES
    if full:
        rows = a[:full * LANES].reshape(full, LANES)
        tmp = np.empty((min(_NORM_ROWS, full) + 1, LANES))
        for r0 in range(0, full, _NORM_ROWS):
            r = min(_NORM_ROWS, full - r0)
            t = tmp[:r + 1]
            t[0] = acc                          # the lanes so far, then rows in order
            np.multiply(rows[r0:r0 + r], rows[r0:r0 + r], out=t[1:], dtype=np.float64)
            acc = t.sum(axis=0)                 # axis 0: row after row, per lane
    if n > full * LANES:
        tail = a[full * LANES:].astype(np.float64)
        acc[:tail.size] += tail * tail
    return acc


def copy_sq_norm(src: np.ndarray, dst: np.ndarray) -> float:
    """``dst[...] = src`` (flat, same dtype) and :func:`sq_norm` of it."""
    np.copyto(dst, src)
    return sq_norm(dst)


def velocity_in(u: np.ndarray, x: np.ndarray, m: float) -> None:
    """``u = u * m + x``, then ``x[...] = u`` (``m`` in the arrays' dtype)."""
    u *= u.dtype.type(m)
    u += x
    np.copyto(x, u)


def adam_floor_denom(g: np.ndarray, v: np.ndarray, d: np.ndarray, c2: float,
                     bc2: float) -> None:
    """``v = maximum(v, g * g * c2)``, then ``d = v / bc2`` (scalars in the dtype; NaN
    propagates as numpy's ``maximum`` does)."""
    t = v.dtype.type
    np.multiply(g, g, out=d)
    d *= t(c2)
    np.maximum(v, d, out=v)
    np.divide(v, t(bc2), out=d)


def adam_precondition(m: np.ndarray, d: np.ndarray, x: np.ndarray, eps: float) -> None:
    """``d += eps``, then ``x = m / d``."""
    d += d.dtype.type(eps)
    np.divide(m, d, out=x)


def adam_release(z: np.ndarray, d: np.ndarray, m: np.ndarray, step: np.ndarray,
                 bc1: float, replace: bool) -> None:
    """``m = z * d`` if ``replace``, then ``step = z / bc1``."""
    if replace:
        np.multiply(z, d, out=m)
    np.divide(z, z.dtype.type(bc1), out=step)


def momentum_undo(o: np.ndarray, prev: np.ndarray, now: np.ndarray, m: float) -> None:
    """``now[...] = o``, then ``o -= prev * m`` (``m`` in the arrays' dtype; ``prev``
    holds the product afterwards)."""
    np.copyto(now, o)
    prev *= prev.dtype.type(m)
    o -= prev
