"""Decentralized training for PyTorch: each rank mixes its parameters with its neighbours'.

:class:`DecentralizedSGD` wraps any ``torch.optim`` optimizer. Each rank keeps its own
model and trains on its own data shard (no DDP, no gradient allreduce); after every
``every``-th optimizer step it runs one gossip round on all parameters (D-PSGD, Lian et
al. 2017):

1. copy the parameters into one flat buffer per (dtype, device);
2. one round of :class:`~gradcomm.collectives.gossip.Gossip` on that buffer
   (``topology``/``weights``; with a ``compressor``: CHOCO-gossip with step ``gamma``);
3. copy the mixed values back into the parameters.

A round costs ``deg`` neighbour messages of the model's size (ring: 2, exponential: 1)
instead of an allreduce; the models stay close to their average (see
:meth:`~DecentralizedSGD.consensus_distance`) and the average follows SGD. Evaluate the
averaged model (:meth:`~DecentralizedSGD.average_parameters`) at the end.

Tuning: start every rank from the same initial parameters (same seed, or call
``average_parameters()`` once); ``exponential`` mixes fastest per message; on a ring with
many ranks, gossip more often (``every=1``) or use ``torus``.

Launch with ``torchrun`` (``dist.init_process_group("gloo")``) or ``mpirun``; ``comm=None``
picks torch's default group when initialised, else ``MPI.COMM_WORLD``.

Example:
    >>> import torch
    >>> from gradcomm.comm import run_ranks
    >>> def fn(t):
    ...     model = torch.nn.Linear(2, 1, bias=False)
    ...     torch.nn.init.constant_(model.weight, float(t.rank))
    ...     opt = DecentralizedSGD(torch.optim.SGD(model.parameters(), lr=0.0), t,
    ...                            topology="complete")
    ...     opt.step()
    ...     return model.weight.tolist()
    >>> run_ranks(3, fn)[0]
    [[1.0, 1.0]]
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import numpy as np

from ..collectives.gossip import Gossip, consensus_distance
from ..collectives.topologies import Topology
from ..comm import get_transport
from ..errors import ConfigError

STATE_VERSION = 1


class DecentralizedSGD:
    """Wrap ``optimizer``: ``step()`` steps it, then gossips the parameters.

    Args:
        optimizer: a ``torch.optim.Optimizer`` over this rank's model.
        comm: mpi4py communicator, torch ProcessGroup, gradcomm Transport, or None.
        topology, weights: as for :func:`gradcomm.gossip_average`.
        compressor, gamma, scale, seed, **options: compressed (CHOCO) gossip, as for
            :class:`~gradcomm.collectives.gossip.Gossip`.
        every: gossip after every ``every``-th step (1: after each).
        check: cross-rank argument check on the first round only (``"first"``, the
            default), on every round (True) or never (False).

    ``zero_grad``, ``param_groups`` and ``state`` are the wrapped optimizer's.
    """

    def __init__(self, optimizer: Any, comm: Any = None, *, topology: str | Topology = "ring",
                 weights: Any = None, compressor: Any = None, gamma: float | None = None,
                 scale: float = 1.0, seed: int = 0, every: int = 1,
                 check: bool | str = "first",
                 **options: Any) -> None:
        import torch

        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ConfigError(f"every must be an integer >= 1, got {every!r}")
        if check not in (True, False, "first"):
            raise ConfigError(f"check must be True, False or 'first', got {check!r}")
        self.optimizer = optimizer
        self.transport = get_transport(comm)
        self.every, self.check, self.steps = every, check, 0
        seen: set[int] = set()
        self._groups: dict[tuple[str, str], list[Any]] = {}
        for group in optimizer.param_groups:
            for p in group["params"]:
                if id(p) in seen:
                    continue
                seen.add(id(p))
                if not torch.is_floating_point(p):
                    raise ConfigError(f"parameters must be floating point, got {p.dtype}")
                self._groups.setdefault((str(p.dtype), str(p.device)), []).append(p)
        kw = dict(topology=topology, weights=weights, compressor=compressor, gamma=gamma,
                  scale=scale, seed=seed, check=check is not False, **options)
        self._gossip = {key: Gossip(self.transport, **kw) for key in self._groups}
        self._flat: dict[tuple[str, str], Any] = {}

    # -- optimizer interface ----------------------------------------------------------------
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        return self.optimizer.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """The optimizer's step, then (every ``every`` steps) one gossip round."""
        loss = self.optimizer.step() if closure is None else self.optimizer.step(closure)
        self.steps += 1
        if self.steps % self.every == 0:
            self.mix()
        return loss

    # -- mixing -----------------------------------------------------------------------------
    def _parameters(self) -> Iterable[tuple[tuple[str, str], list[Any]]]:
        return sorted(self._groups.items())     # same order on every rank

    def _flatten(self, key: tuple[str, str], params: list[Any]) -> Any:
        import torch

        flat = self._flat.get(key)
        n = sum(p.numel() for p in params)
        if flat is None or flat.numel() != n:
            flat = self._flat[key] = torch.empty(n, dtype=params[0].dtype,
                                                 device=params[0].device)
        torch.cat([p.detach().reshape(-1) for p in params], out=flat)
        return flat

    @staticmethod
    def _unflatten(flat: Any, params: list[Any]) -> None:
        off = 0
        for p in params:
            n = p.numel()
            p.detach().copy_(flat[off:off + n].view_as(p))
            off += n

    def mix(self) -> None:
        """One gossip round on all parameters (``step`` calls it)."""
        import torch

        with torch.no_grad():
            for key, params in self._parameters():
                g = self._gossip[key]
                mixed = g(self._flatten(key, params))
                if self.check == "first":
                    g.check = False
                self._unflatten(mixed, params)

    def average_parameters(self) -> None:
        """Replace every rank's parameters by the exact average over all ranks (one
        allreduce): for a common start, or the final model."""
        import torch

        from .._allreduce import allreduce

        with torch.no_grad():
            for key, params in self._parameters():
                self._unflatten(allreduce(self._flatten(key, params), self.transport,
                                          op="mean"), params)

    def consensus_distance(self) -> float:
        """``(1/p) Σ_i ‖θ_i − θ̄‖²`` over all parameters; equal on every rank."""
        import torch

        with torch.no_grad():
            parts = [torch.cat([p.detach().reshape(-1).double().cpu() for p in params])
                     for _, params in self._parameters()]
        flat = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64)
        return consensus_distance(flat, self.transport)

    # -- state ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The optimizer's state, the step count and the gossip state (tensors and plain
        types only, so ``torch.load(weights_only=True)`` reads it)."""
        import torch

        def tensors(v: Any) -> Any:
            if isinstance(v, np.ndarray):
                return torch.from_numpy(v)
            if isinstance(v, dict):
                return {k: tensors(x) for k, x in v.items()}
            return v

        return {"version": STATE_VERSION, "steps": self.steps,
                "optimizer": self.optimizer.state_dict(),
                "gossip": {f"{d}@{dev}": tensors(g.state_dict())
                           for (d, dev), g in sorted(self._gossip.items())}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output."""
        def arrays(v: Any) -> Any:
            if hasattr(v, "numpy") and hasattr(v, "detach"):
                return v.detach().cpu().numpy()
            if isinstance(v, dict):
                return {k: arrays(x) for k, x in v.items()}
            return v

        try:
            version, steps = state["version"], state["steps"]
            opt, gossip = state["optimizer"], state["gossip"]
        except (KeyError, TypeError) as exc:
            raise ConfigError(f"not a DecentralizedSGD state_dict (missing {exc})") from None
        if version != STATE_VERSION:
            raise ConfigError(f"DecentralizedSGD state version {version}; this gradcomm reads "
                              f"{STATE_VERSION}")
        mine = {f"{d}@{dev}": g for (d, dev), g in self._gossip.items()}
        if set(gossip) != set(mine):
            raise ConfigError(f"DecentralizedSGD state for parameter groups {sorted(gossip)}, "
                              f"this one has {sorted(mine)}")
        for k, g in mine.items():
            g.load_state_dict(arrays(gossip[k]))
            g.check = self.check is not False       # re-check after a restore
        self.optimizer.load_state_dict(opt)
        self.steps = int(steps)


__all__ = ["DecentralizedSGD"]
