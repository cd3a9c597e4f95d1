"""The DDP hook's Adam route: 1-bit Adam's mechanism behind ``make_comm_hook(name)``.

Compressing Adam's *gradients* costs accuracy: Adam's second moment of a compressed,
error-compensated gradient is not the gradient's, and ``m / sqrt(v)`` amplifies the
codec's error where ``v`` is small (through the gradient route, AdamW on the synthetic
task at 4 ranks: top-k 1 % -1.2 points, onebit -1.7, random-k -4.1, TernGrad -6.1
against uncompressed; bench/RESULTS.md, issue 13). So when the hook finds a
``torch.optim.Adam`` or ``AdamW`` (``optimizer="auto"``, at its first ``step()``, or
given as ``optimizer=``) and the codec is one of :data:`ADAM_CODECS`, it runs
:class:`~.onebit_adam.OneBitAdam`'s mechanism on the user's own optimizer:

1. the first ``warmup`` optimizer steps (default :data:`~.defaults.DEFAULT_WARMUP`,
   or ``start_iter=`` if given) are plain Adam on the averaged gradient: the hook
   averages the buckets uncompressed, the user's optimizer steps as usual;
2. after them the hook hands DDP each rank's local gradient (no communication in
   backward), and at ``optimizer.step()`` (a step pre-hook on that optimizer) each rank
   updates Adam's ``exp_avg`` with it, freezes ``exp_avg_sq`` (never below Adam's
   floor ``(1 - b2) g**2``), and the ranks average the preconditioned momentum
   ``m / (sqrt(v) + eps)`` through the codec with error feedback; every rank applies the
   same average (AdamW's decoupled weight decay, Adam's L2 on the local gradient). The
   optimizer's own update is then skipped for these parameters (their ``.grad`` is
   ``None`` during its step and restored after it), so its param groups (learning-rate
   schedulers) and state (``state_dict()``: moments and step) stay the user's.

fp16, bf16, int8, qsgd and PowerSGD keep the gradient route with Adam: their errors are
small and fresh (within a point of uncompressed AdamW in bench/RESULTS.md).

Example:
    >>> from gradcomm import compressors
    >>> adam_codec(compressors.get("onebit")), adam_codec(compressors.get("fp16"))
    (True, False)
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Mapping

from ...errors import ConfigError
from .defaults import DEFAULT_WARMUP

#: codecs the hook moves onto the Adam route when it finds Adam/AdamW: their gradient
#: route lost points with AdamW (bench/RESULTS.md, issue 13)
ADAM_CODECS = ("topk", "randomk", "onebit", "terngrad")


def adam_codec(codec: Any) -> bool:
    """Whether ``codec`` takes the Adam route when the hook finds Adam or AdamW."""
    return codec is not None and codec.lossy and codec.name in ADAM_CODECS


def is_adam(optimizer: Any) -> bool:
    """Whether ``optimizer`` is a ``torch.optim.Adam`` (``AdamW`` included) the route can
    continue: no ``amsgrad``, no ``maximize`` (a warning says why otherwise)."""
    import torch

    if not isinstance(optimizer, torch.optim.Adam):
        return False
    for g in optimizer.param_groups:
        for flag in ("amsgrad", "maximize"):
            if g.get(flag):
                warnings.warn(f"make_comm_hook: Adam's route does not support {flag}=True; "
                              "the hook compresses Adam's gradients instead (it costs "
                              "accuracy)", UserWarning, stacklevel=5)
                return False
    return True


class AdamRoute:
    """The user's Adam after its warm-up, continued as 1-bit Adam (module docstring).

    ``run``: runs a function on the hook's worker (the momentum's reduction uses the
    hook's transport, which the worker owns); ``transport``, ``compressor``,
    ``options``, ``guard``: the momentum's :class:`gradcomm.Allreduce`; ``warmup``:
    the optimizer steps of plain Adam first; ``stats``: the hook's, whose
    ``bytes_sent`` counts the momentum's bytes too.
    """

    def __init__(self, optimizer: Any, transport: Any, compressor: Any, options: dict,
                 warmup: int, guard: bool, run: Callable[[Callable[[], Any]], Any],
                 stats: dict[str, Any]) -> None:
        from .onebit_adam import OneBitAdam

        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 1:
            raise ConfigError(f"Adam's route needs a warm-up of >= 1 step, got {warmup!r}")
        self.optimizer, self.warmup = optimizer, warmup
        self.inner = OneBitAdam.over(optimizer, transport, warmup_steps=warmup,
                                     compressor=compressor, guard=guard, **options)
        self._run, self._stats = run, stats
        self._held: list[tuple[Any, Any]] = []
        self._handles = [optimizer.register_step_pre_hook(self._pre_step),
                         optimizer.register_step_post_hook(self._post_step)]

    def steps(self) -> int:
        """The optimizer's completed steps (Adam's own ``state["step"]``: a checkpoint
        of the optimizer carries it)."""
        for g in self.optimizer.param_groups:
            for p in g["params"]:
                st = self.optimizer.state.get(p)
                if st and "step" in st:
                    return int(st["step"])
        return 0

    @property
    def compressing(self) -> bool:
        """Whether the next optimizer step averages the momentum through the codec (and
        this iteration's buckets stay local)."""
        return self.steps() >= self.warmup

    def _pre_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if not self.compressing:
            return
        inner = self.inner
        inner.steps = self.steps()
        before = inner.stats["bytes_sent"]
        self._run(inner.step)
        self._stats["bytes_sent"] += inner.stats["bytes_sent"] - before
        self._held = [(p, p.grad) for g in optimizer.param_groups for p in g["params"]
                      if p.grad is not None]
        for p, _ in self._held:
            p.grad = None            # the optimizer's own update skips them

    def _post_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        for p, grad in self._held:
            p.grad = grad
        self._held = []

    def local_state(self) -> dict[str, dict[str, Any]]:
        """This rank's momentum residuals and codec steps, as the hook's checkpoint group
        ``"adam"`` (empty before the first compressed step): the momentum Allreduce's
        ``residual/...`` arrays and ``step/...`` counters (as int64[1])."""
        import numpy as np

        sd = self.inner.allreduce.state_dict()
        return {"adam": {k: np.asarray(v, np.float32) if k.startswith("residual/")
                         else np.array([int(v)], np.int64)
                         for k, v in sd.items() if k.startswith(("residual/", "step/"))}}

    def load(self, entries: dict[str, Any]) -> None:
        """Take a checkpoint's momentum residuals and codec steps (from
        :func:`~.checkpoint.restore_adam`)."""
        ar = self.inner.allreduce
        sd = {k: v for k, v in ar.state_dict().items()
              if not k.startswith(("residual/", "step/"))}
        for k, v in entries.items():
            sd[k] = v if k.startswith("residual/") else int(v[0])
        ar.load_state_dict(sd)

    def remove(self) -> None:
        """Uninstall the step hooks (idempotent)."""
        for h in self._handles:
            h.remove()
        self._handles = []


class AdamSlot:
    """The hook's side of the Adam route: the warm-up it will use (``start_iter`` if
    given, else :data:`~.defaults.DEFAULT_WARMUP`), the route once started, and a
    checkpoint's state waiting for it (the watch finds the optimizer at its first
    ``step()``, after the first backward pass of a resumed run).

    Example:
        >>> slot = AdamSlot(None)
        >>> slot.warmup, slot.active, slot.local(), slot.config()
        (100, False, False, None)
    """

    def __init__(self, warmup: int | None) -> None:
        self.warmup = DEFAULT_WARMUP if warmup is None else warmup
        self.route: AdamRoute | None = None
        #: a checkpoint's momentum residuals and steps (:func:`~.checkpoint.restore_adam`)
        self.saved: dict[str, Any] | None = None
        #: a checkpoint's route was compressing (True) or warming up (False): what the
        #: buckets do until the route starts again; None: no such checkpoint
        self.pending: bool | None = None
        #: whether the route (or a checkpoint's, until it starts) decides the buckets:
        #: the hook's gradient route does not compress (a plain attribute: a bucket's
        #: trip reads it without entering this module)
        self.active = False

    def start(self, optimizer: Any, transport: Any, compressor: Any, seed: int,
              guard: bool, run: Callable[[Callable[[], Any]], Any],
              stats: dict[str, Any]) -> None:
        """Continue ``optimizer`` as 1-bit Adam (:class:`AdamRoute`), with a loaded
        checkpoint's momentum state."""
        self.route = AdamRoute(optimizer, transport, compressor, {"seed": seed},
                               self.warmup, guard, run, stats)
        if self.saved is not None:
            self.route.load(self.saved)
        self.pending, self.active = None, True

    def local(self) -> bool:
        """Whether this iteration's buckets stay local (the route past its warm-up:
        the optimizer's step averages the momentum)."""
        return bool(self.route.compressing if self.route is not None else self.pending)

    def local_state(self) -> dict[str, dict[str, Any]]:
        """This rank's checkpoint group (:meth:`AdamRoute.local_state`), or none."""
        return {} if self.route is None else self.route.local_state()

    def sq_norm(self) -> float:
        """The squared norm of this rank's momentum residuals (0 before the route)."""
        import numpy as np

        return sum(float(np.dot(v.astype(np.float64), v)) for k, v in
                   self.local_state().get("adam", {}).items() if k.startswith("residual/"))

    def config(self) -> dict[str, bool] | None:
        """``state_dict()["adam"]``: whether the route was compressing, or None."""
        return None if self.route is None else {"compressing": self.route.compressing}

    def load(self, saved: dict[str, Any] | None, config: Any) -> None:
        """Take a checkpoint's group (:func:`~.checkpoint.restore_adam`) and its
        ``state_dict()["adam"]`` (:meth:`config`)."""
        self.saved = saved
        if self.route is not None:
            if saved is not None:
                self.route.load(saved)
        elif isinstance(config, Mapping):
            self.pending, self.active = bool(config.get("compressing")), True

    def remove(self) -> None:
        """Uninstall the route's step hooks."""
        if self.route is not None:
            self.route.remove()


__all__ = ["ADAM_CODECS", "AdamRoute", "AdamSlot", "adam_codec", "is_adam"]
