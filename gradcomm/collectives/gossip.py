"""Gossip (neighbour) averaging: each rank mixes its array with its neighbours'.

One round on rank ``i`` is ``x_i ← Σ_j W[i, j] · x_j`` for the topology's mixing matrix
``W`` (see :mod:`gradcomm.collectives.topologies`):

1. post a receive from every peer ``j`` with ``W[i, j] ≠ 0`` and send ``x_i`` to every
   peer ``k`` with ``W[k, i] ≠ 0`` (all non-blocking, tag ``TAG_GOSSIP``), wait for all;
2. combine the terms in ascending rank order (self included), accumulating 16-bit floats
   in float32 and rounding once, so ranks with the same inputs get the same bytes (the
   ``complete`` topology returns the exact same average on every rank).

Cost per round: ``deg`` messages of ``n`` values each way (ring: 2, torus: 4,
exponential: 1, complete: p − 1) instead of an allreduce's ``2(p−1)/p · n`` in
``log p`` to ``2(p−1)`` steps. Repeated rounds contract the consensus distance
``(1/p) Σ‖x_i − x̄‖²`` by at least ``λ₂(W)²`` per round and keep ``x̄`` (for doubly
stochastic ``W``, which the defaults are).

Floating dtypes only (float16, bfloat16, float32, float64): averaging integers would have
to round, so integer arrays raise :class:`~gradcomm.errors.ConfigError`.

:class:`Gossip` is the stateful form: it reuses receive buffers, counts steps, and with a
``compressor`` runs CHOCO-gossip (Koloskova et al., 2019): every rank keeps a public
estimate ``x̂_j`` of itself and of each neighbour, exchanges only the compressed
difference ``q_i = C(x_i − x̂_i)``, adds the received ``q_j`` to its copies (identical on
every rank holding them) and moves ``x_i ← x_i + γ Σ_j W[i, j](x̂_j − x̂_i)``. The sum of
the ``x_i`` is preserved (to rounding) whatever the codec's error.

Example:
    >>> import numpy as np
    >>> from gradcomm.comm import run_ranks
    >>> run_ranks(4, lambda t: gossip_average(np.array([3.0 * t.rank]), t).tolist())
    [[4.0], [3.0], [6.0], [5.0]]
"""

from __future__ import annotations

import zlib
from typing import Any, Callable

import numpy as np

from .. import arrays
from .._dtypes import FLOATS, bf16_to_f32, f32_to_bf16
from ..comm import get_transport
from ..comm.base import TAG_GOSSIP, Transport
from ..errors import ConfigError, GradcommError, PayloadError, TransportError, UnsupportedError
from . import dense_allreduce, topologies
from ._check import agree
from .topologies import Plan, Topology

#: accumulation dtype per logical float dtype
_ACC = {"float16": np.dtype(np.float32), "bfloat16": np.dtype(np.float32),
        "float32": np.dtype(np.float32), "float64": np.dtype(np.float64)}
#: steps must fit the int64 cross-rank check
_MAX_STEP = 1 << 62
STATE_VERSION = 1

Weights = Any   # a p × p array-like, or a callable step -> p × p array-like


class _Scratch:
    """Named buffers, reallocated only when size or dtype changes."""

    def __init__(self) -> None:
        self._bufs: dict[Any, np.ndarray] = {}

    def get(self, name: Any, n: int, dtype: np.dtype) -> np.ndarray:
        b = self._bufs.get(name)
        if b is None or b.size != n or b.dtype != dtype:
            b = self._bufs[name] = np.empty(n, dtype)
        return b


def _check_dtype(dtype: str) -> None:
    if dtype not in FLOATS:
        raise ConfigError(f"gossip averaging needs a floating dtype (float16, bfloat16, "
                          f"float32, float64), got {dtype}; cast the array first")


def _check_step(step: Any) -> int:
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or \
            not 0 <= step < _MAX_STEP:
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


def _flat_input(x: Any) -> tuple[np.ndarray, arrays.Meta]:
    """``x`` as a flat storage buffer: a view when ``x`` is contiguous host memory (it is
    only read: sent and weighted), else a copy."""
    meta = arrays.meta_of(x)
    try:
        return arrays.host_view(x), meta
    except ConfigError:                     # strided or on a device: stage a copy
        return arrays.to_flat(x)


def _widen(src: np.ndarray, dtype: str, out: np.ndarray) -> np.ndarray:
    """``src`` (storage of ``dtype``) as the accumulation dtype; may return ``src``."""
    if dtype == "bfloat16":
        return bf16_to_f32(src, out)
    if dtype == "float16":
        out[...] = src
        return out
    return src


def _narrow(acc: np.ndarray, dtype: str) -> np.ndarray:
    """The accumulator rounded once to ``dtype``'s storage (a new array for 16-bit)."""
    if dtype == "bfloat16":
        return f32_to_bf16(acc)
    if dtype == "float16":
        return acc.astype(np.float16)
    return acc


def _weighted_sum(terms: tuple[tuple[int, float], ...], values: Callable[[int], np.ndarray],
                  dtype: str, acc: np.ndarray, tmp: Callable[[], np.ndarray],
                  scratch: frozenset[int] = frozenset()) -> np.ndarray:
    """``acc = Σ w · values(j)`` over ``terms`` in their (ascending) order.

    Buffers of the peers in ``scratch`` may be overwritten (float32/64 received values are
    scaled in place); other terms go through ``tmp()``. Equal weights (every built-in
    topology's default) are summed first and scaled once: fewer passes over the data.
    """
    one = acc.dtype.type
    if len(terms) > 1 and len({w for _, w in terms}) == 1:
        first = _widen(values(terms[0][0]), dtype, acc)
        for idx, (j, _) in enumerate(terms[1:]):
            src = values(j)
            v = src if src.dtype == acc.dtype else _widen(src, dtype, tmp())
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
        np.multiply(_widen(src, dtype, target), one(w), out=target)
        if idx:
            np.add(acc, target, out=acc)
    return acc


def _exchange(t: Transport, send: np.ndarray, plan: Plan, recv: dict[int, np.ndarray]) -> None:
    reqs = [t.irecv(recv[j], j, TAG_GOSSIP) for j in plan.recv_from]
    reqs += [t.isend(send, k, TAG_GOSSIP) for k in plan.send_to]
    t.waitall(reqs)


def mix(t: Transport, buf: np.ndarray, dtype: str, plan: Plan,
        scratch: _Scratch | None = None) -> np.ndarray:
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
    s = scratch or _Scratch()
    recv = {j: s.get(("recv", j), n, buf.dtype) for j in plan.recv_from}
    if n and (plan.recv_from or plan.send_to):
        _exchange(t, buf, plan, recv)
    acc_dt = _ACC[dtype]
    acc = np.empty(n, acc_dt)        # returned (to the user): never a reused buffer
    _weighted_sum(plan.terms, lambda j: buf if j == t.rank else recv[j], dtype, acc,
                  lambda: s.get("tmp", n, acc_dt), frozenset(plan.recv_from))
    return _narrow(acc, dtype)


class _Setup:
    """Resolve and validate a round's arguments; a local problem is kept, not raised, so
    that every rank first takes part in the cross-rank check."""

    def __init__(self, t: Transport, topology: Any, step: Any, weights: Weights, dtype: str,
                 cache: dict[Any, Any] | None = None) -> None:
        self.problem: GradcommError | None = None
        self.key = _topology_key(topology)
        self.step = step if isinstance(step, (int, np.integer)) and \
            not isinstance(step, bool) and 0 <= step < _MAX_STEP else -1
        self.whash = _weights_hash(weights, int(self.step)) if self.step >= 0 else -2
        self.topo: Topology | None = None
        self.plan: Plan | None = None
        self.matrix: np.ndarray | None = None
        try:
            _check_dtype(dtype)
            step = _check_step(step)
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


def gossip_average(x: Any, comm: Any = None, *, topology: str | Topology = "ring",
                   step: int = 0, weights: Weights = None, check: bool = True) -> Any:
    """One gossip round: ``x`` mixed with its neighbours' by the topology's weights.

    Args:
        x: numpy array, torch tensor or cupy array of a floating dtype; not modified. A
            new array of the same kind, device, dtype and shape is returned.
        comm: mpi4py communicator, torch ProcessGroup, gradcomm Transport, or None.
        topology: "ring", "torus", "exponential", "complete", or a
            :class:`~gradcomm.collectives.topologies.Topology` (e.g. ``Torus(p, shape=)``).
        step: the round number (selects the peer of the time-varying ``exponential``
            graph); must be equal on every rank.
        weights: None (Metropolis–Hastings), a p × p mixing matrix, or a callable
            ``step -> matrix``; validated (rows sum to one, non-zero only on edges).
        check: first verify that all ranks passed the same count, dtype, topology, step
            and weights (one tiny exchange); a difference raises MismatchError on every
            rank. ``check=False`` saves that exchange in tight loops.

    With one rank, a copy of ``x`` is returned.

    Example:
        >>> import numpy as np
        >>> from gradcomm.comm import run_ranks
        >>> w = [[0.5, 0.5, 0.0], [0.0, 0.5, 0.5], [0.5, 0.0, 0.5]]
        >>> run_ranks(3, lambda t: gossip_average(np.array([2.0 * t.rank]), t,
        ...                                       weights=w).tolist())
        [[1.0], [3.0], [2.0]]
    """
    t = get_transport(comm)
    buf, meta = _flat_input(x)
    setup = _Setup(t, topology, step, weights, meta.dtype)
    if check:
        agree(t, "gossip", count=int(buf.size), dtype=meta.dtype, topology=setup.key,
              step=int(setup.step), weights=setup.whash, compressor=None,
              gamma=repr(1.0), scale=repr(1.0))   # Gossip's fields: the two may be mixed
    if setup.problem is not None:
        raise setup.problem
    assert setup.plan is not None
    return arrays.from_flat(mix(t, buf, meta.dtype, setup.plan), meta)


class Gossip:
    """Stateful gossip rounds: buffers reused, steps counted, optional compression.

    Args:
        comm: as for :func:`gossip_average`.
        topology, weights: as for :func:`gossip_average`.
        compressor: None (exact values on the wire), or a codec name / Compressor: then
            CHOCO-gossip with consensus step ``gamma``, keeping the public estimates
            ``x̂`` in this object (``state_dict``). Needs a static topology (not
            ``exponential``: a one-peer rotating graph would leave the other copies of
            ``x̂`` stale).
        gamma: CHOCO consensus step size in (0, 1]. Default 1.0 for a lossless codec
            (then a round equals the dense one, to rounding), 0.4 for a lossy one;
            coarser codecs (top-k at 1 %) want smaller values.
        scale: factor on every decoded difference before it updates the estimates
            (default 1). CHOCO needs a *contractive* codec,
            ``E‖C(v) − v‖² ≤ (1 − δ)‖v‖²``: top-k, int8, fp16, onebit are; an unbiased
            codec with variance factor ω > 1 (QSGD with few levels on long vectors:
            ω = min(n/s², √n/s)) makes the estimates diverge whatever ``gamma`` is —
            pass ``scale=1/(1+ω)`` (the CHOCO paper's rescaling) or use more bits.
        seed: base seed of the codec's random stream (drawn per step and rank).
        check: cross-rank argument check on every call (see :func:`gossip_average`).
        **options: the codec's options (e.g. ``ratio=0.1``).

    Calling ``g(x)`` runs round ``g.step`` (or ``g(x, step)`` that one) and advances
    ``g.step``. With a compressor every call must pass arrays of the same count.

    Example:
        >>> import numpy as np
        >>> from gradcomm.comm import run_ranks
        >>> def fn(t):
        ...     g = Gossip(t, topology="exponential")
        ...     x = np.array([float(t.rank)])
        ...     for _ in range(2):
        ...         x = g(x)
        ...     return x.item(), g.step
        >>> run_ranks(4, fn)
        [(1.5, 2), (1.5, 2), (1.5, 2), (1.5, 2)]
    """

    def __init__(self, comm: Any = None, *, topology: str | Topology = "ring",
                 weights: Weights = None, compressor: Any = None, gamma: float | None = None,
                 scale: float = 1.0, seed: int = 0, check: bool = True,
                 **options: Any) -> None:
        self.transport = get_transport(comm)
        self.topology = topologies.get(topology, self.transport.size)
        self.weights = weights
        self.check = bool(check)
        self.seed = int(seed)
        self.step = 0
        self.compressor = None
        if compressor is None:
            if options:
                raise ConfigError(f"unknown options {sorted(options)} (codec options need "
                                  "compressor=...)")
        else:
            from .. import compressors

            self.compressor = compressors.get(compressor, **options)
            if self.topology.time_varying and self.transport.size > 1:
                raise UnsupportedError(
                    f"compressed (CHOCO) gossip needs a static topology; {self.topology.key} "
                    "changes its peer every step. Use 'ring', 'torus' or 'complete'")
        lossy = self.compressor is not None and self.compressor.lossy
        self.gamma = float(gamma) if gamma is not None else (0.4 if lossy else 1.0)
        if not 0.0 < self.gamma <= 1.0:
            raise ConfigError(f"gamma must be in (0, 1], got {gamma!r}")
        self.scale = float(scale)
        if not 0.0 < self.scale <= 1.0:
            raise ConfigError(f"scale must be in (0, 1], got {scale!r}")
        self._scratch = _Scratch()
        self._plans: dict[Any, Any] = {}
        self._estimate: np.ndarray | None = None          # x̂ of this rank
        self._peer_estimates: dict[int, np.ndarray] = {}  # x̂_j of each neighbour

    # -- rounds ----------------------------------------------------------------------------
    def __call__(self, x: Any, step: int | None = None) -> Any:
        t = self.transport
        step = self.step if step is None else step
        # CHOCO updates its copy in place; dense gossip only reads x
        buf, meta = _flat_input(x) if self.compressor is None else arrays.to_flat(x)
        setup = _Setup(t, self.topology, step, self.weights, meta.dtype, self._plans)
        if setup.problem is None and self.compressor is not None:
            try:
                self._check_state(buf.size, _ACC[meta.dtype])
            except GradcommError as exc:
                setup.problem = exc
        if self.check:
            agree(t, "gossip", count=int(buf.size), dtype=meta.dtype, topology=setup.key,
                  step=int(setup.step), weights=setup.whash,
                  compressor=None if self.compressor is None else repr(self.compressor),
                  gamma=repr(self.gamma), scale=repr(self.scale))
        if setup.problem is not None:
            raise setup.problem
        assert setup.plan is not None
        if self.compressor is None:
            out = mix(t, buf, meta.dtype, setup.plan, self._scratch)
        else:
            out = self._choco(buf, meta.dtype, setup.plan, int(step))
        self.step = int(step) + 1
        return arrays.from_flat(out, meta)

    def _check_state(self, n: int, dt: np.dtype) -> None:
        est = self._estimate
        if est is not None and (est.size != n or est.dtype != dt):
            raise ConfigError(f"this Gossip holds CHOCO estimates of {est.size} {est.dtype} "
                              f"values; got {n} values needing {dt} (one Gossip object per "
                              "buffer)")

    def _choco(self, buf: np.ndarray, dtype: str, plan: Plan, step: int) -> np.ndarray:
        t, c, n = self.transport, self.compressor, buf.size
        assert c is not None
        acc_dt = _ACC[dtype]
        recv_from = self.topology.recv_from(t.rank, 0)
        send_to = self.topology.send_to(t.rank, 0)
        if self._estimate is None:
            self._estimate = np.zeros(n, acc_dt)
            self._peer_estimates = {j: np.zeros(n, acc_dt) for j in recv_from}
        # buf is a fresh copy (to_flat): for float32/64 it becomes the result in place
        x = buf if buf.dtype == acc_dt else _widen(buf, dtype, np.empty(n, acc_dt))
        diff = np.subtract(x, self._estimate, out=self._scratch.get("diff", n, acc_dt))
        seed = (self.seed, step) if c.shared_seed else \
            (self.seed, step, t.rank)
        payload = c.compress(diff, seed=seed)
        data = payload.to_bytes()
        received = self._exchange_payloads(data, recv_from, send_to, n, acc_dt.name)
        self._add_decoded(self._estimate, payload, n, "this rank")
        for j in recv_from:
            self._add_decoded(self._peer_estimates[j], received[j], n, f"rank {j}")
        est = self._peer_estimates
        acc = self._scratch.get("acc", n, acc_dt)
        tmp = self._scratch.get("tmp", n, acc_dt)
        _weighted_sum(plan.terms, lambda j: self._estimate if j == t.rank else est[j],
                      "float64" if acc_dt == np.float64 else "float32", acc, lambda: tmp)
        np.subtract(acc, self._estimate, out=acc)
        acc *= acc_dt.type(self.gamma)
        x += acc
        return _narrow(x, dtype)

    def _bound(self, n: int, dtype: str) -> int:
        """Largest payload a peer may announce: the codec's ``max_nbytes`` when it
        declares one, else a generous 64 KiB + 3 float64 per value."""
        try:
            return int(self.compressor.max_nbytes(n, dtype))
        except GradcommError:           # UnsupportedError: no declared bound
            return 64 * 1024 + 3 * 8 * n

    def _exchange_payloads(self, data: np.ndarray, recv_from: tuple[int, ...],
                           send_to: tuple[int, ...], n: int, dtype: str) -> dict[int, Any]:
        from ..compressors.base import Payload

        t = self.transport
        size = np.array([data.size], np.int64)
        sizes = {j: self._scratch.get(("size", j), 1, np.dtype(np.int64)) for j in recv_from}
        t.waitall([t.irecv(sizes[j], j, TAG_GOSSIP) for j in recv_from] +
                  [t.isend(size, k, TAG_GOSSIP) for k in send_to])
        bound = self._bound(n, dtype)
        recv = {}
        for j in recv_from:
            m = int(sizes[j][0])
            if not 0 < m <= bound:
                raise TransportError(f"rank {t.rank}: rank {j} announced a gossip payload of "
                                     f"{m} bytes; expected 1..{bound} for {n} values")
            recv[j] = np.empty(m, np.uint8)
        t.waitall([t.irecv(recv[j], j, TAG_GOSSIP) for j in recv_from] +
                  [t.isend(data, k, TAG_GOSSIP) for k in send_to])
        return {j: Payload.from_bytes(recv[j], max_nbytes=bound) for j in recv_from}

    def _add_decoded(self, estimate: np.ndarray, payload: Any, n: int, who: str) -> None:
        assert self.compressor is not None
        if payload.codec != self.compressor.name:
            raise PayloadError(f"gossip payload from {who} is codec {payload.codec!r}, "
                               f"expected {self.compressor.name!r}")
        q = self.compressor.decompress(payload)
        if q.size != n:
            raise PayloadError(f"gossip payload from {who} decodes to {q.size} values, "
                               f"expected {n}")
        q = q.reshape(-1)
        if self.scale != 1.0:
            q = q * q.dtype.type(self.scale)
        estimate += q

    # -- state -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Step counter and CHOCO estimates (numpy arrays), for checkpoints.

        Example:
            >>> from gradcomm.comm import run_ranks
            >>> run_ranks(1, lambda t: sorted(Gossip(t).state_dict()))[0]
            ['compressor', 'estimate', 'gamma', 'peer_estimates', 'rank', 'size', 'step', 'topology', 'version']
        """
        c = self.compressor
        return {
            "version": STATE_VERSION, "topology": self.topology.key,
            "size": self.transport.size, "rank": self.transport.rank, "step": self.step,
            "compressor": None if c is None else {"name": c.name, "config": c.get_config()},
            "gamma": self.gamma,
            "estimate": None if self._estimate is None else self._estimate.copy(),
            "peer_estimates": {int(j): v.copy() for j, v in self._peer_estimates.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output (of the same rank, topology and codec)."""
        try:
            version, key = state["version"], state["topology"]
            size, rank, step = state["size"], state["rank"], state["step"]
            codec, est, peers = state["compressor"], state["estimate"], state["peer_estimates"]
        except (KeyError, TypeError) as exc:
            raise ConfigError(f"not a Gossip state_dict (missing {exc})") from None
        if version != STATE_VERSION:
            raise ConfigError(f"Gossip state version {version}; this gradcomm reads "
                              f"{STATE_VERSION}")
        me = (self.topology.key, self.transport.size, self.transport.rank)
        if (key, size, rank) != me:
            raise ConfigError(f"Gossip state of topology {key} rank {rank}/{size} loaded into "
                              f"{me[0]} rank {me[2]}/{me[1]}")
        name = None if self.compressor is None else self.compressor.name
        if (codec or {}).get("name") != name:
            raise ConfigError(f"Gossip state for compressor {codec!r}, this one uses {name!r}")
        self.step = _check_step(step)
        if est is None:
            self._estimate, self._peer_estimates = None, {}
            return
        est = np.array(est, copy=True).reshape(-1)
        want = set(self.topology.recv_from(self.transport.rank, 0))
        peer_est = {int(j): np.array(v, dtype=est.dtype, copy=True).reshape(-1)
                    for j, v in dict(peers).items()}
        if set(peer_est) != want or any(v.size != est.size for v in peer_est.values()):
            raise ConfigError(f"Gossip state: estimates for peers {sorted(peer_est)} of sizes "
                              f"{[v.size for v in peer_est.values()]}; expected peers "
                              f"{sorted(want)} of {est.size} values")
        self._estimate, self._peer_estimates = est, peer_est


def consensus_distance(x: Any, comm: Any = None) -> float:
    """``(1/p) Σ_i ‖x_i − x̄‖²`` over the ranks (two allreduces); equal on every rank.

    Example:
        >>> import numpy as np
        >>> from gradcomm.comm import run_ranks
        >>> run_ranks(2, lambda t: consensus_distance(np.array([float(t.rank), 0.0]), t))
        [0.25, 0.25]
    """
    t = get_transport(comm)
    buf, meta = arrays.to_flat(x)
    _check_dtype(meta.dtype)
    v = _widen(buf, meta.dtype, np.empty(buf.size, np.float32)).astype(np.float64)
    mean = dense_allreduce(t, v.copy(), "mean", "float64", "recursive_doubling")
    local = np.array([float(np.sum((v - mean) ** 2))])
    return float(dense_allreduce(t, local, "sum", "float64", "recursive_doubling")[0]) / t.size


__all__ = ["Gossip", "consensus_distance", "gossip_average", "mix"]
