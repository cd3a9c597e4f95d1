"""1-bit Adam (Tang et al. 2021): dense Adam for a warm-up, then compressed momentum.

Compressing Adam's *gradients* fails: the second moment ``v`` of a compressed, error-
compensated gradient is not the gradient's, and the update ``m / sqrt(v)`` amplifies the
codec's noise where ``v`` is small. 1-bit Adam instead

1. runs ``warmup_steps`` of ordinary (AdamW) steps on the averaged gradient;
2. then freezes ``v`` (it changes slowly after the warm-up) and, at every step, each rank
   updates its momentum with its *local* gradient, ``m_r = b1 m + (1 - b1) g_r``, and the
   ranks average ``m_r`` through a codec with error feedback (``gradcomm.Allreduce``,
   default ``"onebit"``): one bit per element on the wire instead of 32. What is
   compressed is the *preconditioned* momentum ``m_r / (sqrt(v) + eps)`` (the frozen
   ``v`` is the same on every rank, so this is exact before compression): the codec's
   error is then in units of the update and not amplified where ``v`` is tiny. Sending
   ``m_r`` itself, as the paper does, diverged on digits, whose constant pixels have
   ``v = 0``: 1-bit's reconstruction of their zero momentum, divided by ``eps``, is huge;
3. updates ``p -= lr (m / (sqrt(v) + eps) + weight_decay p)`` (decoupled decay).

The frozen ``v`` has one floor: a coordinate whose gradient was 0 through the warm-up (a
unit that never fired) has ``v = 0``, and when it wakes, ``m / eps`` is ~1e5 times an
Adam step; one such coordinate killed the network on the synthetic task (loss 11, then
chance; bench/RESULTS.md, issue 13). Adam itself keeps ``v >= (1 - b2) g**2``, so each
compressed step raises the frozen ``v`` to that bound where the rank's gradient passes
it (``max``, nowhere else: the ranks' ``v`` may then differ, which the preconditioning
before the codec allows).

Any codec can carry the momentum (``compressor=``, with the DDP hook's defaults for
random-k's ratio and PowerSGD's rank). A dense reconstruction (1-bit, int8, TernGrad,
random-k's rescaled sample) replaces each rank's momentum. Top-k's is mostly zeros, and
replacing the momentum with it would wipe out what was not sent. So for a sparse codec
(``Compressor.sparse``) each rank keeps its own momentum, error feedback accumulates its
preconditioned value step after step until it is sent, and the update is the average
itself: each gradient still enters the updates with its whole weight, as in Adam, only
later. Top-k below 1 % first runs DGC's sparsity ramp (``ramp``, :data:`DEFAULT_RAMP`
steps per stage at 25 %, 6.25 %, 1.6 %, 0.4 %): without it, 0.1 % held the first
compressed steps' mass back until it was stale and lost 2.6 to 3.7 points at p = 4.

Use it with DDP by registering :func:`onebit_adam_hook` with the optimizer as its state:
during the warm-up the hook averages the gradients (gloo/NCCL's own allreduce), after it
the hook hands DDP the local gradient untouched (no communication: the optimizer
communicates the momentum). Without DDP (the same initial parameters on every rank) it
averages the warm-up gradients itself::

    opt = OneBitAdam(ddp.parameters(), lr=1e-3, warmup_steps=100)
    ddp.register_comm_hook(opt, onebit_adam_hook)

``state_dict()`` holds the moments, the step and the error-feedback residuals.

Example:
    >>> import torch
    >>> from gradcomm.comm import run_ranks
    >>> def fn(t):
    ...     w = torch.nn.Parameter(torch.ones(4))
    ...     opt = OneBitAdam([w], comm=t, lr=0.1, warmup_steps=1)
    ...     for _ in range(3):
    ...         w.grad = torch.full((4,), float(t.rank + 1))
    ...         opt.step()
    ...     return [round(x, 4) for x in w.tolist()]
    >>> a, b = run_ranks(2, fn); a == b
    True
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

from ..._allreduce import Allreduce
from ...compressors import _kernels
from ...errors import ConfigError
from .defaults import DEFAULT_WARMUP, default_options, default_ramp
from .ramp import SparsityRamp

#: ``ramp="auto"``'s steps per sparsity stage for top-k below 1 % (25 and 50 fell short
#: of uncompressed AdamW at p = 4 on the synthetic task: bench/RESULTS.md, issue 13)
DEFAULT_RAMP = 75


def _flat(t: torch.Tensor) -> Any:
    """``t`` (flat, contiguous) as the kernels take it: a numpy view on the host."""
    return t.numpy() if t.device.type == "cpu" else t


def _kernels_of(t: torch.Tensor) -> Any:
    """The kernel module for tensor ``t``'s elements (numba or numpy on the host)."""
    return _kernels.for_array(_flat(t))


class OneBitAdam(torch.optim.Optimizer):
    """AdamW whose momentum is averaged through a codec after ``warmup_steps`` dense steps.

    ``comm``: what :class:`gradcomm.Allreduce` takes (None: torch's default group if
    initialised); ``compressor`` and ``options``: the momentum's codec (default 1-bit);
    ``guard``: the divergence guard of that Allreduce; ``momentum``: ``"average"`` (each
    rank's momentum becomes the averaged one, 1-bit Adam's way), ``"local"`` (each rank
    keeps its own; error feedback carries what was not sent) or ``"auto"``: local for a
    sparse codec (top-k), average for the others. ``ramp``: steps per stage of DGC's
    sparsity warm-up after the dense steps (:class:`~.ramp.SparsityRamp`: a
    ``ratio=`` sparsifier sends 25 %, 6.25 %, 1.6 %, 0.4 % before its own ratio; the
    stages share the residuals), None for none, or ``"auto"``: :data:`DEFAULT_RAMP` for
    top-k below 1 %, else none. All parameters must be on every rank in the same order
    (as for DDP).
    """

    def __init__(self, params: Iterable[Any], comm: Any = None, *, lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.01, warmup_steps: int = DEFAULT_WARMUP,
                 compressor: Any = "onebit", guard: bool = True, momentum: str = "auto",
                 ramp: int | None | str = "auto", **options: Any) -> None:
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or \
                warmup_steps < 1:
            raise ConfigError(f"warmup_steps must be an int >= 1 (the variance is frozen "
                              f"after it), got {warmup_steps!r}")
        if not 0.0 <= betas[0] < 1.0 or not 0.0 <= betas[1] < 1.0:
            raise ConfigError(f"betas must be in [0, 1), got {betas!r}")
        if momentum not in ("auto", "local", "average"):
            raise ConfigError(f"momentum must be 'auto', 'local' or 'average', got "
                              f"{momentum!r}")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.warmup_steps = warmup_steps
        self.comm = comm
        self.allreduce = Allreduce(comm, op="mean", compressor=compressor,
                                   error_feedback=True, guard=guard,
                                   **default_options(compressor, options))
        self.dense = Allreduce(comm, op="mean")
        target = self.allreduce.compressor
        if ramp == "auto":
            ramp = DEFAULT_RAMP if default_ramp(target) is not None else None
        #: the sparsity warm-up's codecs by step (None: the target codec throughout)
        self.ramp = None if ramp is None else SparsityRamp(target, ramp, warmup_steps)
        #: each ramp stage's Allreduce, sharing the target's residuals and guard
        self._stages: dict[int, Allreduce] = {}
        #: a sparse codec (top-k: ``Compressor.sparse``): each rank keeps its own
        #: momentum, whose preconditioned value error feedback accumulates until it is
        #: sent; the other codecs (1-bit, random-k's rescaled sample, ...) replace the
        #: momentum by the average (bench/RESULTS.md, issue 13: each measured better)
        self.local = momentum == "local" or (momentum == "auto" and self.allreduce.compressor
                                             is not None and self.allreduce.compressor.sparse)
        self.steps = 0
        self._scratch: dict[str, torch.Tensor] = {}
        self.hooked = False          # set by onebit_adam_hook: DDP averages the warm-up
        #: ``bytes_sent`` by this optimizer's own reductions (a transport shared with
        #: other users, such as torch's default group, counts theirs too)
        self.stats = {"bytes_sent": 0}

    @classmethod
    def over(cls, optimizer: Any, comm: Any, *, warmup_steps: int, compressor: Any,
             guard: bool = True, **options: Any) -> OneBitAdam:
        """A OneBitAdam that continues ``optimizer`` (``torch.optim.Adam`` or ``AdamW``)
        after ``warmup_steps`` of its own steps: the same param groups (hyperparameters,
        so learning-rate schedulers apply) and the same state (``exp_avg``,
        ``exp_avg_sq``, ``step``: the user's ``optimizer.state_dict()`` keeps them). Its
        :meth:`step` is only for the compressed steps (the DDP hook's Adam route,
        :mod:`gradcomm.integrations.ddp.adam`); Adam's coupled weight decay goes into the
        local gradient, AdamW's is decoupled as here."""
        params = [p for g in optimizer.param_groups for p in g["params"]]
        g0 = optimizer.param_groups[0]
        inner = cls(params, comm, lr=float(g0["lr"]), betas=g0["betas"], eps=g0["eps"],
                    weight_decay=g0["weight_decay"], warmup_steps=warmup_steps,
                    compressor=compressor, guard=guard, **options)
        inner.param_groups, inner.state = optimizer.param_groups, optimizer.state
        inner.hooked = True
        return inner

    @property
    def compressing(self) -> bool:
        """Whether the next step averages the momentum through the codec."""
        return self.steps >= self.warmup_steps

    def _params(self) -> list[tuple[Any, dict[str, Any]]]:
        """Every parameter with its param group, in order (found once per step)."""
        return [(p, g) for g in self.param_groups for p in g["params"]]

    def _grads(self, params: list[Any]) -> list[torch.Tensor]:
        """Each parameter's gradient as a flat float32 tensor (a view where it is one)."""
        return [(p.grad if p.grad is not None else torch.zeros_like(p))
                .detach().reshape(-1).float() for p in params]

    def _buffer(self, name: str, n: int, device: Any) -> torch.Tensor:
        """A float32 scratch buffer of ``n`` elements kept between steps (fresh buffers of
        the model's size each step cost page faults)."""
        buf = self._scratch.get(name)
        if buf is None or buf.numel() != n or buf.device != device:
            buf = self._scratch[name] = torch.empty(n, dtype=torch.float32, device=device)
        return buf

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        loss = closure() if closure is not None else None
        pairs = self._params()
        params = [p for p, _ in pairs]
        grads = self._grads(params)
        compressing = self.compressing
        if not compressing and not self.hooked:
            g = self._reduce(self.dense, torch.cat(grads))
            grads = list(torch.split(g, [p.numel() for p in params]))
        total = sum(p.numel() for p in params)
        device = params[0].device if params else "cpu"
        denom, steps = self._buffer("denom", total, device), self._buffer("step", total, device)
        offset = 0
        ms, denoms = [], []
        t = min(self.steps + 1, self.warmup_steps)     # v's bias correction freezes too
        for (p, group), gi in zip(pairs, grads):
            n = p.numel()
            st = self.state[p]
            if "exp_avg" not in st:
                st["exp_avg"] = torch.zeros_like(p, dtype=torch.float32,
                                                 memory_format=torch.contiguous_format)
                st["exp_avg_sq"] = torch.zeros_like(st["exp_avg"])
            if "step" in st:            # torch's Adam state (see over()): count it
                st["step"] += 1
            b1, b2 = group["betas"]
            if not group.get("decoupled_weight_decay", True) and group["weight_decay"]:
                gi = gi.add(p.detach().reshape(-1).float(),     # Adam's L2, on the local
                            alpha=group["weight_decay"])        # gradient (same p everywhere)
            m, v = st["exp_avg"].view(-1), st["exp_avg_sq"].view(-1)
            m.mul_(b1).add_(gi, alpha=1 - b1)
            d = denom[offset:offset + n]
            if not compressing:
                v.mul_(b2).addcmul_(gi, gi, value=1 - b2)
                torch.div(v, 1 - b2 ** t, out=d).sqrt_().add_(group["eps"])
            else:       # frozen, but never below Adam's floor for this gradient; the
                # fused kernels are the bytes of the torch ops they replace
                _kernels_of(v).adam_floor_denom(_flat(gi), _flat(v), _flat(d), 1 - b2,
                                                1 - b2 ** t)
                d.sqrt_()           # torch's square root (not correctly rounded: kept)
            ms.append(m)
            denoms.append(d)
            offset += n
        updates = None
        if compressing:     # average the local momenta, preconditioned, through the codec
            x, offset = self._buffer("momentum", total, device), 0
            for m, d, (_, group) in zip(ms, denoms, pairs):
                _kernels_of(m).adam_precondition(_flat(m), _flat(d),
                                                 _flat(x[offset:offset + m.numel()]),
                                                 group["eps"])
                offset += m.numel()
            z = self._reduce(self._codec_allreduce(), x, key="momentum")
            offset, updates = 0, []
            for mi in ms:
                updates.append(z[offset:offset + mi.numel()])   # the same bytes on every
                offset += mi.numel()                            # rank (their v may differ)
        self.steps += 1
        offset = 0
        for i, ((p, group), mi, d) in enumerate(zip(pairs, ms, denoms)):
            b1 = group["betas"][0]
            lr = float(group["lr"])
            if group["weight_decay"] and group.get("decoupled_weight_decay", True):
                p.mul_(1 - lr * group["weight_decay"])
            step = steps[offset:offset + mi.numel()]
            offset += mi.numel()
            if updates is None:
                torch.div(mi, d, out=step).div_(1 - b1 ** self.steps)
            else:       # the averaged momentum replaces the rank's own (not for top-k)
                _kernels_of(mi).adam_release(_flat(updates[i]), _flat(d), _flat(mi),
                                             _flat(step), 1 - b1 ** self.steps,
                                             not self.local)
            p.add_(step.view_as(p).to(p.dtype), alpha=-lr)
        return loss

    def _codec_allreduce(self) -> Allreduce:
        """The Allreduce of this step's codec: the ramp's stage, or the target's."""
        codec = self.allreduce.compressor if self.ramp is None else \
            self.ramp.codec(self.steps)
        if codec is self.allreduce.compressor:
            return self.allreduce
        ar = self._stages.get(id(codec))
        if ar is None:
            ar = self._stages[id(codec)] = Allreduce(self.comm, op="mean", compressor=codec)
            ar.error_feedback, ar.guard = self.allreduce.error_feedback, self.allreduce.guard
        return ar

    def _reduce(self, ar: Allreduce, x: torch.Tensor, key: str = "default") -> torch.Tensor:
        t = ar.transport
        sent = t.stats.bytes_sent
        out = ar(x.cpu() if x.device.type != "cpu" else x, key=key)
        self.stats["bytes_sent"] += t.stats.bytes_sent - sent
        return out.to(x.device)

    def state_dict(self) -> dict[str, Any]:
        sd = super().state_dict()
        sd["onebit"] = {"steps": self.steps, "warmup_steps": self.warmup_steps,
                        "ef": {k: torch.as_tensor(v) for k, v in
                               self.allreduce.state_dict().items()
                               if not isinstance(v, str)}}
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        extra = state_dict.pop("onebit", None)
        if extra is None:
            raise ConfigError("not a OneBitAdam state dict (no 'onebit' entry)")
        super().load_state_dict(state_dict)
        self.steps = int(extra["steps"])
        ef = {k: (v.numpy() if v.ndim else int(v)) for k, v in extra["ef"].items()}
        ef["allreduce/compressor"] = self.allreduce._signature()
        self.allreduce.load_state_dict(ef)


def onebit_adam_hook(opt: OneBitAdam, bucket):  # type: ignore[no-untyped-def]
    """DDP comm hook for :class:`OneBitAdam`: average during its warm-up, then hand DDP
    the local gradient (the optimizer averages the momentum). Unannotated: DDP checks."""
    import torch.distributed as dist

    opt.hooked = True
    buf = bucket.buffer()
    if opt.compressing:
        fut: Any = torch.futures.Future()
        fut.set_result(buf)
        return fut
    buf.div_(dist.get_world_size())
    return dist.all_reduce(buf, async_op=True).get_future().then(lambda f: f.value()[0])


__all__ = ["DEFAULT_RAMP", "DEFAULT_WARMUP", "OneBitAdam", "onebit_adam_hook"]
