"""Logical dtypes and the storage that carries them.

gradcomm moves every array as a flat host (or device) buffer of a numpy-compatible storage
dtype. ``bfloat16`` has no numpy dtype: it is stored as ``uint16`` and converted here.

Example:
    >>> import numpy as np
    >>> from gradcomm._dtypes import f32_to_bf16, bf16_to_f32
    >>> bf16_to_f32(f32_to_bf16(np.array([1.0, 3.140625], np.float32)))
    array([1.      , 3.140625], dtype=float32)
"""

from __future__ import annotations

import numpy as np

from .errors import ConfigError

#: logical dtype name -> numpy storage dtype
STORAGE: dict[str, np.dtype] = {
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(np.uint16),
    "float32": np.dtype(np.float32),
    "float64": np.dtype(np.float64),
    "int8": np.dtype(np.int8),
    "int16": np.dtype(np.int16),
    "int32": np.dtype(np.int32),
    "int64": np.dtype(np.int64),
    "uint8": np.dtype(np.uint8),
    "uint16": np.dtype(np.uint16),
    "uint32": np.dtype(np.uint32),
    "uint64": np.dtype(np.uint64),
    "bool": np.dtype(np.bool_),
}
#: stable small integer per logical dtype (used in cross-rank signatures and payloads)
CODES: dict[str, int] = {name: i + 1 for i, name in enumerate(STORAGE)}
NAMES: dict[int, str] = {code: name for name, code in CODES.items()}
FLOATS = frozenset({"float16", "bfloat16", "float32", "float64"})


def storage(name: str) -> np.dtype:
    """numpy dtype that stores logical dtype ``name``."""
    try:
        return STORAGE[name]
    except KeyError:
        raise ConfigError(f"unsupported dtype {name!r}; supported: {', '.join(STORAGE)}") from None


def bf16_to_f32(u16: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Widen bfloat16 bits (uint16) to float32, exactly."""
    wide = np.left_shift(u16.astype(np.uint32), 16)
    if out is None:
        return wide.view(np.float32)
    out.view(np.uint32)[...] = wide
    return out


def f32_to_bf16(f32: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Round float32 to bfloat16 bits (uint16), to nearest even; NaN stays a quiet NaN."""
    bits = np.ascontiguousarray(f32, dtype=np.float32).view(np.uint32)
    rounded = bits + (np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1)))
    res = (rounded >> 16).astype(np.uint16)
    nan = np.isnan(f32)
    if nan.any():
        res[nan] = ((bits[nan] >> 16) | np.uint32(0x0040)).astype(np.uint16)
    if out is None:
        return res
    out[...] = res
    return out
