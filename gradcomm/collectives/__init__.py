"""Collective algorithms, one file each, all written against :class:`~gradcomm.comm.Transport`.

Each dense algorithm module exposes ``allreduce(t, buf, red, *, tag)`` that reduces a flat
contiguous buffer in place. :func:`dense_allreduce` checks that the ranks agree, picks the
algorithm (``"auto"``) and runs it.

Example:
    >>> import numpy as np
    >>> from gradcomm.comm import run_ranks
    >>> run_ranks(3, lambda t: dense_allreduce(t, np.ones(4), "sum", "float64", "ring")
    ...           .tolist())[0]
    [3.0, 3.0, 3.0, 3.0]
"""

from __future__ import annotations

import contextlib
import importlib
from typing import Any, Callable

import numpy as np

from ..comm.base import TAG_DATA, Transport
from ..errors import ConfigError, GradcommError
from . import auto
from ._check import agree, data_tag
from ..ops import OPS, Reducer, reducer

#: dense allreduce algorithms by name (module under gradcomm.collectives)
DENSE = ("ring", "tree", "recursive_doubling", "rabenseifner", "native")
ALGORITHMS = (*DENSE, "sparse_allgather", "auto")
#: what ``check=`` accepts
CHECK_MODES = (True, False, "first")
#: algorithms that reduce out of place from a source buffer with no copy (``src=``); the
#: others are given a copy of it in ``buf``
SOURCE_ALGORITHMS = frozenset({"ring"})

_FUNCS: dict[str, Callable[..., None]] = {}
_NO_CONTEXT = contextlib.nullcontext()


def algorithm(name: str) -> Callable[..., None]:
    """The ``allreduce(t, buf, red, *, tag)`` function of dense algorithm ``name``."""
    fn = _FUNCS.get(name)
    if fn is None:
        if name not in DENSE:
            raise ConfigError(f"unknown algorithm {name!r}; known: {', '.join(ALGORITHMS)}")
        fn = _FUNCS[name] = importlib.import_module(f"{__name__}.{name}").allreduce
    return fn


def dense_allreduce(t: Transport, buf: Any, op: str, dtype: str, algorithm_name: str = "auto",
                    *, check: bool | str = True, problem: Exception | None = None,
                    src: Any = None) -> Any:
    """Allreduce flat ``buf`` of logical ``dtype`` in place and return it; with ``src``
    (host, ``buf``'s size and dtype, not modified), reduce ``src`` into ``buf`` instead
    (``buf``'s contents are not read: the ring folds from ``src`` with no copy, the other
    algorithms copy it into ``buf`` first).

    ``check``:

    - ``True`` (the default): first the ranks agree on count, dtype, op and algorithm
      (one small exchange): any difference raises :class:`~gradcomm.errors.MismatchError`
      on every rank, a rank that never joins a :class:`~gradcomm.errors.DeadlineError`;
    - ``"first"``: the same, but only the first time this transport sees these exact
      arguments; later calls with them skip the exchange. For loops that repeat one
      call: a later disagreement (a rank passing another count, dtype, op or
      algorithm, or calling another collective) is then *not* a MismatchError but a
      :class:`~gradcomm.errors.DeadlineError` (or a receive of the wrong size,
      TransportError): an unchecked call sends its data under a tag derived from its
      arguments (:func:`~gradcomm.collectives._check.data_tag`), so ranks that disagree
      never combine each other's data. ``auto`` hands unchecked calls to gradcomm's own
      algorithms only; ``algorithm="native"`` (which has no tags) and a transport whose
      messages ignore tags (NCCL, ``Transport.tagged``) check every call;
    - ``False``: no check.

    float16 ``op="mean"`` sums, then divides; where that sum overflowed to +-inf while
    the inputs were finite, those elements are reduced again in float32 (every rank sees
    the same inf positions, so all take this second, small round or none do).

    Invalid names raise :class:`~gradcomm.errors.ConfigError` on every rank. ``problem``:
    the caller's own objection to this rank's arguments (e.g. a read-only output), raised
    on this rank before any data moves, while the ranks that had none learn from the
    check that one did (MismatchError).
    """
    red: Reducer | None = None
    local, problem = problem, None
    try:
        red = reducer(op, dtype)
    except GradcommError as exc:
        problem = exc
    if problem is None and algorithm_name not in _FUNCS and algorithm_name != "auto":
        try:
            algorithm(algorithm_name)
        except GradcommError as exc:
            problem = exc
    checked, tag = t.size == 1, TAG_DATA
    if check:
        if check is not True and check != "first":
            raise ConfigError(f"check must be True, False or 'first', got {check!r}")
        fields = dict(count=int(buf.size), dtype=dtype, op=op, algorithm=algorithm_name,
                      valid=local is None)
        try:
            ran = agree(t, "allreduce", once=check == "first" and algorithm_name != "native"
                       and t.tagged,
                        **fields)
        except GradcommError:
            if local is not None:
                raise local from None
            raise
        checked = checked or ran is not None
        if not checked:                     # skipped: the arguments travel in the tag
            tag = data_tag(t, "allreduce", **fields)
    if local is not None:
        raise local
    if problem is not None:
        raise problem
    assert red is not None
    name = algorithm_name
    if name == "auto":
        if checked and not t.state.profile_agreed:     # not auto.is_agreed(t)
            auto.agree_profile(t)           # once per transport, collective (see auto)
        name = auto.select(t, int(buf.nbytes), dtype, red.base_op, checked=checked,
                           native=checked or (t.native_bounded and check != "first"))
    orig = None
    if red.op == "mean" and dtype == "float16" and t.size > 1 and type(buf) is np.ndarray:
        orig = buf.copy() if src is None else src
    extra: dict[str, Any] = {} if tag == TAG_DATA else {"tag": tag}
    if src is not None:
        if name in SOURCE_ALGORITHMS:
            extra["src"] = src
        else:
            np.copyto(buf, src)
    with np.errstate(over="ignore") if orig is not None else _NO_CONTEXT:
        (_FUNCS.get(name) or algorithm(name))(t, buf, red, **extra)
    if red.op == "mean":
        red.finalize(buf, t.size)
    if orig is not None:
        _redo_overflow(t, buf, orig, name, tag)
    return buf


def _redo_overflow(t: Transport, buf: Any, orig: Any, name: str, tag: int) -> None:
    """float16 mean: the elements whose float16 sum is +-inf are summed again in float32
    (from each rank's input ``orig``) and divided there; an element that is inf because
    an input was stays inf. ``buf`` holds the same bytes on every rank, so every rank
    takes this round or none does."""
    bits = buf.view(np.uint16) & np.uint16(0x7FFF)    # +-inf: exponent all ones, no
    where = np.flatnonzero(bits == np.uint16(0x7C00))  # mantissa (4x np.isinf's speed)
    if not where.size:
        return
    wide = orig[where].astype(np.float32)
    if name == "native":
        name = "recursive_doubling"        # native has no float16 here either way
    (_FUNCS.get(name) or algorithm(name))(t, wide, reducer("sum", "float32"), tag=tag)
    wide /= np.float32(t.size)
    buf[where] = wide                       # cast: +-inf only where the mean is beyond


__all__ = ["ALGORITHMS", "CHECK_MODES", "DENSE", "OPS", "Reducer", "agree", "algorithm",
           "dense_allreduce"]
