"""The per-hop schedules of :mod:`gradcomm.bench.replay`: one rank's view of a compressed
ring, tree, recursive doubling and Rabenseifner, with the fold for any p.

Written from the documented schedules (``ring.py``, ``tree.py``, ``recursive_doubling.py``,
``rabenseifner.py``, ``_segments.py``, ``_fold.py``) with the codecs' public API only; see
:mod:`gradcomm.bench.replay` for what is modelled.

Example:
    >>> bounds(10, 3)
    [0, 4, 7, 10]
    >>> chunks(0, 10, 4)
    [(0, 4), (4, 7), (7, 10)]
"""

from __future__ import annotations

import zlib
from typing import Any, Sequence

import numpy as np

from .. import compressors
from .._dtypes import bf16_to_f32, f32_to_bf16
from ..compressors.base import Compressor, Payload
from ..error_feedback import HOP_SEP, ErrorFeedback
from ..errors import ConfigError

#: dense bytes below which the built-in table picks recursive doubling (auto.SMALL)
_SMALL = 64 * 1024


# -- small schedule helpers (as documented in _segments.py, _fold.py, tree.py) ------------
def bounds(n: int, parts: int) -> list[int]:
    base, extra = divmod(n, parts)
    return [i * base + min(i, extra) for i in range(parts + 1)]


def chunks(lo: int, hi: int, chunk: int) -> list[tuple[int, int]]:
    m = hi - lo
    if m <= 0:
        return []
    k = -(-m // chunk)
    o = bounds(m, k)
    return [(lo + o[i], lo + o[i + 1]) for i in range(k)]


def rank_inputs(inputs: Sequence[Any], residuals: Sequence[ErrorFeedback] | None
                ) -> tuple[list[np.ndarray], int, list[ErrorFeedback | None]]:
    """Every rank's flat input, their common count and each rank's residual store (or
    None), checked as the replays need them."""
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
    return xs, n, stores


def children(rank: int, size: int) -> list[int]:
    limit = rank & -rank if rank else size
    out, d = [], 1
    while d < limit and rank + d < size:
        out.append(rank + d)
        d <<= 1
    return out


class Fold:
    def __init__(self, p: int) -> None:
        self.pof2 = 1 << (p.bit_length() - 1)
        self.rem = p - self.pof2

    def real(self, v: int) -> int:
        return v * 2 + 1 if v < self.rem else v + self.rem

    def virtual(self, r: int) -> int:
        if r < 2 * self.rem:
            return -1 if r % 2 == 0 else r // 2
        return r - self.rem


def table(p: int, nbytes: int) -> str:
    """The built-in dense choice without a profile (``auto.table``, no native)."""
    if nbytes < _SMALL:
        return "recursive_doubling"
    return "rabenseifner" if p > 2 and p & (p - 1) == 0 else "ring"


def over_wire(payload: Payload) -> Payload:
    """The payload as a receiver parses it off the wire."""
    return Payload.from_bytes(payload.to_bytes())


# -- dtypes ---------------------------------------------------------------------------------
def widen(x: np.ndarray, dtype: str) -> np.ndarray:
    """A working copy: float32 for 16-bit floats, else a copy of ``x``."""
    if dtype == "bfloat16":
        return bf16_to_f32(np.ascontiguousarray(x, np.uint16)).copy()
    if dtype == "float16":
        return np.ascontiguousarray(x, np.float16).astype(np.float32)
    return np.array(x, copy=True)


def narrow(x: np.ndarray, dtype: str) -> np.ndarray:
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
            return over_wire(self.codec.compress(self.buf[lo:hi].copy(), seed=seed))
        with np.errstate(invalid="ignore", over="ignore"):
            y = self.buf[lo:hi] + e
            pl = self.codec.compress(y.copy(), seed=seed)
            e[...] = y - self._decode(pl, n)
        return over_wire(pl)

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
        pl = over_wire(pl)
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
    off = bounds(n, p)

    def pieces(seg: int) -> list[tuple[int, int]]:
        return chunks(off[seg], off[seg + 1], chunk)

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
    for lo, hi in chunks(0, n, chunk):
        up: dict[int, Payload] = {}
        for r in range(p - 1, -1, -1):      # children (higher ranks) first
            for c in children(r, p):
                ranks[r].reduce(lo, hi, [(lo, hi - lo, up.pop(c))])
            if r:
                up[r] = ranks[r].encode(lo, hi)
        fin = ranks[0].final(lo, hi)
        for r in range(1, p):
            ranks[r].place(lo, hi, fin)


def _fold_in(ranks: list[_Rank], fold: Fold, n: int) -> None:
    for i in range(fold.rem):
        ranks[2 * i + 1].reduce(0, n, [(0, n, ranks[2 * i].encode(0, n))])


def _hand_back(ranks: list[_Rank], fold: Fold, n: int,
               outs: dict[int, list[tuple[int, int, Payload]]]) -> None:
    for i in range(fold.rem):
        ranks[2 * i].place(0, n, outs[i])   # virtual rank i is real rank 2i + 1


def _recursive_doubling(ranks: list[_Rank], n: int) -> None:
    fold = Fold(len(ranks))
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
    fold = Fold(len(ranks))
    pof2 = fold.pof2
    _fold_in(ranks, fold, n)
    vr = [ranks[fold.real(v)] for v in range(pof2)]
    off = bounds(n, pof2)

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


def chunk_elements(codec: Compressor, n: int, dt: np.dtype) -> int:
    """Elements per pipelined message of the compressed ring and tree (and of both
    compressed reduce-scatter routes)."""
    from ..compressed.routes import span_bytes

    return max(1, span_bytes(codec, n, dt.name) // dt.itemsize)


def per_hop(xs: list[np.ndarray], codec: Compressor, name: str, base: tuple[int, ...],
             efs: list[ErrorFeedback | None], key: str) -> np.ndarray:
    p, n = len(xs), xs[0].size
    codec = segment_codec(codec, n)
    parts = 1 << (p.bit_length() - 1) if name == "rabenseifner" else 1
    ranks = [_Rank(r, xs[r], codec, base, efs[r] if codec.lossy else None, key, parts)
             for r in range(p)]
    if name == "ring":
        _ring(ranks, n, chunk_elements(codec, n, xs[0].dtype))
    elif name == "tree":
        _tree(ranks, n, chunk_elements(codec, n, xs[0].dtype))
    elif name == "recursive_doubling":
        _recursive_doubling(ranks, n)
    else:
        _rabenseifner(ranks, n)
    out = ranks[0].buf
    for w in ranks[1:]:
        if w.buf.tobytes() != out.tobytes():
            raise AssertionError(f"replay: rank {w.r} ends with other bytes than rank 0")
    return out
