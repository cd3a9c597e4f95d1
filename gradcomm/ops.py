"""The reduction operators: how two flat buffers combine under sum, mean, max, min, prod.

On the lowest floor, beside :mod:`gradcomm.errors` and :mod:`gradcomm._dtypes`, so that the
transports (the in-process native allreduce) and the collectives share one definition.
``Reducer.combine(a, b, out)`` computes ``out = a (op) b``; collectives always pass the
contribution of the lower ranks as ``a`` so that every rank evaluates the same expression
and ends with the same bytes. float16 is reduced by numpy; bfloat16 (stored as uint16)
through float32 with round-to-nearest-even, because MPI cannot reduce either correctly.

Example:
    >>> import numpy as np
    >>> r = Reducer("sum", "float32")
    >>> a = np.ones(3, np.float32); r.combine(a, a, a); a
    array([2., 2., 2.], dtype=float32)
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ._dtypes import FLOATS, bf16_to_f32, f32_to_bf16, storage
from .errors import ConfigError

OPS = ("sum", "mean", "max", "min", "prod")
_UFUNC = {"sum": np.add, "mean": np.add, "max": np.maximum, "min": np.minimum,
          "prod": np.multiply}


class Reducer:
    """How to combine two buffers of logical dtype ``dtype`` under ``op``."""

    def __init__(self, op: str, dtype: str) -> None:
        if op not in _UFUNC:
            raise ConfigError(f"unknown op {op!r}; known: {', '.join(OPS)}")
        storage(dtype)
        if op == "mean" and dtype not in FLOATS:
            raise ConfigError(f"op='mean' needs a floating dtype, got {dtype}; "
                              "use op='sum' and divide")
        self.op, self.dtype = op, dtype
        #: the op MPI-style libraries run ('mean' is a 'sum' followed by ``finalize``)
        self.base_op = "sum" if op == "mean" else op
        self._ufunc = _UFUNC[op]
        self.bfloat16 = dtype == "bfloat16"

    def combine(self, a: Any, b: Any, out: Any) -> None:
        """``out[...] = a (op) b`` elementwise; ``out`` may alias ``a`` or ``b``."""
        if self.bfloat16:
            f32_to_bf16(self._ufunc(bf16_to_f32(a), bf16_to_f32(b)), out)
        elif self.dtype == "bool" and self.op == "sum":
            np.logical_or(a, b, out=out)
        else:
            self._ufunc(a, b, out=out)

    def finalize(self, buf: Any, size: int) -> None:
        """Turn the reduced buffer into the op's result (divides by ``size`` for mean)."""
        if self.op != "mean" or size == 1:
            return
        if self.bfloat16:
            f32_to_bf16(bf16_to_f32(buf) / np.float32(size), buf)
        else:
            np.divide(buf, buf.dtype.type(size), out=buf)


_REDUCERS: dict[tuple[str, str], Reducer] = {}


def reducer(op: str, dtype: str) -> Reducer:
    """A shared :class:`Reducer` (they hold no state), created on first use.

    Example:
        >>> reducer("sum", "float32") is reducer("sum", "float32")
        True
    """
    red = _REDUCERS.get((op, dtype))
    if red is None:
        red = _REDUCERS[(op, dtype)] = Reducer(op, dtype)
    return red
