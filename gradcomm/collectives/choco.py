"""CHOCO-gossip (Koloskova et al., 2019): gossip rounds that send compressed differences.

Every rank keeps a public estimate ``x̂_j`` of itself and of each neighbour. One round on
rank ``i``:

1. ``q_i = C(x_i − x̂_i)`` (the codec's payload, seeded per step and rank);
2. exchange payload sizes, then payloads, with the neighbours (tag ``TAG_GOSSIP``; a
   peer's size and payload are bounded by what ``n`` values can encode);
3. add the decoded ``q_i`` to ``x̂_i`` and each received ``q_j`` to ``x̂_j`` (identical
   on every rank holding that copy);
4. ``x_i ← x_i + γ Σ_j W[i, j](x̂_j − x̂_i)``.

The sum of the ``x_i`` is preserved (to rounding) whatever the codec's error. Used by
:class:`gradcomm.collectives.gossip.Gossip` when it is given a compressor.

Example:
    >>> import numpy as np
    >>> from gradcomm.comm import run_ranks
    >>> from gradcomm.collectives import topologies
    >>> from gradcomm.compressors import get
    >>> def fn(t):
    ...     topo = topologies.get("complete", t.size)
    ...     c = Choco(t, topo, get("fp16"), gamma=1.0, scale=1.0, seed=0)
    ...     x = np.array([float(t.rank)], np.float32)
    ...     return c.round(x, "float32", topologies.plan(topo, t.rank, 0), 0).tolist()
    >>> run_ranks(2, fn)
    [[0.5], [0.5]]
"""

from __future__ import annotations

import numpy as np

from ..comm.base import TAG_GOSSIP, Transport
from ..compressors.base import Compressor
from ..compressors.payload import Payload
from ..errors import ConfigError, GradcommError, PayloadError, TransportError
from .mixing import ACC, Scratch, narrow, weighted_sum, widen
from .topologies import Plan, Topology


class Choco:
    """The CHOCO state of one rank (its estimate and its neighbours') and its rounds.

    ``gamma``: consensus step in (0, 1]; ``scale``: factor on every decoded difference
    (``1/(1+ω)`` for an unbiased codec of variance factor ω); ``seed``: base seed of the
    codec's random stream.
    """

    def __init__(self, t: Transport, topology: Topology, compressor: Compressor, *,
                 gamma: float, scale: float, seed: int) -> None:
        self.t, self.topology, self.compressor = t, topology, compressor
        self.gamma, self.scale, self.seed = gamma, scale, seed
        self.estimate: np.ndarray | None = None            # x̂ of this rank
        self.peer_estimates: dict[int, np.ndarray] = {}    # x̂_j of each neighbour
        self._scratch = Scratch()

    def check_state(self, n: int, dt: np.dtype) -> None:
        """ConfigError unless the estimates (if any) hold ``n`` values of ``dt``."""
        est = self.estimate
        if est is not None and (est.size != n or est.dtype != dt):
            raise ConfigError(f"this Gossip holds CHOCO estimates of {est.size} {est.dtype} "
                              f"values; got {n} values needing {dt} (one Gossip object per "
                              "buffer)")

    def round(self, buf: np.ndarray, dtype: str, plan: Plan, step: int) -> np.ndarray:
        """One round on flat storage ``buf`` (a fresh copy: float32/64 become the result
        in place); returns the new values as storage of ``dtype``."""
        t, c, n = self.t, self.compressor, buf.size
        acc_dt = ACC[dtype]
        recv_from = self.topology.recv_from(t.rank, 0)
        send_to = self.topology.send_to(t.rank, 0)
        if self.estimate is None:
            self.estimate = np.zeros(n, acc_dt)
            self.peer_estimates = {j: np.zeros(n, acc_dt) for j in recv_from}
        x = buf if buf.dtype == acc_dt else widen(buf, dtype, np.empty(n, acc_dt))
        diff = np.subtract(x, self.estimate, out=self._scratch.get("diff", n, acc_dt))
        seed = (self.seed, step) if c.shared_seed else (self.seed, step, t.rank)
        payload = c.compress(diff, seed=seed)
        received = self._exchange(payload.to_bytes(), recv_from, send_to, n, acc_dt.name)
        self._add_decoded(self.estimate, payload, n, "this rank")
        for j in recv_from:
            self._add_decoded(self.peer_estimates[j], received[j], n, f"rank {j}")
        est, mine = self.peer_estimates, self.estimate
        acc = self._scratch.get("acc", n, acc_dt)
        tmp = self._scratch.get("tmp", n, acc_dt)
        weighted_sum(plan.terms, lambda j: mine if j == t.rank else est[j],
                     "float64" if acc_dt == np.float64 else "float32", acc, lambda: tmp)
        np.subtract(acc, mine, out=acc)
        acc *= acc_dt.type(self.gamma)
        x += acc
        return narrow(x, dtype)

    def _bound(self, n: int, dtype: str) -> int:
        """Largest payload a peer may announce: the codec's ``max_nbytes`` when it
        declares one, else a generous 64 KiB + 3 float64 per value."""
        try:
            return int(self.compressor.max_nbytes(n, dtype))
        except GradcommError:           # UnsupportedError: no declared bound
            return 64 * 1024 + 3 * 8 * n

    def _exchange(self, data: np.ndarray, recv_from: tuple[int, ...],
                  send_to: tuple[int, ...], n: int, dtype: str) -> dict[int, Payload]:
        t = self.t
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

    def _add_decoded(self, estimate: np.ndarray, payload: Payload, n: int, who: str) -> None:
        """``estimate += scale · decode(payload)``, decoded into a buffer of the ``n``
        values of ``estimate``'s dtype expected (a payload announcing another count or
        dtype is a PayloadError before anything is allocated)."""
        if payload.codec != self.compressor.name:
            raise PayloadError(f"gossip payload from {who} is codec {payload.codec!r}, "
                               f"expected {self.compressor.name!r}")
        q = self.compressor.decompress(payload, out=self._scratch.get("q", n, estimate.dtype))
        if self.scale != 1.0:
            q = q * q.dtype.type(self.scale)
        estimate += q


__all__ = ["Choco"]
