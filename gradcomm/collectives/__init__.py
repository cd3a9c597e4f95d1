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
from ._check import agree
from ._reduce import OPS, Reducer

#: dense allreduce algorithms by name (module under gradcomm.collectives)
DENSE = ("ring", "tree", "recursive_doubling", "rabenseifner", "native")
ALGORITHMS = (*DENSE, "sparse_allgather", "auto")


def algorithm(name: str) -> Callable[..., None]:
    """The ``allreduce(t, buf, red, *, tag)`` function of dense algorithm ``name``."""
    if name not in DENSE:
        raise ConfigError(f"unknown algorithm {name!r}; known: {', '.join(ALGORITHMS)}")
    return importlib.import_module(f"{__name__}.{name}").allreduce


def dense_allreduce(t: Transport, buf: Any, op: str, dtype: str, algorithm_name: str = "auto",
                    *, check: bool = True) -> Any:
    """Allreduce flat ``buf`` of logical ``dtype`` in place and return it.

    With ``check`` (the default) the ranks first agree on count, dtype, op and algorithm:
    any difference raises :class:`~gradcomm.errors.MismatchError` on every rank. Invalid
    names raise :class:`~gradcomm.errors.ConfigError` on every rank.
    """
    problem: GradcommError | None = None
    red: Reducer | None = None
    try:
        red = Reducer(op, dtype)
        if algorithm_name not in DENSE and algorithm_name != "auto":
            algorithm(algorithm_name)
    except GradcommError as exc:
        problem = exc
    if check:
        agree(t, "allreduce", count=int(buf.size), dtype=dtype, op=op,
              algorithm=algorithm_name)
    if problem is not None:
        raise problem
    assert red is not None
    name = algorithm_name
    if name == "auto":
        from .auto import select

        name = select(t, int(buf.nbytes))
    algorithm(name)(t, buf, red)
    red.finalize(buf, t.size)
    return buf


__all__ = ["ALGORITHMS", "DENSE", "OPS", "Reducer", "agree", "algorithm", "dense_allreduce"]
