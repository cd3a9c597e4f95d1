"""Benchmark inputs and the exact results they must reduce to.

Dense rows use small integers (in every dtype), so sums, maxima, minima and products are
exact in any order and any rank can compare its result elementwise with the expected one
(the nccl-tests trick). Compressed rows are lossy by design: they use Gaussian data, like
real gradients, and report the relative error against the float64 sum instead.

Example:
    >>> exact_input(1, 4, "int32", "sum").tolist()
    [2, 0, -2, 1]
    >>> exact_result(2, 4, "int32", "sum").tolist()
    [2, -2, -1, 0]
"""

from __future__ import annotations

import numpy as np

from .._dtypes import FLOATS, bf16_to_f32, f32_to_bf16, storage


def _values(rank: int, count: int, dtype: str, op: str) -> np.ndarray:
    """Rank ``rank``'s small-integer values as float64."""
    i = np.arange(count, dtype=np.int64)
    if op == "prod":            # mostly 1, some -1 and 2: |product| <= 2**p
        v = np.where((i + 2 * rank) % 7 == 3, 2, np.where((i + rank) % 3 == 0, -1, 1))
    else:                       # -2..2
        v = (3 * i + 2 * rank + 2) % 5 - 2
    if dtype in ("uint8", "uint16", "uint32", "uint64"):
        v = np.abs(v)
    return v.astype(np.float64)


def _to_storage(v: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        return f32_to_bf16(v.astype(np.float32))
    if dtype in FLOATS:
        return v.astype(storage(dtype))
    return v.astype(np.int64).astype(storage(dtype))   # wraps as C and MPI do


def exact_input(rank: int, count: int, dtype: str, op: str) -> np.ndarray:
    """Rank ``rank``'s input in storage form (bfloat16 as uint16 bits)."""
    return _to_storage(_values(rank, count, dtype, op), dtype)


def exact_result(p: int, count: int, dtype: str, op: str) -> np.ndarray:
    """The result every one of ``p`` ranks must hold, in storage form."""
    acc = _values(0, count, dtype, op)
    base = "sum" if op == "mean" else op
    ufunc = {"sum": np.add, "max": np.maximum, "min": np.minimum, "prod": np.multiply}[base]
    for r in range(1, p):
        ufunc(acc, _values(r, count, dtype, op), out=acc)
    out = _to_storage(acc, dtype)
    if op == "mean" and p > 1:
        if dtype == "bfloat16":
            out = f32_to_bf16(bf16_to_f32(out) / np.float32(p))
        else:
            out = out / out.dtype.type(p)
    return out


def count_wrong(result: np.ndarray, expected: np.ndarray) -> int:
    """Elements of ``result`` that differ from ``expected`` (both in storage form)."""
    if result.dtype.kind == "f":
        return int(np.count_nonzero(~(result == expected)))
    return int(np.count_nonzero(result.view(expected.dtype) != expected))


def gaussian_input(rank: int, count: int, dtype: str) -> np.ndarray:
    """Gradient-like N(0, 1) data, seeded by rank, in storage form."""
    rng = np.random.default_rng(1000 + rank)
    v = rng.standard_normal(count, dtype=np.float32)
    return f32_to_bf16(v) if dtype == "bfloat16" else v.astype(storage(dtype))


def as_float64(buf: np.ndarray, dtype: str) -> np.ndarray:
    """Storage-form ``buf`` as float64 values."""
    if dtype == "bfloat16":
        return bf16_to_f32(buf).astype(np.float64)
    return buf.astype(np.float64)


def gaussian_result(p: int, count: int, dtype: str, op: str) -> np.ndarray:
    """float64 sum (or mean) of every rank's :func:`gaussian_input`."""
    acc = np.zeros(count, np.float64)
    for r in range(p):
        acc += as_float64(gaussian_input(r, count, dtype), dtype)
    return acc / p if op == "mean" else acc


def relative_error(result: np.ndarray, exact: np.ndarray, dtype: str) -> float:
    """``||result - exact|| / ||exact||`` (0.0 when both are empty or zero)."""
    diff = float(np.linalg.norm(as_float64(result, dtype) - exact))
    norm = float(np.linalg.norm(exact))
    return diff / norm if norm else diff
