"""Gossip (neighbour) averaging: each rank mixes its array with its neighbours'.

One round on rank ``i`` is ``x_i ← Σ_j W[i, j] · x_j`` for the topology's mixing matrix
``W`` (see :mod:`gradcomm.collectives.topologies`; the round itself is
:func:`gradcomm.collectives.mixing.mix`): terms combined in ascending rank order,
16-bit floats accumulated in float32 and rounded once, so ranks with the same inputs get
the same bytes.

Cost per round: ``deg`` messages of ``n`` values each way (ring: 2, torus: 4,
exponential: 1, complete: p − 1) instead of an allreduce's ``2(p−1)/p · n`` in
``log p`` to ``2(p−1)`` steps. Repeated rounds contract the consensus distance
``(1/p) Σ‖x_i − x̄‖²`` by at least ``λ₂(W)²`` per round and keep ``x̄`` (for doubly
stochastic ``W``, which the defaults are).

Floating dtypes only (float16, bfloat16, float32, float64): averaging integers would have
to round, so integer arrays raise :class:`~gradcomm.errors.ConfigError`.

:class:`Gossip` is the stateful form: it reuses receive buffers, counts steps, and with a
``compressor`` runs CHOCO-gossip (:mod:`gradcomm.collectives.choco`), which exchanges only
compressed differences and preserves the sum of the ``x_i`` whatever the codec's error.

Example:
    >>> import numpy as np
    >>> from gradcomm.comm import run_ranks
    >>> run_ranks(4, lambda t: gossip_average(np.array([3.0 * t.rank]), t).tolist())
    [[4.0], [3.0], [6.0], [5.0]]
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import arrays
from ..comm import get_transport
from ..errors import ConfigError, GradcommError, UnsupportedError
from . import dense_allreduce, topologies
from ._check import agree
from .choco import Choco
from .mixing import (ACC, Scratch, Setup, Weights, check_dtype, check_step, flat_input, mix,
                     widen)
from .topologies import Topology

STATE_VERSION = 1


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
    buf, meta = flat_input(x)
    setup = Setup(t, topology, step, weights, meta.dtype)
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
        self._scratch = Scratch()
        self._plans: dict[Any, Any] = {}
        self._choco = None if self.compressor is None else Choco(
            self.transport, self.topology, self.compressor, gamma=self.gamma,
            scale=self.scale, seed=self.seed)

    # -- rounds ----------------------------------------------------------------------------
    def __call__(self, x: Any, step: int | None = None) -> Any:
        t = self.transport
        step = self.step if step is None else step
        # CHOCO updates its copy in place; dense gossip only reads x
        buf, meta = flat_input(x) if self.compressor is None else arrays.to_flat(x)
        setup = Setup(t, self.topology, step, self.weights, meta.dtype, self._plans)
        if setup.problem is None and self._choco is not None:
            try:
                self._choco.check_state(buf.size, ACC[meta.dtype])
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
        if self._choco is None:
            out = mix(t, buf, meta.dtype, setup.plan, self._scratch)
        else:
            out = self._choco.round(buf, meta.dtype, setup.plan, int(step))
        self.step = int(step) + 1
        return arrays.from_flat(out, meta)

    # -- state -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Step counter and CHOCO estimates (numpy arrays), for checkpoints.

        Example:
            >>> from gradcomm.comm import run_ranks
            >>> run_ranks(1, lambda t: sorted(Gossip(t).state_dict()))[0]
            ['compressor', 'estimate', 'gamma', 'peer_estimates', 'rank', 'size', 'step', 'topology', 'version']
        """
        c, ch = self.compressor, self._choco
        return {
            "version": STATE_VERSION, "topology": self.topology.key,
            "size": self.transport.size, "rank": self.transport.rank, "step": self.step,
            "compressor": None if c is None else {"name": c.name, "config": c.get_config()},
            "gamma": self.gamma,
            "estimate": None if ch is None or ch.estimate is None else ch.estimate.copy(),
            "peer_estimates": {} if ch is None else
            {int(j): v.copy() for j, v in ch.peer_estimates.items()},
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
        self.step = check_step(step)
        if est is None:
            if self._choco is not None:
                self._choco.estimate, self._choco.peer_estimates = None, {}
            return
        est = np.array(est, copy=True).reshape(-1)
        want = set(self.topology.recv_from(self.transport.rank, 0))
        peer_est = {int(j): np.array(v, dtype=est.dtype, copy=True).reshape(-1)
                    for j, v in dict(peers).items()}
        if set(peer_est) != want or any(v.size != est.size for v in peer_est.values()):
            raise ConfigError(f"Gossip state: estimates for peers {sorted(peer_est)} of sizes "
                              f"{[v.size for v in peer_est.values()]}; expected peers "
                              f"{sorted(want)} of {est.size} values")
        if self._choco is None:
            raise ConfigError("Gossip state holds CHOCO estimates; this Gossip has no "
                              "compressor")
        self._choco.estimate, self._choco.peer_estimates = est, peer_est


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
    check_dtype(meta.dtype)
    v = widen(buf, meta.dtype, np.empty(buf.size, np.float32)).astype(np.float64)
    mean = dense_allreduce(t, v.copy(), "mean", "float64", "recursive_doubling")
    local = np.array([float(np.sum((v - mean) ** 2))])
    return float(dense_allreduce(t, local, "sum", "float64", "recursive_doubling")[0]) / t.size


__all__ = ["Gossip", "consensus_distance", "gossip_average", "mix"]
