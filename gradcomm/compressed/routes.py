"""How a compressed allreduce runs once its route is chosen: per hop, or gathered.

- **per hop** (:data:`~gradcomm.compressed._args.HOP_ALGORITHMS`): the dense algorithm
  runs on a :class:`~gradcomm.compressed.wire.CompressedWire`; a codec told to keep ``k``
  elements keeps ``k/n`` of each segment (:func:`segment_codec`); ring and tree move
  messages of about :data:`CHUNK_BYTES` that span at most :data:`MAX_SPAN_BYTES` of the
  buffer (:func:`span_bytes`: a high-ratio codec's encode then overlaps the wire); a
  large ring may run its codec work on a worker thread (:mod:`~gradcomm.compressed.ring`).
- **allgather**: every rank compresses ``e + g`` once into a frame whose size follows
  from the count alone, the frames are allgathered, and every rank decodes and sums them
  in rank order. For codecs with a ``piece_quantum`` on host buffers the cost model may
  cut it into pipelined pieces (:mod:`~gradcomm.compressed.pipeline`, same bytes):
  :func:`gather_pieces`.
- **sparse_allgather**: as allgather, for sparse codecs: the (index, value) pairs go
  through :func:`~gradcomm.collectives.sparse_allgather.allreduce`.

:func:`run` is the shared frame of every route: 16-bit floats widened to float32 (and
rounded back), ``mean`` of a lossy codec divided by p *before* compressing, error
feedback only for contractive codecs, p = 1 or an empty buffer sent whole.

Example:
    >>> import numpy as np
    >>> from gradcomm import compressors
    >>> from gradcomm.comm import run_ranks
    >>> def fn(t):
    ...     x = np.full(4, t.rank + 1.0, np.float32)
    ...     return run(t, x, "float32", "sum", "allgather", compressors.get("fp16"), 0, 0,
    ...                None, "w").tolist()
    >>> run_ranks(2, fn)[0]
    [3.0, 3.0, 3.0, 3.0]
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import numpy as np

from .. import arrays, compressors
from ..collectives import algorithm
from ..ops import Reducer
from ..collectives.costmodel import link_bound as _profile_link_bound
from ..comm.background import background
from ..comm.base import Transport
from ..compressors.base import Compressor, Payload
from ..error_feedback import ResidualStore, contractive
from ..errors import PayloadError
from . import pipeline, ring
from ._args import HOP_ALGORITHMS
from .frames import Frames, max_nbytes
from .guard import SqNorm
from .planned import PlannedGather, plan_gather
from .planned_pipeline import PipelinedGather, pieced_if_it_pays
from .seeds import Seeds
from .state import Scratch, session
from .wire import CompressedWire

#: target bytes of one compressed message in the pipelined ring and tree
CHUNK_BYTES = 2 << 20
#: the most dense bytes one such message covers (a high-ratio codec's message would
#: otherwise span a whole large segment, whose encode then waits for none of the wire)
MAX_SPAN_BYTES = 8 << 20
#: pieces of the gathered route's pipeline: None lets the cost model decide, 1 is one
#: shot (benchmarks set it to compare; it must be the same on every rank)
GATHER_PIECES: int | None = None
#: layouts whose gathered route a transport keeps planned (:func:`planned`)
PLANS = 256


def gather_pieces(t: Transport, codec: Compressor, n: int, dtype: str, itemsize: int) -> int:
    """Pieces of the gathered (not sparse) route of ``n`` host elements of working
    ``dtype``: 1 for codecs without a ``piece_quantum``, else :data:`GATHER_PIECES` or
    the cost model's choice (:func:`~gradcomm.collectives.costmodel.route_times` with the
    agreed profile, if any: the same on every rank).

    Example:
        >>> from gradcomm import compressors
        >>> from gradcomm.comm import run_ranks
        >>> run_ranks(2, lambda t: gather_pieces(t, compressors.get("topk", ratio=0.01),
        ...                                      10**6, "float32", 4))
        [1, 1]
    """
    if not codec.piece_quantum or n < 2 * codec.piece_quantum:
        return 1
    if GATHER_PIECES is not None:
        return max(1, GATHER_PIECES)
    from ..collectives.auto import agreed_profile
    from ..collectives.costmodel import route_times

    pieces: dict[str, int] = {}
    route_times(t.size, n, max_nbytes(codec, n, dtype), itemsize, codec.name, "ring",
                agreed_profile(t), gathered=True, quantum=codec.piece_quantum,
                pieces=pieces)
    return pieces["allgather"]


def segment_codec(codec: Compressor, n: int) -> Compressor:
    """The codec a per-hop wire uses on segments of an ``n``-element buffer: a codec told
    to keep ``k`` elements keeps the same fraction ``k/n`` of every segment instead.

    Example:
        >>> from gradcomm import compressors
        >>> segment_codec(compressors.get("topk", k=10), 100).get_config()["ratio"]
        0.1
    """
    k = codec.get_config().get("k")
    if k is None or not n:
        return codec
    return compressors.get(codec.name, ratio=min(1.0, k / n))


def span_bytes(codec: Compressor, n: int, dtype: str) -> int:
    """Dense bytes one compressed message of the per-hop ring and tree covers, for
    ``n`` elements of working ``dtype`` through ``codec``: about :data:`CHUNK_BYTES`
    compressed, at most :data:`MAX_SPAN_BYTES` dense (a function of these only, so every
    rank cuts the same segments, whatever the transport).

    Example:
        >>> from gradcomm import compressors
        >>> [round(span_bytes(compressors.get(c), 10**8, "float32") / 2**20, 1)
        ...  for c in ("fp16", "int8", "onebit")]
        [4.0, 7.9, 8.0]
    """
    itemsize = np.dtype(dtype).itemsize
    ratio = n * itemsize / max(1, max_nbytes(codec, n, dtype))
    return max(itemsize, min(int(CHUNK_BYTES * max(1.0, ratio)), MAX_SPAN_BYTES))


def message_bytes(codec: Compressor, n: int, dtype: str) -> int:
    """Compressed bytes of one message of :func:`span_bytes` (the cost model's
    ``chunk_bytes``)."""
    whole = n * np.dtype(dtype).itemsize
    return max(1, max_nbytes(codec, n, dtype) * span_bytes(codec, n, dtype) // max(1, whole))


def link_bound(t: Transport, codec: Compressor, x: Any) -> bool:
    """Whether the agreed calibrated profile (if any) models the ring's wire time at more
    than twice its codec time (then keeping the link busy pays for a worker thread)."""
    from ..collectives.auto import agreed_profile

    prof = agreed_profile(t)
    n = arrays.size(x)
    if prof is None or not n:
        return False
    dt = arrays.dtype_name(x)
    return _profile_link_bound(prof, t.size, n, max_nbytes(codec, n, dt), arrays.itemsize(x),
                               codec.name, chunk_bytes=message_bytes(codec, n, dt))


def per_hop(t: Transport, x: Any, codec: Compressor, name: str, seeds: Seeds,
            ef: ResidualStore | None, key: str, scratch: Scratch | None = None,
            src: Any = None) -> None:
    """``x = Σ_ranks x`` by dense algorithm ``name`` on a compressed wire; with ``src``
    (``x``'s contents are then ignored), ``x = Σ_ranks src``: the serial ring reads it
    where it lies (its first encodes, and each segment's fold), the others copy it in
    first."""
    n, dt, itemsize = arrays.size(x), arrays.dtype_name(x), arrays.itemsize(x)
    codec = segment_codec(codec, n)
    piped = name == "ring" and ring.wanted(n * itemsize, t, link_bound(t, codec, x))
    if src is not None and (name != "ring" or piped):
        arrays.assign(x, src)
        src = None
    parts = 1 << (t.size.bit_length() - 1) if name == "rabenseifner" else 1
    wire = CompressedWire(codec, x, seeds, max_parts=parts, ef=ef, key=key, scratch=scratch,
                          src=src)
    kwargs: dict[str, Any] = {}
    if name in ("ring", "tree") and n:
        kwargs["chunk_bytes"] = span_bytes(codec, n, dt)
    if piped:
        ring.allreduce(t, x, wire, **kwargs)
        return
    if src is not None:
        kwargs["src"] = src
    algorithm(name)(t, x, Reducer("sum", dt), wire=wire, **kwargs)


def gathered(t: Transport, x: Any, codec: Compressor, sparse: bool, seeds: Seeds,
             ef: ResidualStore | None, key: str, scratch: Scratch | None = None,
             src: Any = None, kept: bool = False) -> Any:
    """Every rank compresses ``x`` (+ its residual) once; the payloads are allgathered as
    one-part frames of the same size (no size exchange) and decoded-and-summed in rank
    order into ``x``. Sparse codecs send their (index, value) pairs through
    :func:`~gradcomm.collectives.sparse_allgather.allreduce` instead. Returns the
    result: ``x``, or with ``src`` (the values; ``x``'s contents are then ignored) on
    the sparse route, a fresh array: the (index, value) pairs are taken from ``src``
    where they lie and summed into zero pages, not into a filled ``x``; with ``kept``
    (``x`` is memory the caller keeps, its pages in place) into ``x``, zeroed there,
    which is cheaper than fresh pages then (4.1 against 5.6 ms per 100 MB here). The
    planned route (:class:`~.planned.PlannedGather`) encodes ``src`` where it lies too and
    decodes the sum into ``x``; every other path copies ``src`` into ``x`` first."""
    from ..collectives.allgather import allgatherv

    n = arrays.size(x)
    f = Frames(codec, x, scratch)
    pairs = codec.sparse_pairs
    size = f.bound(n)
    e = ef.flat_residual(key, n, f.dtype, like=x) if ef is not None and f.fused else None
    tally = None if e is None else ef.tally
    if src is not None and not (ef is None or e is not None):
        arrays.assign(x, src)               # (the compensate path below adds to x)
        src = None
    direct = src is not None and sparse and pairs
    if ef is None or e is not None:
        # the key's residual e (if any) is fused into the codec's pass: y = x + e is
        # compressed and e = y - decode(y) left behind; x itself is not needed after
        k = 1 if sparse or f.device else \
            gather_pieces(t, codec, n, f.dtype, arrays.itemsize(x))
        sig, g = (None, None) if sparse or f.device or k > 1 else \
            planned(t, codec, x, seeds, key, ef is not None)
        if src is not None and not direct and g is None:
            arrays.assign(x, src)
            src = None
        if k > 1:
            pipeline.allgather(t, x, f, seeds, e, k, tally)
            return x
        if g is not None:
            g.run(t, x, seeds.base[1], None, residual=e, tally=tally,
                  **({} if src is None else {"src": src}))
            if g.pieces_pay:                        # decided at one run, alike everywhere
                t.state.plans[sig] = pieced_if_it_pays(t, g, seeds.base[0])
            return x
        if sparse and pairs:
            # the tally's norm of the new residual (a pass of its own for these codecs)
            # is taken while the pairs are on the wire: the same sum, added after
            later = None if e is None or tally is None else SqNorm.over(e)
            payload = codec.compress(src if direct else x, seed=seeds.whole(), **(
                {} if e is None else {"residual": e, "tally": None if later else tally}))
            _, _, idx, vals = codec.to_sparse(payload)
            with background(later) if later is not None else nullcontext():
                out = _sparse_sum(t, idx, vals, None if direct and not kept else x, n)
            if later is not None:
                tally += (later.value(), n)
            return out
        frame, data = f.single(x, seeds.whole(), n, size, residual=e, tally=tally)
        if sparse:
            dec = f.floats(0, n)
            f.decode(data, dec)
            idx = _nonzero(dec)
            _sparse_sum(t, idx, dec[idx], x)
            return x
    else:                       # a residual kept in pieces (the DDP hook's): step by step
        ef.compensate(key, x)
        frame, data = f.single(x, seeds.whole(), n, size)
        dec = f.floats(0, n)
        f.decode(data, dec)
        ef.update(key, x, dec)
        if sparse:
            idx = _nonzero(dec)
            _sparse_sum(t, idx, dec[idx], x)
            return x
    landing = f.take(size * t.size)
    blocks = allgatherv(t, frame, sizes=np.full(t.size, size, np.int64), out=landing)
    payloads = []
    for r, b in enumerate(blocks):
        try:
            (_, _, data), = f.parts(b, n, 1)
            payloads.append(f.payload(data, n))
        except PayloadError as exc:
            raise PayloadError(f"rank {r}'s payload: {exc}") from None
    if f.device:                # every payload to the device in one copy (8-byte aligned)
        moved = arrays.like(landing, x)
        payloads = [pl.rebased(landing, moved) for pl in payloads]
    _decode_sum(f, payloads, x)
    return x


def planned(t: Transport, codec: Compressor, x: Any, seeds: Seeds, key: str,
            feedback: bool) -> tuple[Any, PlannedGather | PipelinedGather | None]:
    """The gathered route of ``key``'s host float32 ``x`` planned once per layout (kept in
    ``t.state.plans`` under the returned signature, at most :data:`PLANS` of them, the
    least recent dropped first): :class:`~.planned.PlannedGather` (later cut into pieces
    where the ranks find that pays), or None where the codec does not plan. The same
    bytes as the unplanned route (:func:`~.planned.plan_gather` checks its frame)."""
    if not (isinstance(x, np.ndarray) and x.dtype == np.float32):
        return None, None
    seed, n = seeds.base[0], x.size
    sig = (key, seed, codec, n, feedback)
    plans = t.state.plans
    g = plans.pop(sig, False)
    if g is False:
        g = plan_gather(t, codec, n, key, seed=seed, feedback=feedback)
        while len(plans) >= PLANS:
            del plans[next(iter(plans))]
    plans[sig] = g                                  # the most recent last
    return sig, g


def _nonzero(a: Any) -> Any:
    """Indices of ``a``'s non-zero elements (int64, ascending, where ``a`` is)."""
    if arrays.is_host(a):
        return np.flatnonzero(a)
    xp = arrays.namespace(a)
    return xp.astype(xp.nonzero(a)[0], xp.int64)


def _sparse_sum(t: Transport, idx: Any, vals: Any, x: Any, n: int | None = None) -> Any:
    """``x = Σ_ranks scatter(idx, vals)``, returned: the pairs go through the host (they
    are few); the result lands in ``x`` where it is, or (``x`` None) in a fresh host
    array of ``n`` elements."""
    from ..collectives.sparse_allgather import allreduce as sparse_allreduce

    return sparse_allreduce(t, arrays.host(idx), arrays.host(vals),
                            arrays.size(x) if x is not None else n, out=x)


def _decode_sum(f: Frames, payloads: list[Payload], x: Any) -> None:
    """``x = Σ decode(payloads)`` in rank order (the codec's decompress_sum if it has its
    own, else decode, then decode-and-add)."""
    codec, n = f.codec, arrays.size(x)
    try:
        if type(codec).decompress_sum is not Compressor.decompress_sum:
            total = codec.decompress_sum(payloads, out=x)
            if total is not x:
                if tuple(total.shape) != (n,):
                    raise PayloadError(f"{codec.name} payloads decode to shape "
                                       f"{tuple(total.shape)}, ({n},) expected")
                arrays.assign(x, total)
            return
        f.decode_payload(payloads[0], x)
        for p in payloads[1:]:
            f.decode_add_payload(p, x)
    except PayloadError:
        raise
    except (ValueError, TypeError, IndexError, KeyError, OverflowError) as exc:
        raise PayloadError(f"{codec.name} payloads do not decode: {exc}") from None


def run(t: Transport, buf: Any, dtype: str, op: str, route: str, codec: Compressor,
        seed: int, step: int, ef: ResidualStore | None, key: str,
        feedback: bool | None = None, src: Any = None, kept: bool = False) -> Any:
    """Allreduce flat storage ``buf`` of logical ``dtype`` (op ``sum`` or ``mean``) by
    ``route`` (a per-hop algorithm, ``allgather`` or ``sparse_allgather``: decided by the
    caller) through ``codec``; returns the result (``buf``, overwritten). ``feedback``:
    whether ``ef``'s residuals apply, if the caller decided it already (as
    :func:`feeds_back` does; None: decided here). ``src``: the values to reduce, read
    where they lie (a host float32 sum where :func:`reads_src`), else first copied into
    ``buf``; None: ``buf`` holds them. ``kept``: ``buf`` is memory the caller keeps
    (see :func:`gathered`)."""
    if src is not None and not (reads_src(codec, op, route) and dtype == "float32"
                                and t.size > 1 and arrays.size(buf)):
        arrays.assign(buf, src)
        src = None
    with arrays.device_scope(buf):         # cupy: kernels and new arrays on buf's device
        return _run(t, buf, dtype, op, route, codec, seed, step, ef, key, feedback, src,
                    kept)


def reads_src(codec: Compressor, op: str, route: str) -> bool:
    """Whether a host float32 ``op`` through ``codec`` on ``route`` (resolved: not
    ``auto``) can read its values where they lie (:func:`run`'s ``src``): a sum on a
    gathered route, whose sparse pairs or planned frames are taken straight from the
    input (:func:`gathered` copies it in where its path cannot), or on the ring (the
    serial ring encodes and folds from it; :func:`per_hop` copies it in for the
    pipelined one).

    Example:
        >>> from gradcomm import compressors
        >>> topk = compressors.get("topk", ratio=0.01)
        >>> reads_src(topk, "sum", "sparse_allgather"), reads_src(topk, "mean", "allgather")
        (True, False)
    """
    return op == "sum" and route in ("ring", "allgather", "sparse_allgather")


def residuals_show_result(route: str) -> bool:
    """Whether, with error feedback, a non-finite element of ``route``'s result shows as
    a non-finite residual on some rank. On the ring every element of the result is the
    decoded value ``d`` of a finished segment's last encode, whose residual is
    ``y - d``: a non-finite ``d`` from a finite ``y`` leaves an infinite residual, and a
    non-finite ``y`` a non-finite one. The divergence guard then needs no pass of its
    own over the result (:meth:`~.guard.Guard.check`, ``shown``). Not so where decoded
    values are summed after the last encode (the gathered routes: finite values may
    overflow), nor on recursive doubling, tree or Rabenseifner.

    Example:
        >>> residuals_show_result("ring"), residuals_show_result("allgather")
        (True, False)
    """
    return route == "ring"


def feeds_back(t: Transport, route: str, codec: Compressor, ef: ResidualStore | None
               ) -> bool:
    """Whether :func:`run` applies ``ef``'s residuals with ``codec`` on ``route``: an
    enabled store, a lossy codec, stable under error feedback on this route
    (:func:`~gradcomm.error_feedback.contractive`)."""
    hops = t.size > 1 and route in HOP_ALGORITHMS
    return bool(ef is not None and ef.enabled and codec.lossy
                and contractive(codec, per_hop=hops))


def _run(t: Transport, buf: Any, dtype: str, op: str, route: str, codec: Compressor,
         seed: int, step: int, ef: ResidualStore | None, key: str,
         feedback: bool | None, src: Any, kept: bool) -> Any:
    """:func:`run` in ``buf``'s device scope."""
    p, n = t.size, arrays.size(buf)
    if feedback is None:
        feedback = feeds_back(t, route, codec, ef)
    ef = ef if feedback else None
    pre_divide = op == "mean" and codec.lossy and p > 1
    if p == 1 or n == 0:
        x = _widen(buf, dtype, None)
        if pre_divide:
            arrays.divide_(x, p)
        if ef is not None and n:
            ef.compensate(key, x)
            ef.update(key, x, x)
        return _narrow(x, buf, dtype)
    with session(t) as scratch:
        x = _widen(buf, dtype, scratch)
        if pre_divide:
            arrays.divide_(x, p)
        seeds = Seeds(seed, step, key, t.rank, codec.shared_seed)
        if route in HOP_ALGORITHMS:
            per_hop(t, x, codec, route, seeds, ef, key, scratch, src)
        else:
            y = gathered(t, x, codec, route == "sparse_allgather", seeds, ef, key, scratch,
                         src, kept)
            if y is not x:                  # a fresh result (from src: float32, sum)
                return y
        if op == "mean" and not pre_divide:
            arrays.divide_(x, p)
        return _narrow(x, buf, dtype)


def _widen(buf: Any, dtype: str, scratch: Scratch | None) -> Any:
    """The float32 working copy of 16-bit floats (reused scratch), else ``buf`` itself."""
    if dtype not in ("bfloat16", "float16"):
        return buf
    from ..compressors import _kernels

    n = arrays.size(buf)
    if not arrays.is_host(buf):
        x = arrays.empty_like_kind(buf, n, "float32")
    else:
        x = scratch.floats(3, n, np.float32) if scratch is not None else \
            np.empty(n, np.float32)
    k = _kernels.for_array(buf)
    if dtype == "bfloat16":
        k.bf16_to_f32(buf, x)
    else:
        k.f16_to_f32(arrays.bitcast(buf, "uint16"), x)
    return x


def _narrow(x: Any, buf: Any, dtype: str) -> Any:
    """Round the float32 result back into 16-bit ``buf`` (no-op when ``x is buf``)."""
    if x is not buf:
        from ..compressors import _kernels

        k = _kernels.for_array(buf)
        if dtype == "bfloat16":
            k.f32_to_bf16(x, buf)
        else:
            k.f32_to_f16(x, arrays.bitcast(buf, "uint16"))
    return buf
