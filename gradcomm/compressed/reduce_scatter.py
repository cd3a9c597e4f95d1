"""Reduce-scatter, dense or through any codec: ``gradcomm.reduce_scatter``.

Rank r receives segment r of the flat input, reduced over all ranks. Segments differ by at
most one element and the first ``n % p`` get one more
(:func:`~gradcomm.collectives.reduce_scatter.shard_bounds`); when p divides n (FSDP2's
padded flat gradients always do) rank r's shard is ``[r·n/p, (r+1)·n/p)``.

Compressed routes (ops ``sum`` and ``mean``, floating dtypes; 16-bit floats are widened to
float32 for the codec and the shard rounded back; ``mean`` with a lossy codec divides by
p *before* compressing):

- ``alltoall`` (:mod:`.reduce_scatter_alltoall`, the qgZ shape): each rank encodes each
  destination's segment once, chunk by chunk, the chunks of all destinations are
  exchanged together, and each rank decodes and sums its segment in rank order (its own
  values exact) as its chunks arrive. Any codec.
- ``ring`` (:mod:`gradcomm.collectives.reduce_scatter` on a
  :class:`~gradcomm.compressed.wire.CompressedWire`): p-1 steps, each partial sum decoded,
  added and re-encoded at every hop. Any codec; one more compression error per hop.
- ``auto`` (:func:`auto_route`): ``alltoall`` on any p. On 2 ranks both routes are one
  exchange of the same chunked frames (the same bytes for deterministic codecs; qsgd and
  terngrad draw other seeds); the all-to-all measured faster over 1 Gbit/s
  (bench/train.py --fsdp, bench/RESULTS.md's FSDP2 section). On more it sends the same
  bytes as the ring with p-1 messages in flight at once instead of p-1 steps in a row,
  and no re-compression error.

Per rank, for n elements, p ranks, ``F(m)`` the frame bound of an m-element segment
(:meth:`~gradcomm.compressed.frames.Frames.bound`) and m_d the elements of segment d:

===========  ======================  ==================================  ==========
route        messages sent           bytes sent                          encoded
===========  ======================  ==================================  ==========
alltoall     Σ_{d≠r} chunks(m_d)     Σ_{d≠r} Σ_chunks F(chunk)            n − m_r
ring         Σ_{d≠r} chunks(m_d)     Σ_{d≠r} Σ_chunks F(chunk)            n − m_r
===========  ======================  ==================================  ==========

Both routes cut segments into the same chunks (:func:`ring_chunk`, about 2 MiB of
payload spanning at most 8 MiB of the buffer:
:func:`~gradcomm.compressed.routes.span_bytes`), so a large segment streams in several
messages on either.

(:func:`wire_bytes` computes the bytes column exactly; the transport's counters must
agree.) With error feedback the residual is one flat array over the *whole* local
buffer, the key's (``residuals.flat_residual(key, n, ...)``): every segment this rank
sends is compensated by and leaves behind its share, and the own segment's share (only
non-zero after a checkpoint was re-sharded to another rank count) is added exactly and
zeroed. Seeds: ``(seed, step, crc32(key), rank, 1, 0, offset, m)`` per segment, without
rank for shared-seed codecs. PowerSGD has no reduce-scatter here (UnsupportedError).

Example:
    >>> import numpy as np, gradcomm
    >>> from gradcomm.comm import run_ranks
    >>> run_ranks(2, lambda t: reduce_scatter(np.arange(4, dtype=np.float32), t,
    ...                                       compressor="fp16").tolist())
    [[0.0, 2.0], [4.0, 6.0]]
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import arrays, compressors
from ..collectives._check import agree_args
from ..collectives._segments import bounds, chunks
from ..collectives.reduce_scatter import dense_reduce_scatter, ring, shard_bounds
from ..comm.base import Transport
from ..compressors.base import Compressor
from ..error_feedback import ResidualStore, contractive
from ..errors import ConfigError, GradcommError, UnsupportedError
from ..ops import Reducer
from ._args import check_key, check_op, check_seed
from .frames import Frames
from .reduce_scatter_alltoall import alltoall
from .routes import _narrow, _widen, segment_codec, span_bytes
from .seeds import Seeds
from .state import next_step, session
from .wire import CompressedWire

#: the routes of a compressed reduce-scatter
ROUTES = ("alltoall", "ring")
ALGORITHMS = (*ROUTES, "auto")
_FAMILY = "reduce_scatter"


def auto_route(p: int) -> str:
    """The route ``algorithm="auto"`` takes on ``p`` ranks.

    Example:
        >>> auto_route(2), auto_route(3)
        ('alltoall', 'alltoall')
    """
    return "alltoall"


def check_algorithm(algorithm: str, name: str) -> None:
    """Raise unless ``algorithm`` is a compressed reduce-scatter route (or ``auto``)."""
    if algorithm not in ALGORITHMS:
        raise ConfigError(f"unknown reduce-scatter algorithm {algorithm!r} with compressor "
                          f"{name!r}; known: {', '.join(ALGORITHMS)}")


def ring_chunk(codec: Compressor, n: int, dtype: str) -> int:
    """Elements per message of the compressed ring (as the compressed allreduce's ring)."""
    return max(1, span_bytes(codec, n, dtype) // np.dtype(dtype).itemsize)


def wire_bytes(codec: Compressor, n: int, p: int, rank: int, dtype: str,
               route: str = "alltoall") -> int:
    """Bytes rank ``rank`` sends in a compressed reduce-scatter of ``n`` elements of
    working ``dtype`` (float32 for 16-bit inputs) by ``route``.

    Example:
        >>> from gradcomm import compressors
        >>> c = compressors.get("fp16")
        >>> wire_bytes(c, 1000, 2, 0, "float32") == wire_bytes(c, 1000, 2, 0, "float32", "ring")
        True
    """
    if p == 1 or n == 0:
        return 0
    codec = segment_codec(codec, n)
    f = Frames(codec, np.empty(0, dtype))
    off = bounds(n, p)
    total = 0
    for d in range(p):
        if d == rank:
            continue
        step = max(1, ring_chunk(codec, n, dtype))      # both routes: the same chunks
        total += sum(f.bound(b - a) for a, b in chunks(off[d], off[d + 1], step))
    return total


class _Flat:
    """The per-hop residuals of a compressed ring as slices of one flat residual."""

    enabled = True
    tally = None

    def __init__(self, e: Any) -> None:
        self.e = e

    def hop_residual(self, name: str, offset: int, n: int, dtype: Any,
                     like: Any = None) -> Any:
        return self.e[offset:offset + n]


@arrays.device_scoped
def run(t: Transport, buf: Any, dtype: str, op: str, route: str, codec: Compressor,
        seed: int, step: int, ef: ResidualStore | None, key: str) -> Any:
    """Reduce-scatter flat storage ``buf`` (overwritten) of logical ``dtype`` by ``route``
    through ``codec``; returns this rank's shard (a view of ``buf``)."""
    p, n = t.size, arrays.size(buf)
    lo, hi = shard_bounds(n, p, t.rank)
    ef = ef if (ef is not None and ef.enabled and codec.lossy
                and contractive(codec, per_hop=p > 1 and route != "alltoall")) else None
    pre_divide = op == "mean" and codec.lossy and p > 1
    codec = segment_codec(codec, n)
    with session(t) as scratch:
        x = _widen(buf, dtype, scratch)
        if pre_divide:
            arrays.divide_(x, p)
        e = None
        if ef is not None and n:
            e = ef.flat_residual(key, n, arrays.dtype_name(x), like=x)
            if e is None:
                raise ConfigError("a reduce-scatter needs a residual store that keeps each "
                                  "key's residual in one piece (flat_residual)")
            with np.errstate(invalid="ignore", over="ignore"):
                x[lo:hi] += e[lo:hi]                # the own share: exact, then settled
            e[lo:hi] = 0
        if p > 1 and n:
            seeds = Seeds(seed, step, key, t.rank, codec.shared_seed)
            if route == "alltoall":
                alltoall(t, x, codec, seeds, e, scratch,
                         chunk=ring_chunk(codec, n, arrays.dtype_name(x)))
            else:
                wire = CompressedWire(codec, x, seeds, ef=None if e is None else _Flat(e),
                                      key=key, scratch=scratch)
                ring(t, x, Reducer("sum", arrays.dtype_name(x)), wire=wire,
                     chunk_bytes=ring_chunk(codec, n, arrays.dtype_name(x))
                     * arrays.itemsize(x))
        if op == "mean" and not pre_divide:
            arrays.divide_(x[lo:hi], p)
        if x is not buf:
            _narrow(x[lo:hi], buf[lo:hi], dtype)
        return buf[lo:hi]


def compressed_reduce_scatter(t: Transport, buf: Any, dtype: str, *, op: str,
                              algorithm: str, compressor: Any, check: bool = True,
                              seed: int | None = None,
                              residuals: ResidualStore | None = None,
                              key: str | None = None, **options: Any) -> Any:
    """Reduce-scatter flat storage ``buf`` (may be overwritten) of logical ``dtype``
    through ``compressor``; returns this rank's shard (flat, storage dtype).

    ``residuals`` supplies error feedback (one flat residual per key) and the step of
    ``key``; without it steps count this transport's reduce-scatters. ``check``: the ranks
    first agree on count, dtype, op, algorithm, codec and config, seed, step, key and error
    feedback; argument errors are raised on every rank after it.
    """
    key = "default" if key is None else key
    problem: Exception | None = None
    codec: Compressor | None = None
    name = compressor if isinstance(compressor, str) else getattr(compressor, "name", "?")
    try:
        codec = compressors.get(compressor, **options)
        name = codec.name
        if name == "powersgd":
            raise UnsupportedError("powersgd has no reduce-scatter (its factors are dense "
                                   "sums of the whole matrix); use a per-element codec "
                                   "such as int8, fp16 or topk")
        check_op(op, dtype, name)
        check_algorithm(algorithm, name)
        seed = check_seed(seed)
        key = check_key(key)
    except (GradcommError, KeyError, TypeError, ValueError) as exc:
        problem = exc
    step = next_step(t, _FAMILY, residuals, key)
    if check:
        config = "?" if codec is None else repr(sorted(codec.get_config().items()))
        agree_args(t, "compressed reduce_scatter", problem, count=arrays.size(buf),
                   dtype=dtype, op=op, algorithm=algorithm, compressor=name, config=config,
                   seed=seed if isinstance(seed, int) else repr(seed), step=step, key=key,
                   error_feedback=residuals is not None and residuals.enabled)
    if problem is not None:
        raise problem
    assert codec is not None and isinstance(seed, int)
    route = auto_route(t.size) if algorithm == "auto" else algorithm
    out = run(t, buf, dtype, op, route, codec, seed, step, residuals, key)
    if residuals is not None:
        residuals.advance(key)
    return out


def reduce_scatter(x: Any, comm: Any = None, *, op: str = "sum", algorithm: str = "auto",
                   compressor: Any = None, error_feedback: ResidualStore | None = None,
                   key: str = "default", seed: int | None = None, check: bool = True,
                   **options: Any) -> Any:
    """This rank's shard of ``x`` (flattened) reduced over the ranks of ``comm``.

    Args:
        x: numpy array, torch tensor or cupy array, any shape; not modified. The result
            is a new flat array of the same kind, device and dtype: segment ``rank`` of
            the ``n`` elements (``[r·n/p, (r+1)·n/p)`` when p divides n; otherwise the
            first ``n % p`` ranks get one element more, see the module docstring).
        comm: mpi4py communicator, torch ProcessGroup, gradcomm Transport, or None.
        op: "sum" or "mean" (without a compressor also "max", "min", "prod").
        algorithm: "auto", "alltoall" or "ring" with a compressor; "ring" or "auto"
            without.
        compressor: None (exact), a codec name (options in ``**options``) or instance.
        error_feedback: a :class:`~gradcomm.ErrorFeedback` (or other residual store) that
            keeps ``key``'s residual over the whole local buffer and its step, updated in
            place; checkpoint it with its ``state_dict``.
        seed: seeds the stochastic codecs.
        check: the ranks first agree on the arguments (MismatchError on every rank).

    Example:
        >>> import numpy as np, gradcomm
        >>> from gradcomm.comm import run_ranks
        >>> run_ranks(3, lambda t: reduce_scatter(np.ones(4), t).tolist())
        [[3.0, 3.0], [3.0], [3.0]]
    """
    from ..comm import get_transport

    t = get_transport(comm)
    b = arrays.backend(x)
    meta = b.meta(x)
    if compressor is None:
        if options:
            raise ConfigError(f"unknown options {sorted(options)} (compressor options need "
                              "compressor=...)")
        buf = b.to_flat(x, meta, arrays.placement(meta, t.devices))
        algorithm = "ring" if algorithm == "auto" else algorithm
        shard = dense_reduce_scatter(t, buf, op, meta.dtype, algorithm, check=check)
    else:
        where = "host" if type(x) is np.ndarray else arrays.placement(meta, codecs=True)
        buf = b.to_flat(x, meta, where)
        shard = compressed_reduce_scatter(t, buf, meta.dtype, op=op, algorithm=algorithm,
                                          compressor=compressor, check=check, seed=seed,
                                          residuals=error_feedback, key=key, **options)
    out_meta = arrays.Meta(meta.kind, meta.dtype, (arrays.size(shard),), meta.device)
    return arrays.from_flat(arrays.clone(shard), out_meta)


__all__ = ["ALGORITHMS", "ROUTES", "auto_route", "compressed_reduce_scatter", "reduce_scatter", "run",
           "wire_bytes"]
