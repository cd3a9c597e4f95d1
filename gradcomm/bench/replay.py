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
DDP hook's per-parameter residual store. Reduce-scatters: :func:`replay_reduce_scatter`
(:mod:`gradcomm.bench._replay_rs`).

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
from ..compressors.base import Compressor
from ..error_feedback import HOP_SEP, ErrorFeedback, contractive
from ..errors import ConfigError
from ._replay_hops import (Fold, bounds, children, narrow, over_wire, per_hop, rank_inputs,
                           segment_codec, table, widen)
from ._replay_rs import RS_ROUTES, replay_reduce_scatter

#: concrete routes :func:`replay` reproduces
ROUTES = ("allgather", "sparse_allgather", "ring", "tree", "recursive_doubling",
          "rabenseifner")
#: dense algorithms the PowerSGD rounds and the sparse switch may take
DENSE_ROUTES = ("ring", "tree", "recursive_doubling", "rabenseifner", "native", "allgather",
                "sparse_allgather")


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
            off, out = bounds(n, p), np.empty_like(v[0])
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
                for c in children(r, p):
                    acc = acc + sub(c)
                return acc
            return sub(0)
        fold = Fold(p)
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
            off = bounds(n, fold.pof2)
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
        return table(p, nbytes)
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
        payloads.append(over_wire(pl))
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
    x = [widen(a, dtype) for a in xs]
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
        return narrow(res, dtype)
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
    return narrow(out, dtype)


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
    xs, n, stores = rank_inputs(inputs, residuals)
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
    x = [widen(a, dtype) for a in xs]
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
        return narrow(a, dtype)
    name = algorithm
    if name == "auto":
        if transport is None:
            raise ConfigError("replay(algorithm='auto') needs transport= (the route is "
                              "gradcomm.compressed.auto_route's)")
        from ..compressed import auto_route

        name = auto_route(transport, codec, n, dtype)
    if name not in ROUTES:
        raise ConfigError(f"replay: unknown route {name!r}; known: {', '.join(ROUTES)}")
    if name not in ("allgather", "sparse_allgather") and not contractive(codec, per_hop=True):
        efs = [None] * p                       # per hop: contractions only
    if name in ("allgather", "sparse_allgather"):
        out = _gathered(x, codec, name == "sparse_allgather", base, efs, key, transport)
    else:
        out = per_hop(x, codec, name, base, efs, key)
    if op == "mean" and not pre:
        np.divide(out, out.dtype.type(p), out=out)
    return narrow(out, dtype)


__all__ = ["DENSE_ROUTES", "ROUTES", "RS_ROUTES", "dense_sum", "replay",
           "replay_reduce_scatter", "segment_codec"]
