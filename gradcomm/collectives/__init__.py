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

import importlib
from typing import Any, Callable

from ..comm.base import Transport
from ..errors import ConfigError, GradcommError
from . import auto
from ._check import agree
from ..ops import OPS, Reducer, reducer

#: dense allreduce algorithms by name (module under gradcomm.collectives)
DENSE = ("ring", "tree", "recursive_doubling", "rabenseifner", "native")
ALGORITHMS = (*DENSE, "sparse_allgather", "auto")
#: what ``check=`` accepts
CHECK_MODES = (True, False, "first")

_FUNCS: dict[str, Callable[..., None]] = {}


def algorithm(name: str) -> Callable[..., None]:
    """The ``allreduce(t, buf, red, *, tag)`` function of dense algorithm ``name``."""
    fn = _FUNCS.get(name)
    if fn is None:
        if name not in DENSE:
            raise ConfigError(f"unknown algorithm {name!r}; known: {', '.join(ALGORITHMS)}")
        fn = _FUNCS[name] = importlib.import_module(f"{__name__}.{name}").allreduce
    return fn


def dense_allreduce(t: Transport, buf: Any, op: str, dtype: str, algorithm_name: str = "auto",
                    *, check: bool | str = True) -> Any:
    """Allreduce flat ``buf`` of logical ``dtype`` in place and return it.

    ``check``:

    - ``True`` (the default): first the ranks agree on count, dtype, op and algorithm
      (one small exchange): any difference raises :class:`~gradcomm.errors.MismatchError`
      on every rank, a rank that never joins a :class:`~gradcomm.errors.DeadlineError`;
    - ``"first"``: the same, but only the first time this transport sees these exact
      arguments; later calls with them skip the exchange. For loops that repeat one
      call: a later disagreement (a rank passing other arguments, or calling another
      collective) is then *not* a MismatchError but whatever the algorithm meets — a
      receive of the wrong size (TransportError) or a DeadlineError — and with
      ``algorithm="native"`` on MPI possibly neither. ``auto`` never hands an unchecked
      call to a native allreduce that cannot time out;
    - ``False``: no check.

    Invalid names raise :class:`~gradcomm.errors.ConfigError` on every rank.
    """
    red: Reducer | None = None
    problem: GradcommError | None = None
    try:
        red = reducer(op, dtype)
    except GradcommError as exc:
        problem = exc
    if problem is None and algorithm_name not in _FUNCS and algorithm_name != "auto":
        try:
            algorithm(algorithm_name)
        except GradcommError as exc:
            problem = exc
    checked = t.size == 1
    if check:
        if check is not True and check != "first":
            raise ConfigError(f"check must be True, False or 'first', got {check!r}")
        ran = agree(t, "allreduce", once=check == "first", count=int(buf.size), dtype=dtype,
                    op=op, algorithm=algorithm_name)
        checked = checked or ran is not None
    if problem is not None:
        raise problem
    assert red is not None
    name = algorithm_name
    if name == "auto":
        if checked and not t.state.profile_agreed:     # not auto.is_agreed(t)
            auto.agree_profile(t)           # once per transport, collective (see auto)
        name = auto.select(t, int(buf.nbytes), dtype, red.base_op,
                           native=checked or t.native_bounded)
    (_FUNCS.get(name) or algorithm(name))(t, buf, red)
    if red.op == "mean":
        red.finalize(buf, t.size)
    return buf


__all__ = ["ALGORITHMS", "CHECK_MODES", "DENSE", "OPS", "Reducer", "agree", "algorithm",
           "dense_allreduce"]
