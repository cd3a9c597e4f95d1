"""An exact single-process reference for every compressed allreduce route.

:func:`replay` takes every rank's input and the call's arguments (codec, seed, step, key,
error-feedback state) and returns what every rank of
:func:`~gradcomm.compressed.compressed_allreduce` must hold, **bitwise**. It
is written from the documented schedules (``ring.py``, ``tree.py``,
``recursive_doubling.py``, ``rabenseifner.py``, ``_segments.py``, ``_fold.py``, the
``compressed.py`` module docstring, ``powersgd.py``) and uses only the codecs' public
``compress`` / ``decompress`` (``add=``, ``decompress_sum``, ``to_sparse``) and the
PowerSGD codec's stateless products: no collective code and no ``CompressedWire``, so a
fault in the collectives (a skipped re-encoding, a forgotten residual, a wrong seed, a
wrong summation order) shows as a difference.

What is modelled:

- 16-bit floats widened to float32 and rounded back; ``mean`` with a lossy codec divides
  by p before compressing (after, for lossless ``none``); p = 1 or n = 0: ``g + e``;
- seeds ``(seed, step, crc32(key))`` + rank (``whole``), + ``(rank, 1, hop, off, n)``
  (partial hops), + ``(2, hop, off, n, fingerprint)`` (finished segments), without rank
  for ``shared_seed`` codecs (+ ``(off, n)`` per hop);
- ``allgather`` (decode and sum in rank order, or the codec's ``decompress_sum``) and
  ``sparse_allgather`` (pairs scatter-added in rank order, or the dense switch with the
  dense algorithm's own summation order);
- per-hop ``ring`` (chunked as the compressed ring chunks; the pipelined ring has the same
  schedule), ``tree``, ``recursive_doubling``, ``rabenseifner`` with the fold for any p:
  decode-add-re-encode at every reduce hop, finished segments encoded once and forwarded
  (Rabenseifner's assembled pieces included), per-hop residuals ``"<key>#e<i>"`` /
  ``"<key>#f<i>"``; ``segment_codec``'s k/n rule for k-keeping codecs;
- PowerSGD's two dense rounds (warm start, residual ``x − P Q_local^T``).

Not modelled (documented limits): a calibrated profile's choices unless ``transport`` is
given, MPI's own ``MPI_Allreduce`` (``native`` on MPI; the threads transport's native
sum, in rank order, is modelled), device buffers (their bytes equal the host's), and the
DDP hook's per-parameter residual store.

Example:
    >>> import numpy as np
    >>> from gradcomm.comm import run_ranks
    >>> from gradcomm.compressed import compressed_allreduce
    >>> xs = [np.random.default_rng(r).standard_normal(10).astype(np.float32)
    ...       for r in range(3)]
    >>> got = run_ranks(3, lambda t: compressed_allreduce(
    ...     t, xs[t.rank].copy(), "float32", op="sum", algorithm="ring", compressor="int8"))
    >>> ref = replay(xs, dtype="float32", op="sum", algorithm="ring", compressor="int8")
    >>> all(g.tobytes() == ref.tobytes() for g in got)
    True
"""

from __future__ import annotations

import math
import zlib
from typing import Any, Sequence

import numpy as np

from .. import compressors
from .._dtypes import bf16_to_f32, f32_to_bf16
from ..compressors.base import Compressor, Payload
from ..error_feedback import HOP_SEP, ErrorFeedback, contractive
from ..errors import ConfigError

#: concrete routes :func:`replay` reproduces
ROUTES = ("allgather", "sparse_allgather", "ring", "tree", "recursive_doubling",
          "rabenseifner")
#: dense algorithms the PowerSGD rounds and the sparse switch may take
DENSE_ROUTES = ("ring", "tree", "recursive_doubling", "rabenseifner", "native", "allgather",
                "sparse_allgather")
#: dense bytes below which the built-in table picks recursive doubling (auto.SMALL)
_SMALL = 64 * 1024


# -- small schedule helpers (as documented in _segments.py, _fold.py, tree.py) ------------
def _bounds(n: int, parts: int) -> list[int]:
    base, extra = divmod(n, parts)
    return [i * base + min(i, extra) for i in range(parts + 1)]


def _chunks(lo: int, hi: int, chunk: int) -> list[tuple[int, int]]:
    m = hi - lo
    if m <= 0:
        return []
    k = -(-m // chunk)
    o = _bounds(m, k)
    return [(lo + o[i], lo + o[i + 1]) for i in range(k)]


def _children(rank: int, size: int) -> list[int]:
    limit = rank & -rank if rank else size
    out, d = [], 1
    while d < limit and rank + d < size:
        out.append(rank + d)
        d <<= 1
    return out


class _Fold:
    def __init__(self, p: int) -> None:
        self.pof2 = 1 << (p.bit_length() - 1)
        self.rem = p - self.pof2

    def real(self, v: int) -> int:
        return v * 2 + 1 if v < self.rem else v + self.rem

    def virtual(self, r: int) -> int:
        if r < 2 * self.rem:
            return -1 if r % 2 == 0 else r // 2
        return r - self.rem


def _table(p: int, nbytes: int) -> str:
    """The built-in dense choice without a profile (``auto.table``, no native)."""
    if nbytes < _SMALL:
        return "recursive_doubling"
    return "rabenseifner" if p > 2 and p & (p - 1) == 0 else "ring"


def _wire(payload: Payload) -> Payload:
    """The payload as a receiver parses it off the wire."""
    return Payload.from_bytes(payload.to_bytes())


# -- dtypes ---------------------------------------------------------------------------------
def _widen(x: np.ndarray, dtype: str) -> np.ndarray:
    """A working copy: float32 for 16-bit floats, else a copy of ``x``."""
    if dtype == "bfloat16":
        return bf16_to_f32(np.ascontiguousarray(x, np.uint16)).copy()
    if dtype == "float16":
        return np.ascontiguousarray(x, np.float16).astype(np.float32)
    return np.array(x, copy=True)


def _narrow(x: np.ndarray, dtype: str) -> np.ndarray:
    """The result in the storage dtype of ``dtype``."""
    if dtype == "bfloat16":
        return f32_to_bf16(x)
    if dtype == "float16":
        with np.errstate(over="ignore", invalid="ignore"):
            h = x.astype(np.float16)
        nan = x != x
        if nan.any():
            bits = h.view(np.uint16)
            bits[nan] = np.where(np.signbit(x[nan]), 0xFE00, 0x7E00).astype(np.uint16)
        return h
    return x


# -- one rank's view of a per-hop compressed schedule ---------------------------------------
class _Rank:
    """What one rank holds during a per-hop replay: its buffer, hop counters, finished
    pieces (offset -> (n, payload)) and its residual store."""

    def __init__(self, r: int, buf: np.ndarray, codec: Compressor, base: tuple[int, ...],
                 ef: ErrorFeedback | None, key: str, max_parts: int) -> None:
        self.r, self.buf, self.codec, self.base = r, buf, codec, base
        self.ef, self.key, self.max_parts = ef, key, max_parts
        self.partial_hops = self.final_hops = 0
        self.finished: dict[int, tuple[int, Payload]] = {}
        self.add = codec.decodes_add

    # seeds
    def _partial_seed(self, off: int, n: int, hop: int) -> tuple[int, ...]:
        if self.codec.shared_seed:
            return (*self.base, off, n)
        return (*self.base, self.r, 1, hop, off, n)

    def _final_seed(self, off: int, n: int, hop: int) -> tuple[int, ...]:
        if self.codec.shared_seed:
            return (*self.base, off, n)
        seg = self.buf[off:off + n]
        fp = zlib.crc32(np.ascontiguousarray(seg[::max(1, n // 64)]).tobytes())
        return (*self.base, 2, hop, off, n, fp)

    def _residual(self, tag: str, hop: int, n: int) -> np.ndarray | None:
        if self.ef is None:
            return None
        return self.ef.residual(f"{self.key}{HOP_SEP}{tag}{hop}", n, self.buf.dtype)

    def _forget(self, lo: int, hi: int) -> None:
        for o in [o for o, (m, _) in self.finished.items() if o < hi and o + m > lo]:
            del self.finished[o]

    def _decode(self, payload: Payload, n: int) -> np.ndarray:
        out = self.codec.decompress(payload, out=np.empty(n, self.buf.dtype))
        return np.asarray(out, self.buf.dtype)

    # the four operations of a hop
    def encode(self, lo: int, hi: int) -> Payload:
        """A partial segment's payload (with its hop residual, if any)."""
        n, hop = hi - lo, self.partial_hops
        self.partial_hops += 1
        seed = self._partial_seed(lo, n, hop)
        e = self._residual("e", hop, n)
        if e is None:
            return _wire(self.codec.compress(self.buf[lo:hi].copy(), seed=seed))
        with np.errstate(invalid="ignore", over="ignore"):
            y = self.buf[lo:hi] + e
            pl = self.codec.compress(y.copy(), seed=seed)
            e[...] = y - self._decode(pl, n)
        return _wire(pl)

    def reduce(self, lo: int, hi: int, pieces: list[tuple[int, int, Payload]]) -> None:
        """``seg += decode(peer's partial)``."""
        assert len(pieces) == 1 and pieces[0][:2] == (lo, hi - lo), pieces
        self._forget(lo, hi)
        seg = self.buf[lo:hi]
        with np.errstate(invalid="ignore", over="ignore"):
            if self.add:
                self.codec.decompress(pieces[0][2], out=seg, add=True)  # type: ignore[call-arg]
            else:
                seg += self._decode(pieces[0][2], hi - lo)

    def final(self, lo: int, hi: int) -> list[tuple[int, int, Payload]]:
        """A finished segment: its finished pieces if they tile it, else encoded once
        (the segment then holds the decoded values)."""
        n = hi - lo
        pieces = sorted((o, m, pl) for o, (m, pl) in self.finished.items()
                        if lo <= o and o + m <= hi)
        if sum(m for _, m, _ in pieces) == n and len(pieces) <= self.max_parts:
            return pieces
        hop = self.final_hops
        self.final_hops += 1
        seed = self._final_seed(lo, n, hop)
        e = self._residual("f", hop, n)
        seg = self.buf[lo:hi]
        with np.errstate(invalid="ignore", over="ignore"):
            y = seg.copy() if e is None else seg + e
            pl = self.codec.compress(y.copy(), seed=seed)
            if self.codec.lossy or e is not None:
                dec = self._decode(pl, n)
                if e is not None:
                    e[...] = y - dec
                seg[...] = dec
        pl = _wire(pl)
        self._forget(lo, hi)
        self.finished[lo] = (n, pl)
        return [(lo, n, pl)]

    def place(self, lo: int, hi: int, pieces: list[tuple[int, int, Payload]]) -> None:
        """``seg = decode(finished pieces)``."""
        assert sum(m for _, m, _ in pieces) == hi - lo
        self._forget(lo, hi)
        for o, m, pl in pieces:
            self.buf[o:o + m] = self._decode(pl, m)
            self.finished[o] = (m, pl)


def _ring(ranks: list[_Rank], n: int, chunk: int) -> None:
    p = len(ranks)
    off = _bounds(n, p)

    def pieces(seg: int) -> list[tuple[int, int]]:
        return _chunks(off[seg], off[seg + 1], chunk)

    msgs = [[ranks[r].encode(lo, hi) for lo, hi in pieces(r)] for r in range(p)]
    finals: list[list[list[tuple[int, int, Payload]]]] = [[] for _ in range(p)]
    for s in range(p - 1):
        new = []
        for r in range(p):
            left, seg, out = (r - 1) % p, (r - s - 1) % p, []
            for (lo, hi), pl in zip(pieces(seg), msgs[left]):
                ranks[r].reduce(lo, hi, [(lo, hi - lo, pl)])
                if s + 1 < p - 1:
                    out.append(ranks[r].encode(lo, hi))
                else:
                    finals[r].append(ranks[r].final(lo, hi))
            new.append(out)
        msgs = new
    for r in range(p):                      # allgather: the owner's bytes, forwarded
        for owner in range(p):
            if owner != r:
                for (lo, hi), fin in zip(pieces((owner + 1) % p), finals[owner]):
                    ranks[r].place(lo, hi, fin)


def _tree(ranks: list[_Rank], n: int, chunk: int) -> None:
    p = len(ranks)
    for lo, hi in _chunks(0, n, chunk):
        up: dict[int, Payload] = {}
        for r in range(p - 1, -1, -1):      # children (higher ranks) first
            for c in _children(r, p):
                ranks[r].reduce(lo, hi, [(lo, hi - lo, up.pop(c))])
            if r:
                up[r] = ranks[r].encode(lo, hi)
        fin = ranks[0].final(lo, hi)
        for r in range(1, p):
            ranks[r].place(lo, hi, fin)


def _fold_in(ranks: list[_Rank], fold: _Fold, n: int) -> None:
    for i in range(fold.rem):
        ranks[2 * i + 1].reduce(0, n, [(0, n, ranks[2 * i].encode(0, n))])


def _hand_back(ranks: list[_Rank], fold: _Fold, n: int,
               outs: dict[int, list[tuple[int, int, Payload]]]) -> None:
    for i in range(fold.rem):
        ranks[2 * i].place(0, n, outs[i])   # virtual rank i is real rank 2i + 1


def _recursive_doubling(ranks: list[_Rank], n: int) -> None:
    fold = _Fold(len(ranks))
    _fold_in(ranks, fold, n)
    vr = [ranks[fold.real(v)] for v in range(fold.pof2)]
    mask = 1
    while mask < fold.pof2:
        outs = [w.final(0, n) for w in vr]
        for v, w in enumerate(vr):
            w.reduce(0, n, outs[v ^ mask])
        mask <<= 1
    _hand_back(ranks, fold, n, {v: w.final(0, n) for v, w in enumerate(vr)})


def _rabenseifner(ranks: list[_Rank], n: int) -> None:
    fold = _Fold(len(ranks))
    pof2 = fold.pof2
    _fold_in(ranks, fold, n)
    vr = [ranks[fold.real(v)] for v in range(pof2)]
    off = _bounds(n, pof2)

    def window(v: int, size: int) -> tuple[int, int]:
        first = v & ~(size - 1)
        return off[first], off[first + size]

    mask = pof2 >> 1
    while mask:                             # recursive halving
        sent = {}
        for v, w in enumerate(vr):
            lo, hi = window(v ^ mask, mask)
            if hi > lo:
                sent[v] = (lo, hi - lo, w.encode(lo, hi))
        for v, w in enumerate(vr):
            lo, hi = window(v, mask)
            if hi > lo:
                w.reduce(lo, hi, [sent[v ^ mask]])
        mask >>= 1
    mask = 1
    while mask < pof2:                      # recursive doubling of finished windows
        outs = {}
        for v, w in enumerate(vr):
            lo, hi = window(v, mask)
            if hi > lo:
                outs[v] = w.final(lo, hi)
        for v, w in enumerate(vr):
            lo, hi = window(v ^ mask, mask)
            if hi > lo:
                w.place(lo, hi, outs[v ^ mask])
        mask <<= 1
    if fold.rem:
        _hand_back(ranks, fold, n, {v: w.final(0, n) for v, w in enumerate(vr)})


def segment_codec(codec: Compressor, n: int) -> Compressor:
    """A codec told to keep ``k`` elements keeps ``k/n`` of every per-hop segment."""
    k = codec.get_config().get("k")
    if k is None or not n:
        return codec
    return compressors.get(codec.name, ratio=min(1.0, k / n))


def _chunk_elements(codec: Compressor, n: int, dt: np.dtype) -> int:
    """Elements per pipelined message of the compressed ring and tree."""
    from ..compressed.routes import CHUNK_BYTES

    itemsize = dt.itemsize
    ratio = n * itemsize / max(1, int(codec.max_nbytes(n, dt.name)))
    chunk_bytes = max(itemsize, int(CHUNK_BYTES * max(1.0, ratio)))
    return max(1, chunk_bytes // itemsize)


def _per_hop(xs: list[np.ndarray], codec: Compressor, name: str, base: tuple[int, ...],
             efs: list[ErrorFeedback | None], key: str) -> np.ndarray:
    p, n = len(xs), xs[0].size
    codec = segment_codec(codec, n)
    parts = 1 << (p.bit_length() - 1) if name == "rabenseifner" else 1
    ranks = [_Rank(r, xs[r], codec, base, efs[r] if codec.lossy else None, key, parts)
             for r in range(p)]
    if name == "ring":
        _ring(ranks, n, _chunk_elements(codec, n, xs[0].dtype))
    elif name == "tree":
        _tree(ranks, n, _chunk_elements(codec, n, xs[0].dtype))
    elif name == "recursive_doubling":
        _recursive_doubling(ranks, n)
    else:
        _rabenseifner(ranks, n)
    out = ranks[0].buf
    for w in ranks[1:]:
        if w.buf.tobytes() != out.tobytes():
            raise AssertionError(f"replay: rank {w.r} ends with other bytes than rank 0")
    return out


# -- dense sums (the sparse switch, PowerSGD's rounds) ---------------------------------------
def dense_sum(bufs: Sequence[np.ndarray], algorithm: str) -> np.ndarray:
    """What a dense ``algorithm`` allreduce (sum) of ``bufs`` leaves on every rank: the
    same additions in the same association as the algorithm's schedule.

    Example:
        >>> b = [np.array([1e8, 1.0], np.float32), np.array([-1e8, 1.0], np.float32),
        ...      np.array([1.0, 1e8], np.float32)]
        >>> dense_sum(b, "ring").tolist(), dense_sum(b, "native").tolist()
        ([1.0, 100000000.0], [1.0, 100000000.0])
    """
    p, n = len(bufs), bufs[0].size
    v = [np.array(b, copy=True) for b in bufs]
    with np.errstate(invalid="ignore", over="ignore"):
        if p == 1 or n == 0:
            return v[0]
        if algorithm in ("native", "allgather", "sparse_allgather"):
            out = v[0]
            for b in v[1:]:
                out += b
            return out
        if algorithm == "ring":
            off, out = _bounds(n, p), np.empty_like(v[0])
            for j in range(p):
                lo, hi = off[j], off[j + 1]
                acc = v[j][lo:hi].copy()
                for i in range(1, p):
                    acc = acc + v[(j + i) % p][lo:hi]
                out[lo:hi] = acc
            return out
        if algorithm == "tree":
            def sub(r: int) -> np.ndarray:
                acc = v[r]
                for c in _children(r, p):
                    acc = acc + sub(c)
                return acc
            return sub(0)
        fold = _Fold(p)
        for i in range(fold.rem):
            v[2 * i + 1] = v[2 * i] + v[2 * i + 1]
        vr = [v[fold.real(k)] for k in range(fold.pof2)]
        if algorithm == "recursive_doubling":
            mask = 1
            while mask < fold.pof2:
                vr = [vr[k] + vr[k ^ mask] for k in range(fold.pof2)]
                mask <<= 1
            return vr[0]
        if algorithm == "rabenseifner":
            off = _bounds(n, fold.pof2)
            mask = fold.pof2 >> 1
            while mask:
                for k in range(fold.pof2):
                    first = k & ~(mask - 1)
                    lo, hi = off[first], off[first + mask]
                    vr[k][lo:hi] = vr[k][lo:hi] + vr[k ^ mask][lo:hi]
                mask >>= 1
            out = np.empty_like(vr[0])
            for k in range(fold.pof2):
                out[off[k]:off[k + 1]] = vr[k][off[k]:off[k + 1]]
            return out
    raise ConfigError(f"dense_sum: unknown algorithm {algorithm!r}; known: "
                      f"{', '.join(DENSE_ROUTES)}")


def _dense_choice(transport: Any, p: int, nbytes: int, dtype: str, native: bool) -> str:
    if transport is None:
        return _table(p, nbytes)
    from ..collectives.auto import select

    return select(transport, nbytes, dtype, "sum", native=native)


# -- gathered routes ---------------------------------------------------------------------------
def _merge(idx: np.ndarray, vals: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    if idx.size < 2 or bool(np.all(idx[1:] > idx[:-1])):
        return idx, vals
    order = np.argsort(idx, kind="stable")
    i, v = idx[order], vals[order]
    starts = np.flatnonzero(np.concatenate([[True], i[1:] != i[:-1]]))
    return i[starts], np.add.reduceat(v, starts)


def _sparse_sum(pairs: list[tuple[np.ndarray, np.ndarray]], n: int, transport: Any
                ) -> np.ndarray:
    """Every rank's (index, value) pairs summed: scatter-added in rank order, or, when
    their union is dense (the SparCML switch), scattered and reduced densely."""
    p = len(pairs)
    pairs = [_merge(np.asarray(i, np.int64), np.asarray(v)) for i, v in pairs]
    dt = pairs[0][1].dtype
    total = sum(int(i.size) for i, _ in pairs)
    ib, vb = (4 if n <= 2 ** 31 else 8), dt.itemsize
    first = _dense_choice(transport, p, n * vb, "float32", False)
    factor = 2 * (p - 1) if first in ("ring", "rabenseifner") else \
        p * (p.bit_length() - 1 + (p & (p - 1) != 0))
    if (p - 1) * total * (ib + vb) > factor * n * vb:
        dense = []
        for i, v in pairs:
            d = np.zeros(n, dt)
            d[i] = v
            dense.append(d)
        native = transport is not None and (transport.size == 1 or transport.native_bounded)
        return dense_sum(dense, _dense_choice(transport, p, n * vb, dt.name, native))
    out = np.zeros(n, dt)
    with np.errstate(invalid="ignore", over="ignore"):
        for i, v in pairs:
            out[i] += v
    return out


def _gathered(xs: list[np.ndarray], codec: Compressor, sparse: bool,
              base: tuple[int, ...], efs: list[ErrorFeedback | None], key: str,
              transport: Any) -> np.ndarray:
    p, n, dt = len(xs), xs[0].size, xs[0].dtype
    payloads = []
    for r, x in enumerate(xs):
        seed = base if codec.shared_seed else (*base, r)
        e = efs[r].residual(key, n, dt) if efs[r] is not None else None
        with np.errstate(invalid="ignore", over="ignore"):
            y = x.copy() if e is None else x + e
            pl = codec.compress(y.copy(), seed=seed)
            if e is not None:
                e[...] = y - np.asarray(codec.decompress(pl, out=np.empty(n, dt)), dt)
        payloads.append(_wire(pl))
    if sparse:
        pairs = []
        for pl in payloads:
            if codec.sparse_pairs:
                _, _, i, v = codec.to_sparse(pl)
            else:
                dec = np.asarray(codec.decompress(pl, out=np.empty(n, dt)), dt)
                i = np.flatnonzero(dec)
                v = dec[i]
            pairs.append((np.array(i), np.array(v)))
        return _sparse_sum(pairs, n, transport)
    out = np.full(n, np.nan, dt)            # what decoding must overwrite
    with np.errstate(invalid="ignore", over="ignore"):
        if type(codec).decompress_sum is not Compressor.decompress_sum:
            return np.asarray(codec.decompress_sum(payloads, out=out), dt)
        out[...] = codec.decompress(payloads[0], out=np.empty(n, dt))
        for pl in payloads[1:]:
            if codec.decodes_add:
                codec.decompress(pl, out=out, add=True)
            else:
                out += np.asarray(codec.decompress(pl, out=np.empty(n, dt)), dt)
    return out


# -- PowerSGD ----------------------------------------------------------------------------------
def _powersgd(xs: list[np.ndarray], dtype: str, op: str, algorithm: str, codec: Any,
              seed: int, step: int, key: str, stores: list[ErrorFeedback | None],
              transport: Any, shape: Any, shapes: Any) -> np.ndarray:
    from ..compressors.powersgd import left, orthonormalize, product, random_factor, right

    p, n = len(xs), xs[0].size
    if shapes is not None:
        named = [(f"{key}{HOP_SEP}{i}", math.prod(s), tuple(s)) for i, s in enumerate(shapes)]
    elif shape is not None:
        named = [(key, math.prod(shape), tuple(shape))]
    else:
        named = [(key, n, None)]
    parts, at = [], 0
    for name, m, d in named:
        parts.append((name, at, m, codec.layout(m, d)))
        at += m
    compress = p > 1 and n > 0 and step >= codec.start_iter
    wdt = np.dtype(np.float64 if dtype == "float64" else np.float32)
    x = [_widen(a, dtype) for a in xs]
    if op == "mean" and p > 1:
        for a in x:
            np.divide(a, a.dtype.type(p), out=a)
    efs = [s if (s is not None and s.enabled) else None for s in stores]
    for a, ef in zip(x, efs):
        if ef is not None and n:
            a += ef.residual(key, n, a.dtype)

    def rounds(bufs: list[np.ndarray]) -> np.ndarray:
        name = algorithm
        if name == "auto":
            native = transport is not None and transport.native_bounded
            name = _dense_choice(transport, p, bufs[0].nbytes, bufs[0].dtype.name, native)
        return dense_sum(bufs, name) if bufs[0].size else bufs[0].copy()

    if not compress:
        for a, ef in zip(x, efs):
            if ef is not None and n:
                e = ef.residual(key, n, a.dtype)
                e[...] = a - a
        res = rounds(x) if p > 1 and n else x[0]
        return _narrow(res, dtype)
    plain = [pt for pt in parts if not pt[3].r]
    low = [pt for pt in parts if pt[3].r]
    qs = []
    for pt in low:                           # every rank's starting Q (they must agree)
        per = []
        for s in stores:
            q = None
            if s is not None and codec.warm_start:
                saved = s.extra(pt[0] + HOP_SEP + "q")
                lay = pt[3]
                if saved is not None and saved.size == lay.r * lay.cols and saved.dtype == wdt:
                    q = saved.reshape(lay.r, lay.cols).copy()
            if q is None:
                q = random_factor(pt[3].r, pt[3].cols, (seed, step, zlib.crc32(pt[0].encode())),
                                  wdt)
            per.append(orthonormalize(q))
        qs.append(per)
    r1 = []
    for r, a in enumerate(x):
        vals = [a[o:o + m] for _, o, m, _ in plain]
        for (_, o, m, lay), per in zip(low, qs):
            pm = np.empty((lay.r, lay.rows), wdt)
            left(a[o:o + m], lay, per[r], pm)
            vals.append(pm.reshape(-1))
        r1.append(np.concatenate(vals) if vals else np.empty(0, wdt))
    s1 = rounds(r1)
    n_plain = sum(m for _, _, m, _ in plain)
    r2, pms = [], []
    at = n_plain
    for _, _, _, lay in low:
        pm = s1[at:at + lay.r * lay.rows].reshape(lay.r, lay.rows).copy()
        orthonormalize(pm)
        pms.append(pm)
        at += lay.r * lay.rows
    for r, a in enumerate(x):
        q2 = []
        for (_, o, m, lay), pm in zip(low, pms):
            qm = np.empty((lay.r, lay.cols), wdt)
            right(a[o:o + m], lay, pm, qm)
            q2.append(qm)
        if efs[r] is not None:
            dec = np.empty(n, wdt)
            for _, o, m, _ in plain:
                dec[o:o + m] = a[o:o + m]
            for (_, o, m, lay), pm, qm in zip(low, pms, q2):
                product(pm, qm, lay, dec[o:o + m])
            e = efs[r].residual(key, n, a.dtype)
            e[...] = a - dec
        r2.append(np.concatenate([q.reshape(-1) for q in q2]) if q2 else np.empty(0, wdt))
    s2 = rounds(r2)
    out = np.empty(n, wdt)
    at = 0
    for _, o, m, _ in plain:
        out[o:o + m] = s1[at:at + m]
        at += m
    at = 0
    for (name, o, m, lay), pm in zip(low, pms):
        qm = s2[at:at + lay.r * lay.cols].reshape(lay.r, lay.cols)
        at += lay.r * lay.cols
        product(pm, qm, lay, out[o:o + m])
        for s in stores:
            if s is not None and codec.warm_start:
                s.set_extra(name + HOP_SEP + "q", qm.reshape(-1).copy())
    return _narrow(out, dtype)


# -- the entry point ---------------------------------------------------------------------------
def replay(inputs: Sequence[np.ndarray], *, dtype: str, op: str = "sum", algorithm: str,
           compressor: Any, seed: int = 0, step: int | None = None, key: str = "default",
           residuals: Sequence[ErrorFeedback] | None = None, transport: Any = None,
           shape: Any = None, shapes: Any = None, **options: Any) -> np.ndarray:
    """What every rank of a compressed allreduce of ``inputs`` (one flat storage array per
    rank, in rank order) must hold afterwards, as a flat array of ``dtype``'s storage.

    ``algorithm``: one of :data:`ROUTES`, or ``"auto"`` with ``transport`` (any rank's
    transport of the group: the route is :func:`~gradcomm.compressed.auto_route`'s).
    ``residuals``: one :class:`~gradcomm.error_feedback.ErrorFeedback` per rank, updated as
    each rank's would be (residuals, hop residuals, PowerSGD's warm starts, the key's step
    advanced); ``step`` defaults to the key's step there (else 0). ``transport`` also makes
    the sparse switch and PowerSGD's ``auto`` rounds follow its agreed profile (default:
    the built-in table). ``shape`` / ``shapes``: PowerSGD's parts. ``**options``: codec
    options.
    """
    p = len(inputs)
    if p < 1:
        raise ConfigError("replay needs at least one rank's input")
    xs = [np.ascontiguousarray(a).reshape(-1) for a in inputs]
    n = xs[0].size
    if any(x.size != n for x in xs):
        raise ConfigError("every rank's input must have the same element count")
    stores: list[ErrorFeedback | None] = list(residuals) if residuals is not None else [None] * p
    if len(stores) != p:
        raise ConfigError(f"{len(stores)} residual stores for {p} ranks")
    if step is None:
        step = stores[0].step(key) if stores[0] is not None else 0
    base = (int(seed), int(step), zlib.crc32(key.encode()))
    codec = compressors.get(compressor, **options)
    if codec.name == "powersgd":
        out = _powersgd(xs, dtype, op, algorithm, codec, int(seed), int(step), key, stores,
                        transport, shape, shapes)
    else:
        out = _replay(xs, dtype, op, algorithm, codec, base, stores, key, transport)
    for s in stores:
        if s is not None:
            s.advance(key)
    return out


def _replay(xs: list[np.ndarray], dtype: str, op: str, algorithm: str, codec: Compressor,
            base: tuple[int, ...], stores: list[ErrorFeedback | None], key: str,
            transport: Any) -> np.ndarray:
    p, n = len(xs), xs[0].size
    efs = [s if (s is not None and s.enabled and codec.lossy and contractive(codec))
           else None for s in stores]
    x = [_widen(a, dtype) for a in xs]
    pre = op == "mean" and codec.lossy and p > 1
    if pre:
        for a in x:
            np.divide(a, a.dtype.type(p), out=a)
    if p == 1 or n == 0:
        a, ef = x[0], efs[0]
        if ef is not None and n:
            with np.errstate(invalid="ignore", over="ignore"):
                a += ef.residual(key, n, a.dtype)
                ef.residual(key, n, a.dtype)[...] = a - a
        return _narrow(a, dtype)
    name = algorithm
    if name == "auto":
        if transport is None:
            raise ConfigError("replay(algorithm='auto') needs transport= (the route is "
                              "gradcomm.compressed.auto_route's)")
        from ..compressed import auto_route

        name = auto_route(transport, codec, n, dtype)
    if name not in ROUTES:
        raise ConfigError(f"replay: unknown route {name!r}; known: {', '.join(ROUTES)}")
    if name in ("allgather", "sparse_allgather"):
        out = _gathered(x, codec, name == "sparse_allgather", base, efs, key, transport)
    else:
        out = _per_hop(x, codec, name, base, efs, key)
    if op == "mean" and not pre:
        np.divide(out, out.dtype.type(p), out=out)
    return _narrow(out, dtype)


__all__ = ["DENSE_ROUTES", "ROUTES", "dense_sum", "replay", "segment_codec"]
