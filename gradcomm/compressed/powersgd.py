"""PowerSGD's route (Vogels et al., NeurIPS 2019): two rounds of summable low-rank factors.

The front door (:func:`~gradcomm.compressed.compressed_allreduce`) validates the call and
runs the cross-rank check; this module cuts the buffer into parts, draws the starting
``Q`` of each and runs the two rounds.

For a buffer cut into *parts* (each a matrix ``M``, ``rows`` x ``cols``, see
:mod:`gradcomm.compressors.powersgd` for the shapes and for which parts are compressed):

1. ``x ← g + e`` (error feedback, when a residual store is given and enabled); for
   ``op="mean"`` the inputs are divided by ``p`` first (no overflow, as for every codec).
2. Each compressed part starts from ``Q`` (``cols`` x ``r``): the previous step's ``Q``
   of that part (warm start, kept in the residual store), else a standard normal draw
   seeded by ``(seed, step, crc32(part name))`` (the same on every rank); orthonormalised.
3. **Round 1**: one dense allreduce (sum) of ``[uncompressed parts' values | P of every
   compressed part]`` with ``P = M Q`` (``r·rows`` values per part).
4. ``P`` is orthonormalised (Gram-Schmidt; identical bytes in, identical bytes out) and
   ``Q = M^T P`` is formed locally. Error feedback keeps ``e ← x − P Q_local^T``, the part
   of this rank's matrix outside the shared subspace (a projection, hence a contraction:
   ``Σ_r e_r = Σ_r x_r − output`` up to rounding; PyTorch's hook keeps ``x_r − output``
   instead, the same sum). Uncompressed parts leave no residual.
5. **Round 2**: one dense allreduce (sum) of every part's ``Q`` (``r·cols`` values each).
6. Output ``P Q^T`` per compressed part, the summed values elsewhere; ``Q`` is stored as the
   next warm start.

Wire: ``r·(rows + cols)`` values (float32; float64 for float64 buffers) per compressed part
in two allreduce rounds, instead of ``rows·cols``, plus the uncompressed parts in round 1,
plus the one small cross-rank check. Any dense algorithm carries the rounds: ``ring``,
``tree``, ``recursive_doubling``, ``rabenseifner``, ``native``; ``allgather`` (and
``sparse_allgather``: the factors are dense) gather every rank's factors and add them in
rank order; ``auto`` picks the dense table's choice for each round's size.

**Parts** of a flat buffer, in order of precedence: ``shapes=`` (shapes of the tensors
concatenated in the buffer; part ``i`` is named ``"<key>#<i>"``), ``shape=`` (one tensor,
named ``key``), a residual store that knows the key's parameters (the DDP hook's:
``residuals.parts(key)`` gives their names, sizes and shapes; parts are named after the
parameters, so warm starts survive bucket rebuilds), else the whole
buffer as one flat part named ``key``. A part without a shape takes the near-square flat
layout.

**State** (warm-start ``Q`` per part as ``"<part>#q"``, residuals, step counters) lives
in the :class:`~gradcomm.error_feedback.ResidualStore` passed as ``residuals`` (an
:class:`~gradcomm.error_feedback.ErrorFeedback`, or the DDP hook's), so
``state_dict``/``load_state_dict`` resume bitwise. Without one (``gradcomm.allreduce``)
every call is a single power iteration from a fresh seeded ``Q``, without error feedback.

As for every codec: with ``p = 1`` or an empty buffer nothing is compressed (the result is
``g + e`` and the residual drops to zero); before the codec's ``start_iter`` (counted in
steps of the key) the buffer is summed uncompressed. The cross-rank check (every call
with ``check``) covers count, dtype, op, algorithm, codec and options, seed, step, key,
error feedback, the parts' layout and the bytes of every starting ``Q``.

Example:
    >>> import numpy as np
    >>> from gradcomm.comm import run_ranks
    >>> from gradcomm.compressed import compressed_allreduce
    >>> from gradcomm.error_feedback import ErrorFeedback
    >>> u, v = np.arange(1.0, 21.0), np.linspace(-1.0, 1.0, 30)
    >>> def fn(t):                                  # every rank: a multiple of u v^T
    ...     ef = ErrorFeedback()
    ...     m = (t.rank + 1.0) * np.outer(u, v)
    ...     y = compressed_allreduce(t, m.reshape(-1), "float64", op="sum", algorithm="ring",
    ...                              compressor="powersgd", residuals=ef, key="w",
    ...                              shape=m.shape)
    ...     return np.allclose(y, 6.0 * np.outer(u, v).reshape(-1)), ef.extra("w#q").size
    >>> run_ranks(3, fn)
    [(True, 30), (True, 30), (True, 30)]
"""

from __future__ import annotations

import math
import zlib
from typing import Any, NamedTuple, Sequence

import numpy as np

from .._dtypes import bf16_to_f32, f32_to_bf16
from ..collectives import dense_allreduce
from ..comm.base import Transport
from ..compressors.powersgd import (Layout, PowerSGD, left, orthonormalize, product,
                                    random_factor, right)
from ..error_feedback import HOP_SEP, ResidualStore
from ..errors import ConfigError
from .state import Scratch, session

#: suffix of a part's warm-start Q in the residual store
Q_SUFFIX = HOP_SEP + "q"


class Part(NamedTuple):
    """One matrix of the buffer: its name (warm start, seeds), offset, size and layout."""

    name: str
    offset: int
    n: int
    lay: Layout


def _shape(value: Any) -> tuple[int, ...]:
    try:
        dims = tuple(value)
    except TypeError:
        raise ConfigError(f"a shape must be a sequence of ints, got {value!r}") from None
    if not all(isinstance(d, (int, np.integer)) and not isinstance(d, bool) and d >= 0
               for d in dims):
        raise ConfigError(f"a shape must be a sequence of ints >= 0, got {value!r}")
    return tuple(int(d) for d in dims)


def parts_of(n: int, key: str, codec: PowerSGD, residuals: ResidualStore | None = None,
             shape: Any = None, shapes: Any = None) -> list[Part]:
    """How a flat buffer of ``n`` elements is cut into parts (see the module docstring).

    Example:
        >>> c = PowerSGD(rank=2)
        >>> [(p.name, p.n, p.lay.r) for p in parts_of(1010, "b", c, shapes=[(100, 10), (10,)])]
        [('b#0', 1000, 2), ('b#1', 10, 0)]
    """
    if shape is not None and shapes is not None:
        raise ConfigError("give shape= or shapes=, not both")
    named: list[tuple[str, int, tuple[int, ...] | None]]
    if shapes is not None:
        if isinstance(shapes, (str, bytes)) or not hasattr(shapes, "__iter__"):
            raise ConfigError(f"shapes must be a sequence of shapes, got {shapes!r}")
        dims = [_shape(s) for s in shapes]
        named = [(f"{key}{HOP_SEP}{i}", math.prod(d), d) for i, d in enumerate(dims)]
    elif shape is not None:
        d = _shape(shape)
        named = [(key, math.prod(d), d)]
    else:
        entry = residuals.parts(key) if residuals is not None else None
        if entry is not None and sum(length for _, length, _ in entry) == n:
            named = []
            for name, length, d in entry:
                d = _shape(d) if d is not None and math.prod(_shape(d)) == length else None
                named.append((str(name), int(length), d))
        else:
            named = [(key, n, None)]
    total = sum(m for _, m, _ in named)
    if total != n:
        raise ConfigError(f"the shapes given hold {total} elements, the buffer {n}")
    parts, off = [], 0
    for name, m, d in named:
        parts.append(Part(name, off, m, codec.layout(m, d)))
        off += m
    return parts


def _start_q(part: Part, codec: PowerSGD, store: Any, seed: int, step: int,
             dtype: np.dtype) -> np.ndarray:
    """The orthonormalised ``Q^T`` (``r`` x ``cols``) a part starts from."""
    lay = part.lay
    q = None
    if store is not None and codec.warm_start:
        saved = store.extra(part.name + Q_SUFFIX)
        if saved is not None and saved.size == lay.r * lay.cols and saved.dtype == dtype:
            q = saved.reshape(lay.r, lay.cols).copy()
    if q is None:
        q = random_factor(lay.r, lay.cols, (seed, step, zlib.crc32(part.name.encode())), dtype)
    return orthonormalize(q)


def _sum(t: Transport, buf: np.ndarray, algorithm: str) -> None:
    """Sum flat float ``buf`` across the ranks in place (identical bytes everywhere)."""
    if buf.size == 0:
        return
    if algorithm in ("allgather", "sparse_allgather"):
        from ..collectives.allgather import allgatherv

        blocks = allgatherv(t, buf.view(np.uint8), sizes=np.full(t.size, buf.nbytes, np.int64))
        np.copyto(buf, blocks[0].view(buf.dtype))
        for b in blocks[1:]:                   # rank order on every rank
            buf += b.view(buf.dtype)
        return
    dense_allreduce(t, buf, "sum", buf.dtype.name, algorithm, check=False)


def start(codec: PowerSGD, parts: list[Part], store: Any, seed: int, step: int, p: int,
          n: int, dtype: str) -> tuple[bool, list[np.ndarray]]:
    """Whether this call compresses (p > 1, a non-empty buffer, ``step`` at or past the
    codec's ``start_iter``) and, if so, every compressed part's starting ``Q^T``."""
    compress = p > 1 and n > 0 and step >= codec.start_iter
    wdt = np.dtype(np.float64 if dtype == "float64" else np.float32)
    qs: list[np.ndarray] = []
    if compress:
        qs = [_start_q(part, codec, store, seed, step, wdt) for part in parts if part.lay.r]
    return compress, qs


def check_config(codec: PowerSGD, parts: list[Part], qs: list[np.ndarray]) -> str:
    """What the cross-rank check compares of a PowerSGD call beyond the common fields:
    the codec's options, the parts' layout and the bytes of every starting ``Q``."""
    crc = 0
    for q in qs:
        crc = zlib.crc32(q.tobytes(), crc)
    layout = zlib.crc32(repr(parts).encode())
    return f"{sorted(codec.get_config().items())!r} parts={layout} q={crc}"


def run(t: Transport, buf: np.ndarray, dtype: str, op: str, algorithm: str, codec: PowerSGD,
        parts: list[Part], qs: list[np.ndarray], store: Any, key: str, compress: bool
        ) -> np.ndarray:
    """Allreduce flat host storage ``buf`` (logical ``dtype``) by PowerSGD over the dense
    ``algorithm``, with :func:`start`'s ``compress`` and ``qs``; returns ``buf``."""
    p, n = t.size, buf.size
    if dtype == "bfloat16":
        x = bf16_to_f32(buf)
    elif dtype == "float16":
        x = buf.astype(np.float32)
    else:
        x = buf
    if op == "mean" and p > 1:
        np.divide(x, x.dtype.type(p), out=x)           # before compressing: no overflow
    ef = store if (store is not None and store.enabled) else None
    if ef is not None and n:
        ef.compensate(key, x)
    if not compress:
        if ef is not None and n:
            ef.update(key, x, x)                       # sent whole: nothing left over
        if p > 1 and n:
            _sum(t, x, algorithm)
    else:
        with session(t) as scratch:
            _power_step(t, x, algorithm, codec, parts, qs, store, ef, key, scratch)
    if dtype == "bfloat16":
        f32_to_bf16(x, buf)
    elif dtype == "float16":
        buf[...] = x
    return buf


def _power_step(t: Transport, x: np.ndarray, algorithm: str, codec: PowerSGD,
                parts: list[Part], qs: list[np.ndarray], store: Any, ef: Any, key: str,
                scratch: Scratch) -> None:
    """Steps 3-6 of the module docstring on compensated flat ``x`` (in place)."""
    plain = [pt for pt in parts if not pt.lay.r]
    low = [pt for pt in parts if pt.lay.r]
    n_plain = sum(pt.n for pt in plain)
    round1 = np.empty(n_plain + sum(pt.lay.r * pt.lay.rows for pt in low), x.dtype)
    round2 = np.empty(sum(pt.lay.r * pt.lay.cols for pt in low), x.dtype)
    at = 0
    for pt in plain:
        round1[at:at + pt.n] = x[pt.offset:pt.offset + pt.n]
        at += pt.n
    ps, qts = [], []
    a1, a2 = n_plain, 0
    for pt, q in zip(low, qs):
        r, lay = pt.lay.r, pt.lay
        ps.append(round1[a1:a1 + r * lay.rows].reshape(r, lay.rows))
        qts.append(round2[a2:a2 + r * lay.cols].reshape(r, lay.cols))
        left(x[pt.offset:pt.offset + pt.n], lay, q, ps[-1])
        a1 += r * lay.rows
        a2 += r * lay.cols
    _sum(t, round1, algorithm)                          # round 1: plain values and every P
    for pt, pm, qm in zip(low, ps, qts):
        orthonormalize(pm)
        right(x[pt.offset:pt.offset + pt.n], pt.lay, pm, qm)
    if ef is not None:                                  # what this rank's own factors carry
        dec = scratch.floats(4, x.size, x.dtype)
        for pt in plain:
            dec[pt.offset:pt.offset + pt.n] = x[pt.offset:pt.offset + pt.n]
        for pt, pm, qm in zip(low, ps, qts):
            product(pm, qm, pt.lay, dec[pt.offset:pt.offset + pt.n])
        ef.update(key, x, dec)
    _sum(t, round2, algorithm)                          # round 2: every Q
    at = 0
    for pt in plain:
        x[pt.offset:pt.offset + pt.n] = round1[at:at + pt.n]
        at += pt.n
    for pt, pm, qm in zip(low, ps, qts):
        product(pm, qm, pt.lay, x[pt.offset:pt.offset + pt.n])
        if store is not None and codec.warm_start:
            store.set_extra(pt.name + Q_SUFFIX, qm.reshape(-1).copy())


def wire_values(parts: Sequence[Part]) -> tuple[int, int]:
    """Values summed in round 1 and round 2 for ``parts`` (when compressing).

    Example:
        >>> wire_values(parts_of(1000, "w", PowerSGD(rank=2), shape=(40, 25)))
        (80, 50)
    """
    low = [pt for pt in parts if pt.lay.r]
    return (sum(pt.n for pt in parts if not pt.lay.r)
            + sum(pt.lay.r * pt.lay.rows for pt in low),
            sum(pt.lay.r * pt.lay.cols for pt in low))


__all__ = ["Part", "Q_SUFFIX", "check_config", "parts_of", "run", "start", "wire_values"]
