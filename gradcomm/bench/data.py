"""Benchmark inputs and the exact results they must reduce to.

Dense rows use small integers (in every dtype), so sums, maxima, minima and products are
exact in any order and any rank can compare its result elementwise with the expected one
(the nccl-tests trick). The integers are drawn per (rank, count) from a seeded generator,
so they have no period in the element index and their sums are not all zero: a segment
that lands in the wrong place, or a stale one, changes the result. Compressed rows are
lossy by design: they use Gaussian data, like real gradients, and report the relative
error against the float64 sum instead.

The tests use the same inputs (``tests/_cases.py`` re-exports them).

Example:
    >>> exact_input(1, 4, "int32", "sum").tolist()
    [-5, 3, -2, -4]
    >>> exact_result(2, 4, "int32", "sum").tolist()
    [-10, 0, -2, 0]
"""

from __future__ import annotations

import numpy as np

from .._dtypes import FLOATS, bf16_to_f32, f32_to_bf16, storage

#: the generator's seed; inputs are drawn from ``default_rng((SEED, rank, count, kind))``
SEED = 20261203
#: sum/mean/max/min inputs lie in -SPAN..SPAN (0..SPAN for unsigned dtypes): a sum over
#: p ranks is at most p*SPAN in magnitude, exact in float16 (2**11) and bfloat16 (2**8)
#: up to p = 32, and in int8 up to p = 15 (beyond, integer sums wrap as C and MPI do)
SPAN = 8
#: prod inputs: -1, 1 or (with probability 1/8) 2, so |product| <= 2**p, a power of two
_PROD = np.array([-1, 1, -1, 1, -1, 1, 1, 2], np.int8)


def exact_values(rank: int, count: int, dtype: str, op: str) -> np.ndarray:
    """Rank ``rank``'s small-integer input values as float64 (exact in ``dtype``)."""
    if op == "prod":
        rng = np.random.default_rng((SEED, rank, count, 1))
        v = _PROD[rng.integers(0, _PROD.size, count)]
    else:
        rng = np.random.default_rng((SEED, rank, count, 0))
        v = rng.integers(-SPAN, SPAN + 1, count, dtype=np.int8)
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
    return _to_storage(exact_values(rank, count, dtype, op), dtype)


def exact_result(p: int, count: int, dtype: str, op: str) -> np.ndarray:
    """The result every one of ``p`` ranks must hold, in storage form."""
    acc = exact_values(0, count, dtype, op)
    base = "sum" if op == "mean" else op
    ufunc = {"sum": np.add, "max": np.maximum, "min": np.minimum, "prod": np.multiply}[base]
    for r in range(1, p):
        ufunc(acc, exact_values(r, count, dtype, op), out=acc)
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
