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

from .base import Compressor, Payload, check_codec, make_out, need_out, payload_nbytes
from ..errors import PayloadError


_FLOATS = ("float16", "float32", "float64")


class NoneCompressor(Compressor):
    """Sends the values unchanged."""

    name = "none"
    reduction = "summable"
    lossy = False

    def compress(self, x: np.ndarray, *, seed: Sequence[int] | int | None = None) -> Payload:
        return Payload(self.name, {"n": int(x.size)}, {"values": x.reshape(-1)})

    def max_nbytes(self, n: int, dtype: str = "float32") -> int:
        return payload_nbytes(self.name, {"n": n}, [("values", dtype, n)])

    def decompress(self, payload: Payload, out: np.ndarray | None = None,
                   add: bool = False) -> np.ndarray:
        """The values (a copy, or in ``out``); ``add``: ``out = values + out``."""
        need_out(add, out, self.name)
        check_codec(payload, self.name)
        values = payload.buffers.get("values")
        if values is None or payload.header.get("n") != values.size:
            raise PayloadError("none payload: 'values' missing or of the wrong length")
        if values.dtype.name not in _FLOATS:
            raise PayloadError(f"none payload: values of dtype {values.dtype.name}, "
                               f"expected one of {', '.join(_FLOATS)}")
        if out is None:
            return values.copy()
        out = make_out(out, values.size, values.dtype)
        if add:
            np.add(values, out, out=out)
        else:
            out[...] = values
        return out
