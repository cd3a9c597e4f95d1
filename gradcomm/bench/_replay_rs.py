"""The exact reference for compressed reduce-scatters (:mod:`gradcomm.compressed.reduce_scatter`).

:func:`replay_reduce_scatter` takes every rank's input and returns every rank's shard,
**bitwise**, written from the documented schedules (the module docstrings of
``compressed/reduce_scatter.py``, ``compressed/reduce_scatter_alltoall.py`` and
``collectives/reduce_scatter.py``) with the codecs' public ``compress`` / ``decompress``
only: no collective, frame or wire code. Modelled: 16-bit widening and rounding back,
``mean`` divided before compressing (lossy) or after (``none``), segments of
``bounds(n, p)``, the own segment's residual folded in exactly and zeroed, per-chunk
seeds, the all-to-all's chunks (the ring's) each summed in rank order with the own values
exact, the ring's decode-add-re-encode per hop with its chunking and hop-numbered seeds, one flat residual
per rank under ``key``, k-keeping codecs keeping k/n of every segment.

Example:
    >>> import numpy as np
    >>> from gradcomm.comm import run_ranks
    >>> from gradcomm.compressed.reduce_scatter import compressed_reduce_scatter
    >>> xs = [np.random.default_rng(r).standard_normal(10).astype(np.float32)
    ...       for r in range(3)]
    >>> got = run_ranks(3, lambda t: compressed_reduce_scatter(
    ...     t, xs[t.rank].copy(), "float32", op="sum", algorithm="alltoall",
    ...     compressor="int8"))
    >>> ref = replay_reduce_scatter(xs, dtype="float32", algorithm="alltoall",
    ...                             compressor="int8")
    >>> [g.tobytes() == s.tobytes() for g, s in zip(got, ref)]
    [True, True, True]
"""

from __future__ import annotations

import zlib
from typing import Any, Sequence

import numpy as np

from .. import compressors
from ..compressors.base import Compressor, Payload
from ..error_feedback import ErrorFeedback, contractive
from ..errors import ConfigError
from ._replay_hops import (bounds, chunk_elements, chunks, narrow, over_wire, rank_inputs,
                           segment_codec, widen)

#: routes :func:`replay_reduce_scatter` reproduces
RS_ROUTES = ("alltoall", "ring")


class _Sender:
    """One rank: its working buffer, residual, hop counter and seeds."""

    def __init__(self, r: int, x: np.ndarray, e: np.ndarray | None, codec: Compressor,
                 base: tuple[int, ...]) -> None:
        self.r, self.x, self.e, self.codec, self.base = r, x, e, codec, base
        self.hops = 0

    def decode(self, pl: Payload, m: int) -> np.ndarray:
        return np.asarray(self.codec.decompress(pl, out=np.empty(m, self.x.dtype)),
                          self.x.dtype).copy()

    def encode(self, lo: int, hi: int, hop: int) -> Payload:
        m = hi - lo
        seed = (*self.base, lo, m) if self.codec.shared_seed else \
            (*self.base, self.r, 1, hop, lo, m)
        with np.errstate(invalid="ignore", over="ignore"):
            y = self.x[lo:hi].copy() if self.e is None else self.x[lo:hi] + self.e[lo:hi]
            pl = self.codec.compress(y.copy(), seed=seed)
            if self.e is not None:
                self.e[lo:hi] = y - self.decode(pl, m)
        return over_wire(pl)

    def add(self, lo: int, hi: int, pl: Payload) -> None:
        seg = self.x[lo:hi]
        with np.errstate(invalid="ignore", over="ignore"):
            if self.codec.decodes_add:
                self.codec.decompress(pl, out=seg, add=True)  # type: ignore[call-arg]
            else:
                seg += self.decode(pl, hi - lo)


def _alltoall(ranks: list[_Sender], off: list[int], chunk: int) -> list[np.ndarray]:
    p = len(ranks)
    pieces = [chunks(off[d], off[d + 1], chunk) for d in range(p)]
    sent = {(q, lo): ranks[q].encode(lo, hi, 0)
            for q in range(p) for d in range(p) if d != q for lo, hi in pieces[d]}
    shards = []
    for d in range(p):
        shard = np.empty(off[d + 1] - off[d], ranks[d].x.dtype)
        for lo, hi in pieces[d]:              # each chunk summed in rank order
            own = ranks[d].x[lo:hi].copy()
            out = None
            for q in range(p):
                if q == d:
                    if out is None:
                        out = own.copy()
                    else:
                        with np.errstate(invalid="ignore", over="ignore"):
                            out += own
                elif out is None:
                    out = ranks[d].decode(sent[q, lo], hi - lo)
                else:
                    w = _Sender(d, out, None, ranks[d].codec, ranks[d].base)
                    w.add(0, hi - lo, sent[q, lo])
            assert out is not None
            shard[lo - off[d]:hi - off[d]] = out
        shards.append(shard)
    return shards


def _ring(ranks: list[_Sender], off: list[int], chunk: int) -> list[np.ndarray]:
    p = len(ranks)

    def pieces(seg: int) -> list[tuple[int, int]]:
        return chunks(off[seg], off[seg + 1], chunk)

    def encode(w: _Sender, lo: int, hi: int) -> Payload:
        w.hops += 1
        return w.encode(lo, hi, w.hops - 1)

    msgs = [[encode(w, lo, hi) for lo, hi in pieces((w.r - 1) % p)] for w in ranks]
    for s in range(p - 1):
        new = []
        for w in ranks:                     # rank r folds segment r-s-2 from rank r-1
            out = []
            for (lo, hi), pl in zip(pieces((w.r - s - 2) % p), msgs[(w.r - 1) % p]):
                w.add(lo, hi, pl)
                if s < p - 2:
                    out.append(encode(w, lo, hi))
            new.append(out)
        msgs = new
    return [w.x[off[w.r]:off[w.r + 1]].copy() for w in ranks]


def replay_reduce_scatter(inputs: Sequence[np.ndarray], *, dtype: str, op: str = "sum",
                          algorithm: str, compressor: Any, seed: int = 0,
                          step: int | None = None, key: str = "default",
                          residuals: Sequence[ErrorFeedback] | None = None,
                          **options: Any) -> list[np.ndarray]:
    """Every rank's shard (storage dtype, in rank order) of a compressed reduce-scatter of
    ``inputs`` (one flat storage array per rank). ``algorithm``: ``"alltoall"``, ``"ring"``
    or ``"auto"`` (alltoall). ``residuals``: one ErrorFeedback per rank, updated as each
    rank's would be (the key's flat residual, its step advanced); ``step`` defaults to the
    key's step there (else 0)."""
    xs, n, stores = rank_inputs(inputs, residuals)
    p = len(xs)
    route = "alltoall" if algorithm == "auto" else algorithm
    if route not in RS_ROUTES:
        raise ConfigError(f"replay: unknown reduce-scatter route {algorithm!r}")
    if step is None:
        step = stores[0].step(key) if stores[0] is not None else 0
    codec = compressors.get(compressor, **options)
    base = (int(seed), int(step), zlib.crc32(key.encode()))
    hops = p > 1 and route != "alltoall"
    efs = [s if (s is not None and s.enabled and codec.lossy
                 and contractive(codec, per_hop=hops)) else None for s in stores]
    codec = segment_codec(codec, n)
    x = [widen(a, dtype) for a in xs]
    pre = op == "mean" and codec.lossy and p > 1
    off = bounds(n, p)
    ranks = []
    for r, a in enumerate(x):
        if pre:
            np.divide(a, a.dtype.type(p), out=a)
        e = efs[r].residual(key, n, a.dtype) if efs[r] is not None and n else None
        if e is not None:
            with np.errstate(invalid="ignore", over="ignore"):
                a[off[r]:off[r + 1]] += e[off[r]:off[r + 1]]
            e[off[r]:off[r + 1]] = 0
        ranks.append(_Sender(r, a, e, codec, base))
    if p == 1 or n == 0:
        shards = [w.x[off[w.r]:off[w.r + 1]].copy() for w in ranks]
    elif route == "alltoall":
        shards = _alltoall(ranks, off, chunk_elements(codec, n, x[0].dtype))
    else:
        shards = _ring(ranks, off, chunk_elements(codec, n, x[0].dtype))
    if op == "mean" and not pre:
        for s in shards:
            np.divide(s, s.dtype.type(p), out=s)
    for st in stores:
        if st is not None:
            st.advance(key)
    return [narrow(s, dtype) for s in shards]


__all__ = ["RS_ROUTES", "replay_reduce_scatter"]
