"""Gossip topologies and their mixing (weight) matrices.

A topology says, for each rank and step, which peers a rank receives from and sends to.
A mixing matrix ``W`` (p × p) says how a round combines them: rank ``i`` ends with
``sum_j W[i, j] * x_j``. Row ``i`` may be non-zero only on ``i`` itself and on the peers
``i`` receives from at that step.

- ``ring``: the peers at distance ±1 (one peer for p = 2).
- ``torus``: a 2-D wrap-around grid ``rows × cols = p``; each rank talks to the ranks
  above, below, left and right. The default shape is the squarest one with both sides
  ≥ 2 (p = 12 → 3 × 4); a prime p, or p < 4, does not fit (pass ``Torus(p, shape=...)``
  or use another topology).
- ``exponential``: one peer per step, rotating through distances 1, 2, 4, ... < p (as
  SGP does): at step ``s`` rank ``i`` sends to ``i + d`` and receives from ``i - d``
  (mod p) with ``d = 2^(s mod m)``, ``m = ceil(log2 p)``. The graph is directed but every
  rank has one in- and one out-peer, so the default ``W = (I + shift_d) / 2`` is doubly
  stochastic: the average is preserved without push-sum weights. For p a power of two
  the product of the ``m`` matrices of one period is exactly ``J / p`` (exact averaging
  in log2(p) rounds).
- ``complete``: every rank talks to every other; one round is the exact average.

Default weights are Metropolis–Hastings, ``W[i, j] = 1 / (1 + max(d_i, d_j))`` on an edge
and the rest of the row on ``W[i, i]``; every built-in topology is regular, so this is
``1 / (d + 1)`` everywhere and doubly stochastic. Custom weights are validated by
:func:`validate_weights`.

Example:
    >>> get("ring", 4).matrix(0)
    array([[0.33333333, 0.33333333, 0.        , 0.33333333],
           [0.33333333, 0.33333333, 0.33333333, 0.        ],
           [0.        , 0.33333333, 0.33333333, 0.33333333],
           [0.33333333, 0.        , 0.33333333, 0.33333333]])
    >>> get("exponential", 8).recv_from(5, step=2), get("torus", 12).shape
    ((1,), (3, 4))
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ..errors import ConfigError

NAMES = ("ring", "torus", "exponential", "complete")
#: tolerance on row sums of custom weights
ROW_SUM_TOL = 1e-6


class Topology:
    """The communication graph of ``size`` ranks; subclasses define ``recv_from``."""

    name: str = "topology"
    #: number of distinct steps before the graph repeats (1: static)
    period: int = 1
    #: every rank has the same number of peers at each step (all built-in graphs): the
    #: Metropolis–Hastings row is then 1 / (d + 1) without looking at the peers' degrees
    regular: bool = False

    def __init__(self, size: int) -> None:
        if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 1:
            raise ConfigError(f"a topology needs a rank count >= 1, got {size!r}")
        self.size = int(size)

    @property
    def key(self) -> str:
        """A string that names the graph exactly (used in cross-rank checks)."""
        return self.name

    @property
    def time_varying(self) -> bool:
        return self.period > 1

    def recv_from(self, rank: int, step: int = 0) -> tuple[int, ...]:
        """Peers whose values ``rank`` receives at ``step`` (ascending, never ``rank``)."""
        raise NotImplementedError

    def send_to(self, rank: int, step: int = 0) -> tuple[int, ...]:
        """Peers ``rank`` sends to at ``step`` (for symmetric graphs: ``recv_from``)."""
        return self.recv_from(rank, step)

    def adjacency(self, step: int = 0) -> np.ndarray:
        """Boolean p × p matrix: ``A[i, j]`` iff ``i`` receives from ``j`` (``i != j``)."""
        a = np.zeros((self.size, self.size), bool)
        for i in range(self.size):
            a[i, list(self.recv_from(i, step))] = True
        return a

    def row(self, rank: int, step: int = 0) -> tuple[tuple[int, float], ...]:
        """Rank's default (Metropolis–Hastings) weights as ``(peer, weight)``, ascending,
        self included."""
        peers = self.recv_from(rank, step)
        d = len(peers)
        degs = [d] * d if self.regular else [len(self.recv_from(j, step)) for j in peers]
        if all(dj == d for dj in degs):          # regular: exactly 1 / (d + 1)
            w = {j: 1.0 / (d + 1) for j in peers}
            w[rank] = 1.0 / (d + 1)
        else:
            w = {j: 1.0 / (1 + max(d, dj)) for j, dj in zip(peers, degs)}
            w[rank] = 1.0 - math.fsum(w.values())
        return tuple(sorted(w.items()))

    def matrix(self, step: int = 0) -> np.ndarray:
        """The default p × p mixing matrix at ``step`` (float64)."""
        m = np.zeros((self.size, self.size))
        for i in range(self.size):
            for j, w in self.row(i, step):
                m[i, j] = w
        return m

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.size})"


class Ring(Topology):
    """Each rank talks to ``rank ± 1``."""

    name = "ring"
    regular = True

    def recv_from(self, rank: int, step: int = 0) -> tuple[int, ...]:
        p = self.size
        return tuple(sorted({(rank - 1) % p, (rank + 1) % p} - {rank}))


class Torus(Topology):
    """A ``rows × cols`` wrap-around grid; rank ``i`` sits at ``(i // cols, i % cols)``.

    Example:
        >>> Torus(6).shape, Torus(6).recv_from(0)
        ((2, 3), (1, 2, 3))
    """

    name = "torus"
    regular = True

    def __init__(self, size: int, shape: tuple[int, int] | None = None) -> None:
        super().__init__(size)
        p = self.size
        if shape is None:
            rows = max((r for r in range(1, math.isqrt(p) + 1) if p % r == 0), default=1)
            if p > 1 and rows < 2:
                raise ConfigError(
                    f"topology 'torus' needs a rank count p = rows × cols with rows, cols >= 2;"
                    f" {p} ranks do not fit ({'prime' if p > 3 else 'fewer than 4'}); use "
                    f"'ring' or 'exponential', or pass Torus({p}, shape=(rows, cols))")
            shape = (rows, p // rows) if p > 1 else (1, 1)
        try:
            r, c = (int(v) for v in shape)
        except (TypeError, ValueError):
            raise ConfigError(f"torus shape must be (rows, cols), got {shape!r}") from None
        if r < 1 or c < 1 or r * c != p:
            raise ConfigError(f"torus shape {r} × {c} does not hold {p} ranks")
        self.shape = (r, c)

    @property
    def key(self) -> str:
        return f"torus({self.shape[0]}x{self.shape[1]})"

    def recv_from(self, rank: int, step: int = 0) -> tuple[int, ...]:
        r, c = self.shape
        a, b = divmod(rank, c)
        peers = {((a - 1) % r) * c + b, ((a + 1) % r) * c + b,
                 a * c + (b - 1) % c, a * c + (b + 1) % c}
        return tuple(sorted(peers - {rank}))

    def __repr__(self) -> str:
        return f"Torus({self.size}, shape={self.shape})"


class Exponential(Topology):
    """One peer per step: send to ``rank + 2^k``, receive from ``rank - 2^k`` (mod p),
    ``k = step mod ceil(log2 p)``.

    Example:
        >>> e = Exponential(6)
        >>> e.period, [e.send_to(0, s) for s in range(4)]
        (3, [(1,), (2,), (4,), (1,)])
    """

    name = "exponential"
    regular = True

    def __init__(self, size: int) -> None:
        super().__init__(size)
        self.period = max(1, (self.size - 1).bit_length())

    def distance(self, step: int) -> int:
        return 1 << (step % self.period)

    def recv_from(self, rank: int, step: int = 0) -> tuple[int, ...]:
        if self.size == 1:
            return ()
        return ((rank - self.distance(step)) % self.size,)

    def send_to(self, rank: int, step: int = 0) -> tuple[int, ...]:
        if self.size == 1:
            return ()
        return ((rank + self.distance(step)) % self.size,)


class Complete(Topology):
    """Every rank talks to every other rank."""

    name = "complete"
    regular = True

    def recv_from(self, rank: int, step: int = 0) -> tuple[int, ...]:
        return tuple(j for j in range(self.size) if j != rank)


_CLASSES: dict[str, Callable[[int], Topology]] = {
    "ring": Ring, "torus": Torus, "exponential": Exponential, "complete": Complete}


def get(topology: str | Topology, size: int) -> Topology:
    """The topology named ``topology`` for ``size`` ranks (an instance must match ``size``).

    Example:
        >>> get("complete", 3).recv_from(1)
        (0, 2)
    """
    if isinstance(topology, Topology):
        if topology.size != size:
            raise ConfigError(f"{topology!r} is for {topology.size} ranks, this group has "
                              f"{size}")
        return topology
    cls = _CLASSES.get(topology) if isinstance(topology, str) else None
    if cls is None:
        raise ConfigError(f"unknown topology {topology!r}; known: {', '.join(NAMES)} "
                          "(or a gradcomm.collectives.topologies.Topology)")
    return cls(size)


def validate_weights(weights: Any, topo: Topology, step: int = 0) -> np.ndarray:
    """Check a custom mixing matrix against ``topo`` at ``step``; return it as float64.

    It must be p × p, finite, non-negative, with rows summing to one (within
    ``ROW_SUM_TOL``), and non-zero off the diagonal only where the topology has an edge
    (``W[i, j] > 0`` needs ``j`` in ``recv_from(i, step)``). Columns summing to one too
    (doubly stochastic) is what preserves the global average; it is not required.

    Example:
        >>> validate_weights([[0.5, 0.5], [0.5, 0.5]], get("ring", 2)).tolist()
        [[0.5, 0.5], [0.5, 0.5]]
        >>> validate_weights([[0.5, 0.4], [0.5, 0.5]], get("ring", 2))
        Traceback (most recent call last):
        ...
        gradcomm.errors.ConfigError: gossip weights: row 0 sums to 0.9, not 1
    """
    p = topo.size
    try:
        w = np.array(weights, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"gossip weights must be a {p} × {p} array of numbers: {exc}") \
            from None
    if w.shape != (p, p):
        raise ConfigError(f"gossip weights must have shape ({p}, {p}) for {p} ranks, got "
                          f"{w.shape}")
    if not np.isfinite(w).all():
        raise ConfigError("gossip weights contain NaN or infinity")
    if (w < 0).any():
        i, j = np.argwhere(w < 0)[0]
        raise ConfigError(f"gossip weights must be non-negative; W[{i}, {j}] = {w[i, j]:g}")
    sums = w.sum(axis=1)
    bad = np.flatnonzero(np.abs(sums - 1.0) > ROW_SUM_TOL)
    if bad.size:
        raise ConfigError(f"gossip weights: row {bad[0]} sums to {sums[bad[0]]:.6g}, not 1")
    off = (w != 0) & ~topo.adjacency(step)
    np.fill_diagonal(off, False)
    if off.any():
        i, j = np.argwhere(off)[0]
        raise ConfigError(f"gossip weights: W[{i}, {j}] = {w[i, j]:g} but {topo.key} has no "
                          f"edge {j} -> {i} at step {step}")
    return w


@dataclass(frozen=True)
class Plan:
    """What one rank does in one round: receive from, send to, and combine ``terms``
    ``(peer, weight)`` in ascending rank order (self included)."""

    recv_from: tuple[int, ...]
    send_to: tuple[int, ...]
    terms: tuple[tuple[int, float], ...]


def plan(topo: Topology, rank: int, step: int, weights: np.ndarray | None = None) -> Plan:
    """The round of ``rank`` at ``step``: default weights, or a validated ``weights`` matrix
    (then only the non-zero entries cause messages).

    Example:
        >>> plan(get("ring", 4), 0, 0)
        Plan(recv_from=(1, 3), send_to=(1, 3), terms=((0, 0.3333333333333333), (1, 0.3333333333333333), (3, 0.3333333333333333)))
    """
    if weights is None:
        return Plan(topo.recv_from(rank, step), topo.send_to(rank, step), topo.row(rank, step))
    p = topo.size
    recv = tuple(j for j in range(p) if j != rank and weights[rank, j] != 0)
    send = tuple(k for k in range(p) if k != rank and weights[k, rank] != 0)
    terms = tuple((j, float(weights[rank, j])) for j in range(p) if weights[rank, j] != 0)
    return Plan(recv, send, terms)


def spectral_factor(matrices: list[np.ndarray]) -> float:
    """``‖W_k ⋯ W_1 − J/p‖₂²``: the factor by which the consensus distance
    (1/p)·Σ‖x_i − x̄‖² shrinks at least over these rounds, for doubly-stochastic ``W``
    (for one symmetric ``W`` it is ``λ₂(W)²``, λ₂ the second largest |eigenvalue|).

    Example:
        >>> round(spectral_factor([get("ring", 4).matrix()]), 6)
        0.111111
        >>> e = get("exponential", 8)
        >>> round(spectral_factor([e.matrix(s) for s in range(e.period)]), 12)
        0.0
    """
    p = matrices[0].shape[0]
    prod = np.eye(p)
    for w in matrices:
        prod = w @ prod
    return float(np.linalg.norm(prod - np.full((p, p), 1.0 / p), 2) ** 2)


__all__ = ["NAMES", "Complete", "Exponential", "Plan", "Ring", "Topology", "Torus", "get",
           "plan", "spectral_factor", "validate_weights"]
