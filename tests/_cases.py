"""Shared conformance cases: exact inputs, exact expected results, byte comparison.

Inputs are small integers (in every dtype), so sums, maxima, minima and products are
exact in any order; expected values are computed in int64/float64 and cast the way the
library casts. Used by the in-process matrix and by the mpirun / gloo scripts.
"""

from __future__ import annotations

import numpy as np

from gradcomm._dtypes import FLOATS, bf16_to_f32, f32_to_bf16, storage

DTYPES = ("float16", "bfloat16", "float32", "float64", "int8", "int16", "int32", "int64",
          "uint8")
OPS = ("sum", "mean", "max", "min", "prod")
LARGE = (65537, 2 ** 20 + 7)


def small_counts(p: int) -> list[int]:
    """0, 1, p-1, p, p+1, 2p+3 (deduplicated, sorted)."""
    return sorted({0, 1, max(p - 1, 0), p, p + 1, 2 * p + 3})


def values(rank: int, count: int, dtype: str, op: str) -> np.ndarray:
    """Exact small-integer values (as float64) for ``rank``'s input."""
    i = np.arange(count, dtype=np.int64)
    if op == "prod":                        # +-1 and occasional 2: |product| <= 2^p
        v = np.where((i + rank) % 5 == 0, 2, np.where((i * 3 + rank) % 4 == 1, -1, 1))
    else:
        v = (i * 7 + rank * 3) % 5 - 2       # -2..2
    if dtype == "uint8":
        v = np.abs(v)
    return v.astype(np.float64)


def to_storage(v: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        return f32_to_bf16(v.astype(np.float32))
    return v.astype(storage(dtype)) if dtype not in ("int8", "uint8", "int16", "int32") \
        else v.astype(np.int64).astype(storage(dtype))


def make_input(rank: int, count: int, dtype: str, op: str) -> np.ndarray:
    """``rank``'s input in storage form (bfloat16 as uint16 bits)."""
    return to_storage(values(rank, count, dtype, op), dtype)


def expected(p: int, count: int, dtype: str, op: str) -> np.ndarray:
    """The exact result every rank must hold, in storage form."""
    stack = np.stack([values(r, count, dtype, op) for r in range(p)]) if count else \
        np.zeros((p, 0))
    base = "sum" if op == "mean" else op
    exact = {"sum": stack.sum(0), "max": stack.max(0), "min": stack.min(0),
             "prod": stack.prod(0)}[base] if p else stack
    if dtype not in FLOATS:
        out = exact.astype(np.int64).astype(storage(dtype))   # wraps like the library
    else:
        out = to_storage(exact, dtype)
    if op == "mean" and p > 1:
        if dtype == "bfloat16":
            out = f32_to_bf16(bf16_to_f32(out) / np.float32(p))
        else:
            out = out / out.dtype.type(p)
    return out


def op_applies(op: str, dtype: str) -> bool:
    """mean is defined for floating dtypes only (ConfigError otherwise)."""
    return op != "mean" or dtype in FLOATS


def same_bytes(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
