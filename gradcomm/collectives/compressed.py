"""Allreduce with a compressor: every codec composes with every collective.

A compressed allreduce takes one of three routes, decided per codec and algorithm:

- **per hop** (``ring``, ``tree``, ``recursive_doubling``, ``rabenseifner``): the dense
  algorithm runs on a :class:`CompressedWire`, which sends codec payloads and decodes,
  adds and re-encodes at every reduce hop; finished segments travel compressed in the
  allgather phase (decoded once, forwarded as received), so the bytes per rank stay
  2(p−1)/p of the compressed size. Natural for *summable* codecs (fp16, bf16, int8,
  randomk with a shared seed, none); for *gathered* codecs (topk, qsgd, terngrad, onebit)
  this is the CGX / 1-bit-Adam scheme extended to trees and recursive doubling. Each
  re-compression adds error: with error feedback every hop keeps its own residual
  (``"<key>#e<i>"`` for partial sums, ``"<key>#f<i>"`` for finished ones), so what a hop
  drops is sent at the same hop of the next step (recursive doubling: ranks that hold
  the same partial sum hold the same residual, so they still produce the same bytes).
  A codec told to keep ``k`` elements keeps ``k/n`` of each segment. Measured one-step
  relative errors at p = 4 (allgather → per hop): fp16 1e-4 → 3e-4, int8 0.004 → 0.009,
  qsgd 0.03 → 0.07, topk(0.1) 0.67 → 0.80; with error feedback the running mean's error
  falls like 1/T (``tests/collectives/test_compressed.py`` prints the table).
- **allgather**: every rank compresses ``e + g`` once, the payloads (variable sizes) are
  allgathered, and every rank decodes and sums them in rank order. No re-compression
  error, but (p−1)·c bytes received per rank.
- **sparse_allgather**: as allgather, for codecs whose output is sparse (topk): the
  (index, value) pairs go through :func:`~gradcomm.collectives.sparse_allgather.allreduce`,
  which switches to a dense allreduce when the union gets dense.

Every (compressor, algorithm) pair above works; ``native`` and anything else raise
UnsupportedError / ConfigError naming the pairs that do. ``algorithm="auto"``:

===========================  ==============================================================
codec                        choice (c = compressed bytes, d = dense bytes, p ranks)
===========================  ==============================================================
summable                     the dense table (``auto.select``) applied to c: recursive
                             doubling below 64 KiB, else rabenseifner (power-of-two p > 2)
                             or ring
gathered, p·c <= 2·d         allgather (sparse_allgather for topk): exact aggregation of
                             the compressed contributions, no more bytes than a dense ring
gathered, p·c > 2·d          the dense table applied to c, re-compressing per hop
===========================  ==============================================================

Details shared by the routes: ops ``sum`` and ``mean`` only; floating dtypes only;
float16 and bfloat16 are widened to float32 for the codecs (float64 stays float64) and
rounded back at the end; for ``mean`` with a lossy codec the inputs are divided by p
*before* compressing (no overflow in narrow formats). Error feedback applies only to
codecs that are contractions (:func:`gradcomm.error_feedback.contractive`: not TernGrad or
few-level QSGD, whose residuals diverge). With p = 1 nothing is compressed:
the result is ``g + e`` exactly and the residual drops to zero. Stochastic codecs draw from
seeds ``(seed, step, crc32(key), rank)`` (``shared_seed`` codecs: without rank; per-hop
encodings add the segment's offset and length, and finished segments use no rank at all,
so ranks holding equal data produce equal bytes). The cross-rank check covers count,
dtype, op, algorithm, codec name and config, seed, step, key and error feedback.

Example:
    >>> import numpy as np
    >>> from gradcomm.comm import run_ranks
    >>> def fn(t):
    ...     x = np.full(5, t.rank + 1.0, np.float32)
    ...     return compressed_allreduce(t, x, "float32", op="sum", algorithm="ring",
    ...                                 compressor="none").tolist()
    >>> run_ranks(3, fn)[1]
    [6.0, 6.0, 6.0, 6.0, 6.0]
"""

from __future__ import annotations

import inspect
import struct
import weakref
import zlib
from typing import Any

import numpy as np

from .. import compressors
from .._dtypes import FLOATS, bf16_to_f32, f32_to_bf16
from ..comm.base import Transport
from ..compressors.base import Compressor, Payload
from ..error_feedback import HOP_SEP, ErrorFeedback, contractive
from ..errors import ConfigError, GradcommError, MismatchError, PayloadError, UnsupportedError
from ._check import agree
from ._reduce import Reducer

#: algorithms that run per hop on a CompressedWire
HOP_ALGORITHMS = ("ring", "tree", "recursive_doubling", "rabenseifner")
#: algorithms that gather the compressed contributions
GATHER_ALGORITHMS = ("allgather", "sparse_allgather")
#: every algorithm name a compressed allreduce accepts
COMPRESSED_ALGORITHMS = (*HOP_ALGORITHMS, *GATHER_ALGORITHMS, "auto")
OPS = ("sum", "mean")
#: target bytes of one compressed message in the pipelined ring and tree
CHUNK_BYTES = 512 * 1024

_HDR = struct.Struct("<II")       # frame: number of parts, reserved (0)
_PART = struct.Struct("<QQQ")     # part: offset in the segment, elements, payload bytes
_STEPS: "weakref.WeakKeyDictionary[Transport, int]" = weakref.WeakKeyDictionary()


def _round8(n: int) -> int:
    return (n + 7) & ~7


def max_nbytes(codec: Compressor, n: int, dtype: str) -> int:
    """Upper bound of ``codec``'s payload bytes for ``n`` elements of ``dtype``."""
    fn = getattr(codec, "max_nbytes", None)
    try:
        if fn is not None:
            return int(fn(n, dtype))
    except UnsupportedError:
        if codec.lossy:
            raise
    if codec.lossy:
        raise UnsupportedError(f"compressor {codec.name!r} does not declare max_nbytes(n, "
                               "dtype), needed to post exact receive sizes")
    return codec.compress(np.zeros(n, dtype)).nbytes   # lossless: size depends on n only


def is_sparse(codec: Compressor) -> bool:
    """True if the codec's decoded output is mostly zeros (top-k style)."""
    return bool(getattr(codec, "sparse", codec.name == "topk"))


class _Seeds:
    """Seed tuples for one call: ``(seed, step, crc32(key))`` plus what tells draws apart."""

    def __init__(self, seed: int, step: int, key: str, rank: int, shared: bool) -> None:
        self.base = (seed, step, zlib.crc32(key.encode()))
        self.rank, self.shared = rank, shared

    def whole(self) -> tuple[int, ...]:
        return self.base if self.shared else (*self.base, self.rank)

    def partial(self, off: int, n: int, hop: int) -> tuple[int, ...]:
        if self.shared:
            return (*self.base, off, n)
        return (*self.base, self.rank, 1, hop, off, n)

    def final(self, off: int, n: int, hop: int, seg: np.ndarray) -> tuple[int, ...]:
        if self.shared:
            return (*self.base, off, n)
        stride = max(1, seg.size // 64)
        fingerprint = zlib.crc32(np.ascontiguousarray(seg[::stride]).tobytes())
        return (*self.base, 2, hop, off, n, fingerprint)


class CompressedWire:
    """The :class:`~gradcomm.collectives._wire.Wire` of a compressed allreduce.

    Frames: ``[nparts u32][0 u32]`` then ``nparts`` × ``[offset u64][count u64][bytes
    u64]``, then each part's payload padded to 8 bytes, then zeros up to a size that
    follows from the element count alone (what receivers post). A partial segment is one
    part; a finished segment assembled from finished pieces (Rabenseifner's allgather) is
    sent as those pieces' payloads, not re-compressed. Peer frames are validated: parts
    must tile the segment, sizes must fit, payloads parse and decode to the right length.

    ``ef`` (an :class:`ErrorFeedback`, or None) keeps one residual per hop; ``key`` names
    them. Hops are numbered in call order, which depends on (n, p, algorithm) only.
    """

    lossy = True

    def __init__(self, codec: Compressor, base: np.ndarray, seeds: _Seeds, *,
                 max_parts: int = 1, ef: ErrorFeedback | None = None, key: str = "") -> None:
        self.codec, self.base, self.seeds = codec, base, seeds
        self.dtype = base.dtype.name
        self.max_parts = max(1, max_parts)
        self.ef = ef if (ef is not None and ef.enabled and codec.lossy) else None
        self.key = key
        self._bounds: dict[tuple[int, int], int] = {}
        self._maxes: dict[int, int] = {}
        # bytes a part may need beyond its share of max_nbytes(n): a header, one block of
        # rounding, and wider integers in the header (msgpack ints grow to 9 bytes)
        self._gap = _round8(self._max(1)) + 48
        self._finished: dict[int, tuple[int, np.ndarray]] = {}   # offset -> (n, payload)
        self._scratch: list[np.ndarray | None] = [None, None, None]
        self._partial_hops = 0
        self._final_hops = 0
        self._reuse = "out" in inspect.signature(codec.compress).parameters
        self._last: Payload | None = None

    # -- sizes ----------------------------------------------------------------------------
    def bound(self, n: int, parts: int = 1) -> int:
        """Frame bytes for ``n`` elements in up to ``parts`` parts."""
        b = self._bounds.get((n, parts))
        if b is None:
            b = (_HDR.size + _PART.size * parts + _round8(self._max(n))
                 + (parts - 1) * self._gap)
            self._bounds[(n, parts)] = b
        return b

    def _max(self, n: int) -> int:
        m = self._maxes.get(n)
        if m is None:
            m = self._maxes[n] = max_nbytes(self.codec, n, self.dtype)
        return m

    def _scratch_of(self, slot: int, n: int) -> np.ndarray:
        s = self._scratch[slot]
        if s is None or s.size < n:
            s = self._scratch[slot] = np.empty(max(n, 1), self.base.dtype)
        return s[:n]

    def _offset(self, seg: np.ndarray) -> int:
        off, rem = divmod(seg.ctypes.data - self.base.ctypes.data, self.base.itemsize)
        if rem or off < 0 or off + seg.size > self.base.size:
            raise ConfigError("CompressedWire: segments must be views of the reduced buffer")
        return off

    def _forget(self, lo: int, hi: int) -> None:
        for off in [o for o, (m, _) in self._finished.items() if o < hi and o + m > lo]:
            del self._finished[off]

    def _hop_residual(self, name: str, off: int, n: int, dtype: Any) -> np.ndarray:
        """The residual of one hop; a residual store with ``locate(name, offset)`` (the DDP
        hook's) is told where the hop's segment starts, to map it back to positions."""
        assert self.ef is not None
        locate = getattr(self.ef, "locate", None)
        if locate is not None:
            locate(name, off)
        return self.ef.residual(name, n, dtype)

    # -- frames ---------------------------------------------------------------------------
    def _frame(self, parts: list[tuple[int, int, np.ndarray]], size: int) -> np.ndarray:
        out = np.empty(size, np.uint8)       # fresh: the algorithm may still be sending
        _HDR.pack_into(out, 0, len(parts), 0)
        pos = _HDR.size + _PART.size * len(parts)
        for i, (off, m, payload) in enumerate(parts):
            _PART.pack_into(out, _HDR.size + _PART.size * i, off, m, payload.size)
            out[pos:pos + payload.size] = payload
            out[pos + payload.size:pos + _round8(payload.size)] = 0
            pos += _round8(payload.size)
        out[pos:] = 0                         # no stale memory on the wire
        return out

    def _frame_size(self, parts: list[tuple[int, int, np.ndarray]]) -> int:
        return _HDR.size + _PART.size * len(parts) + sum(_round8(p.size) for _, _, p in parts)

    def _parts(self, frame: np.ndarray, n: int, max_parts: int
               ) -> list[tuple[int, int, np.ndarray]]:
        """Validated (offset, count, payload bytes) of a peer's frame for ``n`` elements."""
        if frame.size < _HDR.size:
            raise PayloadError(f"compressed frame of {frame.size} bytes has no header")
        nparts, reserved = _HDR.unpack_from(frame, 0)
        pos = _HDR.size + _PART.size * nparts
        if not 1 <= nparts <= max_parts or reserved or pos > frame.size:
            raise PayloadError(f"compressed frame announces {nparts} parts (allowed 1.."
                               f"{max_parts}) in {frame.size} bytes")
        parts, expect = [], 0
        for i in range(nparts):
            off, m, plen = _PART.unpack_from(frame, _HDR.size + _PART.size * i)
            if off != expect or m < 1 or off + m > n or pos + plen > frame.size:
                raise PayloadError(f"compressed frame part {i}: offset {off}, {m} elements, "
                                   f"{plen} bytes do not fit a segment of {n} elements in "
                                   f"{frame.size} bytes")
            parts.append((off, m, frame[pos:pos + plen]))
            pos += _round8(plen)
            expect = off + m
        if expect != n:
            raise PayloadError(f"compressed frame covers {expect} of {n} elements")
        return parts

    def _decode(self, data: np.ndarray, dst: np.ndarray) -> None:
        """``dst[...] = decode(data)`` (contiguous ``dst``), validated: codec name, the
        announced count ``n`` and, in the codecs, everything else."""
        payload = Payload.from_bytes(data, max_nbytes=data.size)
        if payload.codec != self.codec.name:
            raise PayloadError(f"payload of codec {payload.codec!r} where {self.codec.name!r} "
                               "was agreed")
        n = payload.header.get("n", dst.size)
        if n != dst.size:
            raise PayloadError(f"{self.codec.name} payload announces {n!r} elements, "
                               f"{dst.size} expected")
        try:
            res = self.codec.decompress(payload, out=dst)
        except PayloadError:
            raise
        except (ValueError, TypeError, IndexError, KeyError, OverflowError) as exc:
            raise PayloadError(f"{self.codec.name} payload does not decode: {exc}") from None
        if res is not dst:
            if not isinstance(res, np.ndarray) or res.shape != (dst.size,):
                raise PayloadError(f"{self.codec.name} payload decodes to "
                                   f"{getattr(res, 'shape', type(res))}, ({dst.size},) expected")
            dst[...] = res

    def _compress(self, x: np.ndarray, seed: tuple[int, ...], n: int) -> np.ndarray:
        if self._reuse:
            self._last = self.codec.compress(x, seed=seed, out=self._last)  # type: ignore
            data = self._last.to_bytes()
        else:
            data = self.codec.compress(x, seed=seed).to_bytes()
        if data.size > self._max(n):
            raise PayloadError(f"{self.codec.name} produced {data.size} bytes for {n} "
                               f"elements, above its declared max_nbytes")
        return data

    # -- the Wire protocol ----------------------------------------------------------------
    def partial_buffer(self, n: int, like: Any, slot: int = 0) -> np.ndarray:
        return np.empty(self.bound(n), np.uint8)

    def encode(self, seg: np.ndarray) -> np.ndarray:
        off, n = self._offset(seg), seg.size
        hop = self._partial_hops
        self._partial_hops += 1
        seed = self.seeds.partial(off, n, hop)
        if self.ef is None:
            data = self._compress(seg, seed, n)
        else:
            e = self._hop_residual(f"{self.key}{HOP_SEP}e{hop}", off, n, seg.dtype)
            np.add(seg, e, out=e)
            data = self._compress(e, seed, n)
            dec = self._scratch_of(0, n)
            self._decode(data, dec)
            np.subtract(e, dec, out=e)
        return self._frame([(0, n, data)], self.bound(n))

    def reduce(self, recv: np.ndarray, seg: np.ndarray, recv_first: bool) -> None:
        off, n = self._offset(seg), seg.size
        self._forget(off, off + n)
        (_, _, data), = self._parts(recv, n, 1)
        dec = self._scratch_of(1, n)
        self._decode(data, dec)
        np.add(dec, seg, out=seg)           # IEEE addition commutes: order-free

    def final(self, seg: np.ndarray) -> np.ndarray:
        off, n = self._offset(seg), seg.size
        size = self.bound(n, self.max_parts)
        pieces = sorted((o, m, p) for o, (m, p) in self._finished.items()
                        if off <= o and o + m <= off + n)
        if sum(m for _, m, _ in pieces) == n:           # finished pieces tile the segment
            parts = [(o - off, m, p) for o, m, p in pieces]
            if len(parts) <= self.max_parts and self._frame_size(parts) <= size:
                return self._frame(parts, size)
        hop = self._final_hops
        self._final_hops += 1
        seed = self.seeds.final(off, n, hop, seg)
        if self.ef is None:
            data = self._compress(seg, seed, n)
            if self.codec.lossy:
                self._decode(data, seg)
        else:
            e = self._hop_residual(f"{self.key}{HOP_SEP}f{hop}", off, n, seg.dtype)
            np.add(seg, e, out=e)
            data = self._compress(e, seed, n)
            self._decode(data, seg)
            np.subtract(e, seg, out=e)
        self._forget(off, off + n)
        self._finished[off] = (n, data)
        return self._frame([(0, n, data)], size)

    def final_buffer(self, n: int, seg: np.ndarray) -> np.ndarray:
        return np.empty(self.bound(n, self.max_parts), np.uint8)

    def place(self, recv: np.ndarray, seg: np.ndarray) -> None:
        off, n = self._offset(seg), seg.size
        parts = self._parts(recv, n, self.max_parts)
        self._forget(off, off + n)
        for o, m, data in parts:
            self._decode(data, seg[o:o + m])
            self._finished[off + o] = (m, data)


# -- routes -------------------------------------------------------------------------------
def _choose(t: Transport, codec: Compressor, n: int, dtype: str, itemsize: int) -> str:
    """``algorithm="auto"`` (see the module docstring's table)."""
    from .auto import select

    c = max_nbytes(codec, n, dtype)
    if codec.reduction != "summable" and t.size * c <= 2 * n * itemsize:
        return "sparse_allgather" if is_sparse(codec) else "allgather"
    return select(t, c)


def segment_codec(codec: Compressor, n: int) -> Compressor:
    """The codec a per-hop wire uses on segments of an ``n``-element buffer: a codec told
    to keep ``k`` elements keeps the same fraction ``k/n`` of every segment instead."""
    k = codec.get_config().get("k")
    if k is None or not n:
        return codec
    return compressors.get(codec.name, ratio=min(1.0, k / n))


def _per_hop(t: Transport, x: np.ndarray, codec: Compressor, name: str, seeds: _Seeds,
             ef: ErrorFeedback | None, key: str) -> None:
    from . import algorithm

    codec = segment_codec(codec, x.size)

    parts = 1 << (t.size.bit_length() - 1) if name == "rabenseifner" else 1
    wire = CompressedWire(codec, x, seeds, max_parts=parts, ef=ef, key=key)
    kwargs: dict[str, Any] = {}
    if name in ("ring", "tree") and x.size:
        ratio = x.size * x.itemsize / max(1, max_nbytes(codec, x.size, x.dtype.name))
        kwargs["chunk_bytes"] = max(x.itemsize, int(CHUNK_BYTES * max(1.0, ratio)))
    algorithm(name)(t, x, Reducer("sum", x.dtype.name), wire=wire, **kwargs)


def _gathered(t: Transport, x: np.ndarray, codec: Compressor, sparse: bool, seeds: _Seeds,
              ef: ErrorFeedback | None, key: str) -> None:
    from .allgather import allgatherv

    n, dtype = x.size, x.dtype.name
    if ef is not None:
        ef.compensate(key, x)
    data = codec.compress(x, seed=seeds.whole()).to_bytes()
    if sparse or ef is not None:
        wire = CompressedWire(codec, x, seeds)
        dec = np.empty_like(x)
        wire._decode(data, dec)
        if ef is not None:
            ef.update(key, x, dec)
    if sparse:
        from .sparse_allgather import allreduce as sparse_allreduce

        idx = np.flatnonzero(dec)
        sparse_allreduce(t, idx, dec[idx], n, out=x)
        return
    bound = max_nbytes(codec, n, dtype)
    blocks = allgatherv(t, data, max_nbytes=bound)
    payloads = []
    for r, b in enumerate(blocks):
        p = Payload.from_bytes(b, max_nbytes=bound)
        if p.codec != codec.name:
            raise PayloadError(f"rank {r} sent a {p.codec!r} payload; {codec.name!r} was agreed")
        payloads.append(p)
    try:
        total = codec.decompress_sum(payloads)
    except PayloadError:
        raise
    except (ValueError, TypeError, IndexError, KeyError, OverflowError) as exc:
        raise PayloadError(f"{codec.name} payloads do not decode: {exc}") from None
    if total.shape != (n,):
        raise PayloadError(f"{codec.name} payloads decode to shape {total.shape}, ({n},) "
                           "expected")
    x[...] = total


def compressed_allreduce(t: Transport, buf: np.ndarray, dtype: str, *, op: str,
                         algorithm: str, compressor: Any, check: bool = True,
                         seed: int | None = None, residuals: ErrorFeedback | None = None,
                         key: str | None = None, **options: Any) -> np.ndarray:
    """Allreduce flat storage ``buf`` of logical ``dtype`` through ``compressor``.

    ``buf`` may be overwritten; the result (flat, storage dtype) is returned. ``residuals``
    (an :class:`ErrorFeedback`) supplies error feedback and the step counter of ``key``;
    without it, steps count the calls on ``t`` and nothing is compensated. ``seed``
    (default 0) seeds the stochastic codecs. Errors in the arguments are raised on every
    rank (after the cross-rank check, when ``check``).
    """
    if (compressor if isinstance(compressor, str) else getattr(compressor, "name", None)) \
            == "powersgd":                      # stateful, two rounds: its own route
        from .powersgd import powersgd_allreduce

        return powersgd_allreduce(t, buf, dtype, op=op, algorithm=algorithm, codec=compressor,
                                  check=check, seed=seed, residuals=residuals, key=key,
                                  **options)
    key = "default" if key is None else key
    problem: Exception | None = None
    codec: Compressor | None = None
    name = compressor if isinstance(compressor, str) else getattr(compressor, "name", "?")
    try:
        codec = compressors.get(compressor, **options)
        name = codec.name
        if op not in OPS:
            if op in ("max", "min", "prod"):
                raise UnsupportedError(f"op={op!r} with a compressor: compressed allreduce "
                                       f"supports {', '.join(OPS)}; use compressor=None")
            raise ConfigError(f"unknown op {op!r}; known: sum, mean, max, min, prod")
        if dtype not in FLOATS:
            raise UnsupportedError(f"compressor {name!r} needs a floating dtype, got {dtype}")
        if algorithm not in COMPRESSED_ALGORITHMS:
            if algorithm == "native":
                raise UnsupportedError(
                    f"algorithm='native' cannot carry {name!r} payloads; with a compressor "
                    f"use one of {', '.join(COMPRESSED_ALGORITHMS)}")
            raise ConfigError(f"unknown algorithm {algorithm!r}; with a compressor use one "
                              f"of {', '.join(COMPRESSED_ALGORITHMS)}")
        seed = 0 if seed is None else seed
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or \
                not 0 <= seed < 2 ** 63:
            raise ConfigError(f"seed must be an integer in 0..2**63-1, got {seed!r}")
        seed = int(seed)
        if not isinstance(key, str):
            raise ConfigError(f"key must be a str, got {type(key).__name__}")
    except (GradcommError, KeyError, TypeError, ValueError) as exc:
        problem = exc
    if residuals is not None:
        step = residuals.step(key)
    else:
        step = _STEPS.get(t, 0)
        _STEPS[t] = step + 1
    if check:
        config = repr(sorted(codec.get_config().items())) if codec is not None else "?"
        try:
            agree(t, "compressed allreduce", count=int(buf.size), dtype=dtype, op=op,
                  algorithm=algorithm, compressor=name, config=config,
                  seed=seed if isinstance(seed, int) else repr(seed), step=step, key=key,
                  error_feedback=residuals is not None and residuals.enabled,
                  valid=problem is None)
        except MismatchError:
            if problem is not None:
                raise problem from None
            raise
    if problem is not None:
        raise problem
    assert codec is not None and isinstance(seed, (int, np.integer))
    out = _run(t, buf, dtype, op, algorithm, codec, int(seed), step, residuals, key)
    if residuals is not None:
        residuals.advance(key)
    return out


def _run(t: Transport, buf: np.ndarray, dtype: str, op: str, algorithm: str,
         codec: Compressor, seed: int, step: int, ef: ErrorFeedback | None, key: str
         ) -> np.ndarray:
    p, n = t.size, buf.size
    if dtype == "bfloat16":
        x = bf16_to_f32(buf)
    elif dtype == "float16":
        x = buf.astype(np.float32)
    else:
        x = buf
    pre_divide = op == "mean" and codec.lossy and p > 1
    if pre_divide:
        np.divide(x, x.dtype.type(p), out=x)
    ef = ef if (ef is not None and ef.enabled and codec.lossy and contractive(codec)) \
        else None
    if p == 1 or n == 0:
        if ef is not None and n:
            ef.compensate(key, x)
            ef.update(key, x, x)
    else:
        seeds = _Seeds(seed, step, key, t.rank, codec.shared_seed)
        name = algorithm
        if name == "auto":
            name = _choose(t, codec, n, x.dtype.name, np.dtype(buf.dtype).itemsize)
        if name in HOP_ALGORITHMS:
            _per_hop(t, x, codec, name, seeds, ef, key)
        else:
            _gathered(t, x, codec, name == "sparse_allgather", seeds, ef, key)
    if op == "mean" and not pre_divide and p > 1:
        np.divide(x, x.dtype.type(p), out=x)
    if dtype == "bfloat16":
        f32_to_bf16(x, buf)
    elif dtype == "float16":
        buf[...] = x
    return buf


__all__ = ["COMPRESSED_ALGORITHMS", "CompressedWire", "GATHER_ALGORITHMS", "HOP_ALGORITHMS",
           "compressed_allreduce", "is_sparse", "max_nbytes", "segment_codec"]
