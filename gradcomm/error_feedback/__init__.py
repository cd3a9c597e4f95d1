"""Error feedback: the compression error of one step is added back into the next.

For every ``key`` (usually a parameter name) :class:`ErrorFeedback` keeps a residual ``e``:
the value compressed is ``e + g`` and afterwards ``e ← (e + g) − decoded``, so what the
codec dropped is sent later instead of being lost (1-bit SGD, EF-SGD, DGC). Over ``T``
steps this telescopes: ``Σ decoded + e_T = Σ g``. Collectives that re-compress partial
sums at every hop keep one more residual per hop under ``"<key>#<hop>"`` in the same
object, and a step counter per key (it seeds the stochastic codecs). Stateful codecs keep
other per-key arrays in the same object (:meth:`ErrorFeedback.extra`, e.g. PowerSGD's
warm-start ``Q`` under ``"<key>#q"``), checkpointed with the residuals.

:class:`ResidualStore` (:mod:`.store`) is what the compressed collectives ask of such an
object (steps, the key's residual, per-hop residuals with their location, codec state,
the tensors a buffer is made of). :class:`ErrorFeedback` (:mod:`.feedback`) implements
it, and :class:`KeyedResiduals` (:mod:`.keyed`) for owners that keep their own books (the
DDP hook indexes one by parameter name: :mod:`gradcomm.integrations.ddp.residuals`).

Everything is held as plain numpy arrays and ints, so :meth:`ErrorFeedback.state_dict`
saves with ``numpy.savez`` (no pickle) or ``torch.save`` (load it with
``torch.load(path, weights_only=False)`` or inside
``torch.serialization.safe_globals(torch_safe_globals())``), and
:meth:`ErrorFeedback.load_state_dict` restores a continuation bitwise equal to never
having stopped.

Example:
    >>> import numpy as np
    >>> ef = ErrorFeedback()
    >>> g = np.array([0.25, 1.0], np.float32)
    >>> x = ef.compensate("w", g.copy())            # e + g (e starts at 0)
    >>> decoded = np.round(x)                        # a toy lossy codec
    >>> ef.update("w", x, decoded); ef.residual("w", 2, np.float32).tolist()
    [0.25, 0.0]
    >>> ef2 = ErrorFeedback(); ef2.load_state_dict(ef.state_dict())
    >>> ef2.residual("w", 2, np.float32).tolist()
    [0.25, 0.0]
"""

from .feedback import STATE_VERSION, ErrorFeedback, torch_safe_globals
from .keyed import KeyedResiduals
from .store import (HOP_SEP, ErrorFeedbackWarning, ResidualResetWarning, ResidualStore,
                    checked_extra, contractive, held_residual, misplaced)

__all__ = ["ErrorFeedback", "ErrorFeedbackWarning", "HOP_SEP", "KeyedResiduals",
           "ResidualResetWarning", "ResidualStore", "STATE_VERSION", "checked_extra",
           "contractive", "held_residual", "misplaced", "torch_safe_globals"]
