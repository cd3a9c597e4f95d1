"""Momentum correction for the DDP hook (DGC, Lin et al. 2018): compress the velocity.

With error feedback, a gradient coordinate a sparsifier or 1-bit codec holds back is sent
steps later, and the optimizer's momentum then applies to it as if it were fresh: the
update is stale and, with momentum 0.9, amplified (issue 13: top-k 0.1 % loses points,
random-k diverges). DGC moves the momentum in front of the codec: every rank keeps a
local velocity ``u ← m·u + g`` per parameter and error feedback compresses ``e + u``;
for sparse codecs, coordinates that were applied have their velocity cleared (*factor
masking*), so they do not keep pushing.

The aggregated result ``D_t`` then already holds the momentum; the optimizer must not add
its own. When the hook is given the optimizer (``make_comm_hook(..., optimizer=opt)``)
and that is ``torch.optim.SGD`` with momentum ``m`` (dampening 0, no Nesterov), the hook
hands DDP ``D_t − m·D_{t−1}``: SGD's buffer ``b_t = m·b_{t−1} + d_t`` is then exactly
``D_t``, so the user keeps ``SGD(momentum=0.9)`` and gets DGC's update (weight decay
still goes through SGD's momentum, as without compression). With ``momentum=m`` and no
optimizer the hook's output is ``D_t`` itself: use SGD without momentum.

**Found by default.** ``make_comm_hook(name)`` (``optimizer="auto"``) watches
``optimizer.step()`` through torch's global step pre-hook (:class:`OptimizerWatch`): the
first optimizer that steps the hook's parameters is taken as if passed, and the correction
starts with the next backward pass (the first one goes uncorrected); ``optimizer=None``
turns the watch off.

State per parameter (``u`` and ``D_{t−1}``), kept per rank; the divergence guard resets
it with the residuals. It is in the hook's ``state_dict`` (groups ``velocity`` and
``previous`` of every rank, and the factors under ``"momentum"``), so a resumed run is
bitwise the unbroken one.

Example:
    >>> import numpy as np
    >>> mc = MomentumCorrection(0.5, optimizer_momentum=0.5, mask=False)
    >>> x = np.ones(3, np.float32)
    >>> mc.before(["w"], [3], x); x.tolist()          # u = g
    [1.0, 1.0, 1.0]
    >>> out = x.copy(); mc.after(["w"], [3], out); out.tolist()   # D_1 - 0.5 * 0
    [1.0, 1.0, 1.0]
    >>> x = np.ones(3, np.float32); mc.before(["w"], [3], x); x.tolist()   # 0.5 u + g
    [1.5, 1.5, 1.5]
    >>> out = x.copy(); mc.after(["w"], [3], out); out.tolist()   # D_2 - 0.5 D_1
    [1.0, 1.0, 1.0]
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from ... import arrays
from ...compressors import _kernels
from ...errors import ConfigError

#: codecs whose output is sparse: their momentum is masked where an update was applied
MASKED_CODECS = ("topk", "randomk")
#: codecs that get momentum correction from ``optimizer=``: the sparsifiers and 1-bit SGD,
#: whose error feedback holds mass back for many steps (measured in bench/converge.py;
#: the others' errors are small and fresh: fp16, bf16, int8, qsgd, terngrad, powersgd)
CORRECTED_CODECS = ("topk", "randomk", "onebit")
#: codecs whose error feedback the hook turns off when the optimizer it finds is not SGD:
#: TernGrad's residual, released at the block's scale, trains SGD + momentum (without it
#: TernGrad diverges) but cost Adam's per-coordinate steps on the gradient route
#: (bench/RESULTS.md, issue 13; Adam and AdamW now take the Adam route, :mod:`.adam`)
SGD_FEEDBACK_CODECS = ("terngrad",)


def optimizer_momentum(optimizer: Any) -> float:
    """The momentum ``torch.optim.SGD`` ``optimizer`` applies (every param group alike;
    0.0 for other optimizers, with a warning; Adam and AdamW take the hook's Adam route
    instead, :mod:`.adam`), or ConfigError for SGD settings the hook cannot undo
    (dampening, Nesterov, groups that differ)."""
    import torch

    if not isinstance(optimizer, torch.optim.SGD):
        warnings.warn(f"make_comm_hook(optimizer=...): momentum correction works with "
                      f"torch.optim.SGD, not {type(optimizer).__qualname__}; it is off "
                      "(torch.optim.Adam and AdamW take the hook's Adam route: "
                      "gradcomm.integrations.ddp.adam)",
                      UserWarning, stacklevel=4)
        return 0.0
    found = {(float(g.get("momentum", 0.0)), float(g.get("dampening", 0.0)),
              bool(g.get("nesterov", False))) for g in optimizer.param_groups}
    if len(found) != 1:
        raise ConfigError(f"the optimizer's param groups differ in momentum: {sorted(found)}")
    m, dampening, nesterov = found.pop()
    if m and (dampening or nesterov):
        raise ConfigError("momentum correction needs SGD with dampening=0 and "
                          "nesterov=False")
    return m


def momentum_correction(codec: Any, momentum: float | None,
                        optimizer: Any) -> MomentumCorrection | None:
    """The hook's momentum correction for lossy ``codec``: ``momentum`` (default: the
    optimizer's), undoing ``optimizer``'s SGD momentum if one is given; None if neither
    asks for one (or the codec is lossless)."""
    if codec is None or not codec.lossy:
        return None
    undo = 0.0
    if optimizer is not None and codec.name in CORRECTED_CODECS:
        undo = optimizer_momentum(optimizer)
    m = undo if momentum is None else momentum
    if not m:
        return None
    return MomentumCorrection(float(m), undo, mask=codec.name in MASKED_CODECS)


class MomentumCorrection:
    """Per-parameter velocity before the codec and the optimizer's momentum undone after.

    ``momentum``: the velocity's factor (DGC's m); ``optimizer_momentum``: the momentum
    the optimizer applies afterwards (0: none; else it is undone); ``mask``: clear the
    velocity where the reduced result is nonzero (sparse codecs).
    """

    def __init__(self, momentum: float, optimizer_momentum: float = 0.0,
                 mask: bool = False) -> None:
        if not 0.0 < momentum < 1.0:
            raise ConfigError(f"momentum must be in (0, 1), got {momentum!r}")
        if not 0.0 <= optimizer_momentum < 1.0:
            raise ConfigError(f"the optimizer's momentum must be in [0, 1), got "
                              f"{optimizer_momentum!r}")
        self.momentum, self.undo, self.mask = float(momentum), float(optimizer_momentum), mask
        self._velocity: dict[str, Any] = {}
        self._previous: dict[str, Any] = {}
        self._spare: dict[str, Any] = {}        # a buffer per key for the next result

    def _slices(self, keys: Sequence[str], lengths: Sequence[int]):
        a = 0
        for k, n in zip(keys, lengths):
            yield k, a, a + int(n)
            a += int(n)

    def before(self, keys: Sequence[str], lengths: Sequence[int], x: Any) -> None:
        """``u ← m·u + x`` per parameter, then ``x ← u`` (in place)."""
        for k, a, b in self._slices(keys, lengths):
            u = self._placed(self._velocity, k, x)
            if u is None or arrays.size(u) != b - a or arrays.dtype_name(u) != \
                    arrays.dtype_name(x) or arrays.is_host(u) != arrays.is_host(x):
                self._velocity[k] = arrays.clone(x[a:b])
                continue
            _kernels.for_array(u).velocity_in(u, x[a:b], self.momentum)

    def after(self, keys: Sequence[str], lengths: Sequence[int], out: Any) -> None:
        """Mask the velocity where ``out`` (the reduced velocity) is nonzero; undo the
        optimizer's momentum: ``out ← out − m_opt·out_prev`` (in place)."""
        for k, a, b in self._slices(keys, lengths):
            o = out[a:b]
            if self.mask:
                u = self._velocity.get(k)
                if u is not None:
                    u[o != 0] = 0
            if self.undo:
                prev = self._placed(self._previous, k, o)
                if prev is None or arrays.size(prev) != b - a or \
                        arrays.is_host(prev) != arrays.is_host(o):
                    self._previous[k] = arrays.clone(o)
                    continue
                # the result is kept in the buffer held two steps ago, and the product is
                # formed in the previous result's own buffer: no 2 new arrays per step
                # (page faults); the same bytes as out - m_opt * out_prev
                now = self._spare.pop(k, None)
                if now is None or arrays.size(now) != b - a or \
                        arrays.dtype_name(now) != arrays.dtype_name(o) or \
                        arrays.is_host(now) != arrays.is_host(o):
                    now = arrays.clone(o)
                _kernels.for_array(o).momentum_undo(o, prev, now, self.undo)
                self._previous[k], self._spare[k] = now, prev

    @staticmethod
    def _placed(table: dict[str, Any], k: str, ref: Any) -> Any:
        """``table[k]`` where ``ref`` lives: a checkpoint's host array moves to a device
        bucket's kind and device once, on first use (None if there is none)."""
        v = table.get(k)
        if v is not None and arrays.is_host(v) and not arrays.is_host(ref):
            v = table[k] = arrays.like(v, ref)
        return v

    def config(self) -> dict[str, Any]:
        """The factors, as ``state_dict()["momentum"]`` holds them."""
        return {"momentum": self.momentum, "optimizer_momentum": self.undo,
                "mask": self.mask}

    def local_state(self) -> dict[str, dict[str, np.ndarray]]:
        """This rank's ``{"velocity": {key: u}, "previous": {key: D_prev}}`` on the host."""
        return {"velocity": {k: arrays.host(v) for k, v in self._velocity.items()},
                "previous": {k: arrays.host(v) for k, v in self._previous.items()}}

    def load(self, velocity: Mapping[str, np.ndarray],
             previous: Mapping[str, np.ndarray]) -> None:
        """Take a checkpoint's state (host arrays; a device bucket moves them to its own
        device on first use)."""
        self._velocity = {k: np.array(v, copy=True) for k, v in velocity.items()}
        self._previous = {k: np.array(v, copy=True) for k, v in previous.items()}
        self._spare = {}

    def reset(self, keys: Sequence[str]) -> None:
        """Forget the velocity and previous result of ``keys`` (the guard's reset)."""
        for k in keys:
            self._velocity.pop(k, None)
            self._previous.pop(k, None)
            self._spare.pop(k, None)


class OptimizerWatch:
    """Finds the optimizer that steps parameters the hook reduced (``optimizer="auto"``).

    Holds a torch global optimizer step pre-hook until the first ``step()`` of an
    optimizer holding one of ``params`` (ids of parameters seen in buckets), then calls
    ``found(optimizer)`` once and removes the hook. Holds ``owner`` weakly: a dropped hook
    state stops the watch.
    """

    def __init__(self, owner: Any, found: Callable[[Any, Any], None]) -> None:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        #: ids of the parameters the hook has reduced (comm_hook adds them)
        self.params: set[int] = set()
        ref = weakref.ref(owner)

        def pre_step(opt: Any, args: Any, kwargs: Any) -> None:
            state = ref()
            if state is None:
                self.remove()
            elif any(id(p) in self.params for g in opt.param_groups for p in g["params"]):
                self.remove()
                found(state, opt)

        self._handle: Any = register_optimizer_step_pre_hook(pre_step)

    @property
    def watching(self) -> bool:
        """Whether the step pre-hook is still installed."""
        return self._handle is not None

    def remove(self) -> None:
        """Uninstall the step pre-hook (idempotent)."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None


def restored(mc: MomentumCorrection | None, watching: bool, factors: Mapping[str, Any],
             velocity: Mapping[str, np.ndarray], previous: Mapping[str, np.ndarray]
             ) -> MomentumCorrection | None:
    """The hook's momentum correction after loading a checkpoint's: ``mc`` with the saved
    state, or one made from the saved ``factors`` if the hook was still ``watching`` for
    its optimizer; a hook with neither (``optimizer=None``) warns and ignores it."""
    if mc is None and watching:
        mc = MomentumCorrection(float(factors["momentum"]),
                                float(factors["optimizer_momentum"]), mask=bool(factors["mask"]))
    if mc is None:
        warnings.warn("the checkpoint holds a momentum-correction velocity; this hook "
                      "corrects no momentum (optimizer=None): ignored", stacklevel=5)
        return None
    mc.load(velocity, previous)
    return mc


def feedback_with(codec: Any, optimizer: Any) -> bool:
    """Whether error feedback stays on for ``codec`` once the hook found ``optimizer``."""
    import torch

    if codec.name not in SGD_FEEDBACK_CODECS or isinstance(optimizer, torch.optim.SGD):
        return True
    warnings.warn(f"make_comm_hook: {codec.name}'s error feedback is off with "
                  f"{type(optimizer).__qualname__} (it cost Adam points on the gradient "
                  f"route; torch.optim.Adam and AdamW take the hook's Adam route: "
                  f"gradcomm.integrations.ddp.adam)", UserWarning, stacklevel=4)
    return False


def momentum_safe(mc: MomentumCorrection | None, optimizer: Any) -> bool:
    """Whether no SGD momentum is left to amplify stale residuals: the hook corrects it
    (``mc``), or ``optimizer`` is known and is not SGD (random-k's clip follows this)."""
    if mc is not None:
        return True
    if optimizer is None:
        return False
    import torch

    return not isinstance(optimizer, torch.optim.SGD)


def found_momentum(codec: Any, momentum: float | None,
                   optimizer: Any) -> MomentumCorrection | None:
    """:func:`momentum_correction` for an optimizer the watch found: an optimizer whose
    momentum the hook cannot undo warns (momentum correction stays off) instead of
    raising inside ``optimizer.step()``."""
    try:
        return momentum_correction(codec, momentum, optimizer)
    except ConfigError as exc:
        warnings.warn(f"make_comm_hook: momentum correction stays off: {exc}", UserWarning,
                      stacklevel=4)
        return None


__all__ = ["CORRECTED_CODECS", "MASKED_CODECS", "MomentumCorrection", "OptimizerWatch",
           "SGD_FEEDBACK_CODECS", "feedback_with", "found_momentum", "momentum_correction",
           "optimizer_momentum", "restored", "momentum_safe"]
