"""One dense gossip round: each rank mixes its array with its neighbours' values.

Rank ``i`` computes ``x_i ← Σ_j W[i, j] · x_j`` for the topology's mixing matrix ``W``
(see :mod:`gradcomm.collectives.topologies`):

1. post a receive from every peer ``j`` with ``W[i, j] ≠ 0`` and send ``x_i`` to every
   peer ``k`` with ``W[k, i] ≠ 0`` (all non-blocking, tag ``TAG_GOSSIP``), wait for all;
2. combine the terms in ascending rank order (self included), accumulating 16-bit floats
   in float32 and rounding once, so ranks with the same inputs get the same bytes (the
   ``complete`` topology returns the exact same average on every rank).

The front door is :mod:`gradcomm.collectives.gossip`; this module holds the round itself
(:func:`mix`), the validated set-up of a round (:class:`Setup`) and the weighted sums that
the compressed form (:mod:`gradcomm.collectives.choco`) shares.

Example:
    >>> import numpy as np
    >>> from gradcomm.comm import run_ranks
    >>> def fn(t):
    ...     p = topologies.plan(topologies.get("ring", t.size), t.rank, 0)
    ...     return mix(t, np.array([3.0 * t.rank]), "float64", p).tolist()
    >>> run_ranks(4, fn)
    [[4.0], [3.0], [6.0], [5.0]]
"""

from __future__ import annotations

import zlib
from typing import Any, Callable

import numpy as np

from .. import arrays
from .._dtypes import FLOATS, bf16_to_f32, f32_to_bf16
from ..comm.base import TAG_GOSSIP, Transport
from ..errors import ConfigError, GradcommError
from . import topologies
from .topologies import Plan, Topology

#: accumulation dtype per logical float dtype
ACC = {"float16": np.dtype(np.float32), "bfloat16": np.dtype(np.float32),
        "float32": np.dtype(np.float32), "float64": np.dtype(np.float64)}
#: steps must fit the int64 cross-rank check
MAX_STEP = 1 << 62

Weights = Any   # a p × p array-like, or a callable step -> p × p array-like


class Scratch:
    """Named buffers, reallocated only when size or dtype changes."""

    def __init__(self) -> None:
        self._bufs: dict[Any, np.ndarray] = {}

    def get(self, name: Any, n: int, dtype: np.dtype) -> np.ndarray:
        b = self._bufs.get(name)
        if b is None or b.size != n or b.dtype != dtype:
            b = self._bufs[name] = np.empty(n, dtype)
        return b


def check_dtype(dtype: str) -> None:
    if dtype not in FLOATS:
        raise ConfigError(f"gossip averaging needs a floating dtype (float16, bfloat16, "
                          f"float32, float64), got {dtype}; cast the array first")


def check_step(step: Any) -> int:
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or \
            not 0 <= step < MAX_STEP:
        raise ConfigError(f"step must be an integer >= 0, got {step!r}")
    return int(step)


def _weights_at(weights: Weights, step: int) -> Any:
    return weights(step) if callable(weights) else weights


def _weights_hash(weights: Weights, step: int) -> int:
    """A checksum of the matrix in force at ``step`` (-1: default weights)."""
    if weights is None:
        return -1
    try:
        w = np.ascontiguousarray(_weights_at(weights, step), dtype=np.float64)
    except Exception:  # noqa: BLE001 - reported by validate_weights on every rank
        return -2
    return zlib.crc32(repr(w.shape).encode() + w.tobytes())


def _topology_key(topology: Any) -> str:
    if isinstance(topology, Topology):
        return topology.key
    return topology if isinstance(topology, str) else repr(topology)


def flat_input(x: Any) -> tuple[np.ndarray, arrays.Meta]:
    """``x`` as a flat storage buffer: a view when ``x`` is contiguous host memory (it is
    only read: sent and weighted), else a copy."""
    meta = arrays.meta_of(x)
    try:
        return arrays.host_view(x), meta
    except ConfigError:                     # strided or on a device: stage a copy
        return arrays.to_flat(x)


def widen(src: np.ndarray, dtype: str, out: np.ndarray) -> np.ndarray:
    """``src`` (storage of ``dtype``) as the accumulation dtype; may return ``src``."""
    if dtype == "bfloat16":
        return bf16_to_f32(src, out)
    if dtype == "float16":
        out[...] = src
        return out
    return src


def narrow(acc: np.ndarray, dtype: str) -> np.ndarray:
    """The accumulator rounded once to ``dtype``'s storage (a new array for 16-bit)."""
    if dtype == "bfloat16":
        return f32_to_bf16(acc)
    if dtype == "float16":
        return acc.astype(np.float16)
    return acc


def weighted_sum(terms: tuple[tuple[int, float], ...], values: Callable[[int], np.ndarray],
                  dtype: str, acc: np.ndarray, tmp: Callable[[], np.ndarray],
                  scratch: frozenset[int] = frozenset()) -> np.ndarray:
    """``acc = Σ w · values(j)`` over ``terms`` in their (ascending) order.

    Buffers of the peers in ``scratch`` may be overwritten (float32/64 received values are
    scaled in place); other terms go through ``tmp()``. Equal weights (every built-in
    topology's default) are summed first and scaled once: fewer passes over the data.
    """
    one = acc.dtype.type
    if len(terms) > 1 and len({w for _, w in terms}) == 1:
        first = widen(values(terms[0][0]), dtype, acc)
        for idx, (j, _) in enumerate(terms[1:]):
            src = values(j)
            v = src if src.dtype == acc.dtype else widen(src, dtype, tmp())
            np.add(first if idx == 0 else acc, v, out=acc)
        np.multiply(acc, one(terms[0][1]), out=acc)
        return acc
    for idx, (j, w) in enumerate(terms):
        src = values(j)
        if idx == 0:
            target = acc
        elif j in scratch and src.dtype == acc.dtype:
            target = src
        else:
            target = tmp()
        np.multiply(widen(src, dtype, target), one(w), out=target)
        if idx:
            np.add(acc, target, out=acc)
    return acc


def _exchange(t: Transport, send: np.ndarray, plan: Plan, recv: dict[int, np.ndarray]) -> None:
    reqs = [t.irecv(recv[j], j, TAG_GOSSIP) for j in plan.recv_from]
    reqs += [t.isend(send, k, TAG_GOSSIP) for k in plan.send_to]
    t.waitall(reqs)


def mix(t: Transport, buf: np.ndarray, dtype: str, plan: Plan,
        scratch: Scratch | None = None) -> np.ndarray:
    """One dense gossip round on flat storage ``buf``; returns a new storage array.

    Example:
        >>> from gradcomm.comm import run_ranks
        >>> def fn(t):
        ...     p = topologies.plan(topologies.get("complete", t.size), t.rank, 0)
        ...     return mix(t, np.array([float(t.rank)]), "float64", p).tolist()
        >>> run_ranks(3, fn)
        [[1.0], [1.0], [1.0]]
    """
    n = buf.size
    s = scratch or Scratch()
    recv = {j: s.get(("recv", j), n, buf.dtype) for j in plan.recv_from}
    if n and (plan.recv_from or plan.send_to):
        _exchange(t, buf, plan, recv)
    acc_dt = ACC[dtype]
    acc = np.empty(n, acc_dt)        # returned (to the user): never a reused buffer
    weighted_sum(plan.terms, lambda j: buf if j == t.rank else recv[j], dtype, acc,
                  lambda: s.get("tmp", n, acc_dt), frozenset(plan.recv_from))
    return narrow(acc, dtype)


class Setup:
    """Resolve and validate a round's arguments; a local problem is kept, not raised, so
    that every rank first takes part in the cross-rank check."""

    def __init__(self, t: Transport, topology: Any, step: Any, weights: Weights, dtype: str,
                 cache: dict[Any, Any] | None = None) -> None:
        self.problem: GradcommError | None = None
        self.key = _topology_key(topology)
        self.step = step if isinstance(step, (int, np.integer)) and \
            not isinstance(step, bool) and 0 <= step < MAX_STEP else -1
        self.whash = _weights_hash(weights, int(self.step)) if self.step >= 0 else -2
        self.topo: Topology | None = None
        self.plan: Plan | None = None
        self.matrix: np.ndarray | None = None
        try:
            check_dtype(dtype)
            step = check_step(step)
            self.topo = topologies.get(topology, t.size)
            self.key = self.topo.key
            ckey = (self.key, step % self.topo.period, self.whash)
            hit = cache.get(ckey) if cache is not None else None
            if hit is None:
                if weights is not None:
                    self.matrix = topologies.validate_weights(_weights_at(weights, step),
                                                              self.topo, step)
                hit = (topologies.plan(self.topo, t.rank, step, self.matrix), self.matrix)
                if cache is not None:
                    cache[ckey] = hit
            self.plan, self.matrix = hit
        except GradcommError as exc:
            self.problem = exc


__all__ = ["ACC", "MAX_STEP", "Scratch", "Setup", "Weights", "check_dtype", "check_step",
           "flat_input", "mix", "narrow", "weighted_sum", "widen"]
