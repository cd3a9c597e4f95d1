"""The residual store's contract (:class:`ResidualStore`) and the table helpers every store
shares: a residual held as a flat array of the right size, dtype and place
(:func:`held_residual`), codec state checked (:func:`checked_extra`), and which codecs
take error feedback at all (:func:`contractive`).

Example:
    >>> import numpy as np
    >>> table = {}
    >>> held_residual(table, "w", 3, "float32", None).tolist(), misplaced(table["w"], None)
    ([0.0, 0.0, 0.0], False)
"""

from __future__ import annotations

import warnings
from typing import Any, Protocol, Sequence, runtime_checkable

import numpy as np

from .. import arrays
from ..errors import ConfigError

#: separator between a key and the hop of a per-hop residual
HOP_SEP = "#"


@runtime_checkable
class ResidualStore(Protocol):
    """What a compressed collective needs from its caller's error-feedback state.

    A reduction of ``key`` asks for :meth:`step` first (it seeds the stochastic codecs;
    every rank must answer the same) and calls :meth:`advance` once it completed. Routes
    that compress the whole buffer once (allgather, sparse allgather; every route when
    p = 1) use the key's own residual: as one flat array (:meth:`flat_residual`) that a
    codec adds and updates in its own pass, or, when the store keeps it in pieces, through
    :meth:`compensate` before compressing and :meth:`update` after. Routes that
    re-compress a partial sum at every hop keep one residual per hop
    (:meth:`hop_residual`), told where the hop's segment starts in the buffer. Stateful
    codecs keep arrays between steps (:meth:`extra`, :meth:`set_extra`), and PowerSGD
    cuts a buffer into the tensors :meth:`parts` names.

    Example:
        >>> from gradcomm.error_feedback import ErrorFeedback
        >>> isinstance(ErrorFeedback(), ResidualStore)
        True
    """

    #: False: nothing is compensated and no residual is kept (steps and extras still are)
    enabled: bool
    #: None, or a host float64[2] that the codecs add ``(sq_norm(e), e.size)`` of every
    #: residual they leave to (``compress(..., tally=)``, in their fused pass): a caller
    #: that sets it before a reduction learns its residuals' norm without another pass
    tally: np.ndarray | None

    def step(self, key: str) -> int:
        """The step of this reduction of ``key`` (the same on every rank)."""

    def advance(self, key: str) -> None:
        """A reduction of ``key`` completed (a store whose step is an outside clock, such as
        the DDP hook's iteration, has nothing to count)."""

    def flat_residual(self, key: str, n: int, dtype: Any, like: Any = None) -> Any | None:
        """``key``'s residual as one flat array of ``n`` elements of ``dtype`` where ``like``
        lives, which a codec may add and update in a single pass; None if the store keeps
        it in pieces (then :meth:`compensate` and :meth:`update` are called)."""

    def compensate(self, key: str, x: Any) -> Any:
        """``x += `` what the store owes ``key`` (flat ``x``, in place); returns ``x``."""

    def update(self, key: str, x: Any, decoded: Any) -> None:
        """Keep ``x - decoded`` as ``key``'s residual (``x``: what was compressed)."""

    def hop_residual(self, name: str, offset: int, n: int, dtype: Any,
                     like: Any = None) -> Any:
        """The residual of hop ``name`` (``"<key>#<hop>"``): ``n`` elements of ``dtype``
        where ``like`` lives, for the segment that starts at ``offset`` of the buffer."""

    def extra(self, name: str) -> np.ndarray | None:
        """The codec state stored under ``name`` (``"<key>#..."``), or None."""

    def set_extra(self, name: str, value: np.ndarray) -> None:
        """Store flat numeric codec state ``value`` under ``name``."""

    def parts(self, key: str) -> Sequence[tuple[str, int, Any]] | None:
        """The tensors ``key``'s buffer is made of, in order, as ``(name, elements,
        shape or None)``; None if the store does not know."""


class ErrorFeedbackWarning(UserWarning):
    """Error feedback was asked for with a codec it would destabilise; it is not applied."""


class ResidualResetWarning(UserWarning):
    """A stored residual no longer fits its key (shape or dtype changed) and was zeroed."""

def held_residual(table: dict[str, Any], name: str, n: int, dtype: Any, like: Any) -> Any:
    """``table[name]`` as a flat array of ``n`` elements of ``dtype`` where ``like`` lives
    (None: numpy); see :meth:`ErrorFeedback.residual`, which keeps its residuals this way.

    Example:
        >>> table = {}
        >>> held_residual(table, "w", 2, "float32", None).tolist(), sorted(table)
        ([0.0, 0.0], ['w'])
    """
    dt = np.dtype(dtype)
    e = table.get(name)
    if e is not None and (tuple(e.shape) != (n,) or arrays.dtype_name(e) != dt.name):
        warnings.warn(f"error-feedback residual {name!r} held {arrays.size(e)} x "
                      f"{arrays.dtype_name(e)} but {n} x {dt} is needed now; it was "
                      "reset to zeros", ResidualResetWarning, stacklevel=4)
        e = None
    home = like is not None and not arrays.is_host(like)
    if e is None:
        e = np.zeros(n, dt)
        if home:
            e = arrays.like(e, like)
        table[name] = e
    elif misplaced(e, like):
        e = table[name] = arrays.like(arrays.host(e).copy(), like) if home \
            else arrays.host(e).copy()
    return e


def misplaced(e: Any, like: Any) -> bool:
    """Whether array ``e`` is not where ``like`` lives (None: the host).

    Example:
        >>> misplaced(np.zeros(1), None), misplaced(np.zeros(1), np.ones(2))
        (False, False)
    """
    home = like is not None and not arrays.is_host(like)
    return home != (not arrays.is_host(e)) or (home and arrays.meta_of(e).device !=
                                                 arrays.meta_of(like).device)


def checked_extra(name: str, value: Any) -> np.ndarray:
    """``value`` if it is a flat numeric numpy array (codec state), else ConfigError."""
    if not isinstance(value, np.ndarray) or value.ndim != 1 or value.dtype.kind not in "fiu":
        raise ConfigError(f"extra state {name!r} must be a flat numeric numpy array, got "
                          f"{getattr(value, 'shape', type(value).__name__)}")
    return value


def contractive(codec: Any, per_hop: bool = False) -> bool:
    """Whether error feedback is stable with ``codec``: its error must shrink the input,
    ``||C(x) − x|| < ||x||`` (in expectation, or elementwise relative to ``max |x|``).

    Error feedback feeds ``e + g`` back into the codec. For a contraction the residual
    stays bounded (EF-SGD theory); for a codec whose error can exceed its input, and
    grows with it, the residual grows without bound (measured here: QSGD with 4 levels
    reaches 10^9·||g|| within 300 steps; TernGrad's per-hop residuals diverge in trees).
    Contractions: fp16, bf16, int8 with >= 2 bits (error <= one level of the input's
    range), topk, randomk (not rescaled), onebit; QSGD when its variance bound
    ``min(d/s², √d/s) < 1`` (d = bucket size, s = levels; the default 512 / 127 gives
    0.03). Not: TernGrad (error up to ``max |v|`` per element), QSGD with few levels,
    1-bit int8. TernGrad still takes error feedback (``Compressor.feedback_stable``):
    each element's error stays below its bucket's ``max |v|``, which is sent exactly,
    and error feedback is measured to be what trains it with SGD (issue 13). That holds for
    one compression of a rank's own input (the gathered routes, the all-to-all
    reduce-scatter), not for a per-hop route (``per_hop=True``: ring, tree, recursive
    doubling, Rabenseifner, the ring reduce-scatter), which re-compresses partial sums and
    keeps a residual per hop: there TernGrad's residuals grow from step to step
    (bench/RESULTS.md, "Figures moved out of the code"), so only contractions
    take error feedback per hop. Each codec
    declares it (``Compressor.contractive``; int8 and QSGD set it
    from their options).

    Example:
        >>> from gradcomm import compressors
        >>> contractive(compressors.get("topk")), contractive(compressors.get("int8", bits=1))
        (True, False)
        >>> contractive(compressors.get("terngrad")), contractive(compressors.get("terngrad"), per_hop=True)
        (True, False)
    """
    return bool(codec.contractive or (codec.feedback_stable and not per_hop))


__all__ = ["ErrorFeedbackWarning", "HOP_SEP", "ResidualResetWarning", "ResidualStore",
           "checked_extra", "contractive", "held_residual", "misplaced"]
