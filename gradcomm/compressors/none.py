"""``none``: the identity codec (raw values on the wire), the baseline of every comparison.

Example:
    >>> import numpy as np
    >>> c = NoneCompressor()
    >>> c.decompress(c.compress(np.ones(2, np.float32))).tolist()
    [1.0, 1.0]
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ..arrays import assign, dtype_name, empty_like_kind, flat, size
from .base import Compressor, need_out
from .payload import Payload, check_codec, make_out, payload_nbytes
from ..errors import PayloadError


_FLOATS = ("float16", "float32", "float64")


class NoneCompressor(Compressor):
    """Sends the values unchanged."""

    name = "none"
    reduction = "summable"
    lossy = False
    decodes_add = True

    def compress(self, x: Any, *, seed: Sequence[int] | int | None = None,
                 out: Payload | None = None, residual: Any = None,
                 decoded: Any = None, tally: np.ndarray | None = None) -> Payload:
        """A payload whose buffer is ``x`` itself (flat, no copy; ``out`` is not used);
        ``residual`` / ``decoded`` (and ``tally``) are applied step by step
        (:func:`.base.compose`)."""
        if residual is not None or decoded is not None:
            return super().compress(x, seed=seed, residual=residual, decoded=decoded,
                                    tally=tally)
        return self._encode(x, seed, None, None, None, None)

    def _encode(self, x: Any, seed: Any, out: Payload | None, fk: Any, residual: Any,
                decoded: Any) -> Payload:
        return Payload(self.name, {"n": size(x)}, {"values": flat(x)})

    def max_nbytes(self, n: int, dtype: str = "float32") -> int:
        return payload_nbytes(self.name, {"n": n}, [("values", dtype, n)])

    def decompress(self, payload: Payload, out: np.ndarray | None = None, *,
                   add: bool = False) -> np.ndarray:
        """The values (a copy, or in ``out``); ``add``: ``out = values + out``."""
        need_out(add, out, self.name)
        check_codec(payload, self.name)
        values = payload.buffers.get("values")
        if values is None or payload.header.get("n") != size(values):
            raise PayloadError("none payload: 'values' missing or of the wrong length")
        dt = dtype_name(values)
        if dt not in _FLOATS:
            raise PayloadError(f"none payload: values of dtype {dt}, expected one of "
                               f"{', '.join(_FLOATS)}")
        if out is None:
            out = empty_like_kind(values, size(values), dt)
            assign(out, values)
            return out
        values = payload.to(out).buffers["values"]
        out = make_out(out, size(values), np.dtype(dt))
        if add:
            out += values                       # IEEE addition commutes
        else:
            assign(out, values)
        return out
