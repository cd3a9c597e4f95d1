"""Shared conformance cases: exact inputs, exact expected results, byte comparison.

The inputs are those of the benchmark (:mod:`gradcomm.bench.data`): small integers drawn
per (rank, count) from a seeded generator, in every dtype, so sums, maxima, minima and
products are exact in any order, and with no period in the element index, so a misplaced
or stale segment shows. Expected values are computed in float64 and cast the way the
library casts. Used by the in-process matrix and by the mpirun / gloo scripts.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from gradcomm._dtypes import FLOATS
from gradcomm.bench.data import exact_input, exact_result, exact_values

DTYPES = ("float16", "bfloat16", "float32", "float64", "int8", "int16", "int32", "int64",
          "uint8")
OPS = ("sum", "mean", "max", "min", "prod")
LARGE = (65537, 2 ** 20 + 7)


def small_counts(p: int) -> list[int]:
    """0, 1, p-1, p, p+1, 2p+3 (deduplicated, sorted)."""
    return sorted({0, 1, max(p - 1, 0), p, p + 1, 2 * p + 3})


def values(rank: int, count: int, dtype: str, op: str) -> np.ndarray:
    """Exact small-integer values (as float64) for ``rank``'s input."""
    return exact_values(rank, count, dtype, op)


def make_input(rank: int, count: int, dtype: str, op: str) -> np.ndarray:
    """``rank``'s input in storage form (bfloat16 as uint16 bits)."""
    return exact_input(rank, count, dtype, op)


def expected(p: int, count: int, dtype: str, op: str) -> np.ndarray:
    """The exact result every one of ``p`` ranks must hold, in storage form."""
    return exact_result(p, count, dtype, op)


def op_applies(op: str, dtype: str) -> bool:
    """mean is defined for floating dtypes only (ConfigError otherwise)."""
    return op != "mean" or dtype in FLOATS


def same_bytes(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def torch_roundtrip(state: Any) -> Any:
    """``state`` through ``torch.save`` and ``torch.load(weights_only=True)`` with gradcomm's
    safe globals, as a checkpoint is saved and resumed."""
    import io

    import torch

    from gradcomm.error_feedback import torch_safe_globals

    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    with torch.serialization.safe_globals(torch_safe_globals()):
        return torch.load(buf, weights_only=True)


def refused_on_every_rank(defaults: dict[str, Any], n: int,
                          cases: list[tuple[dict[str, Any], type, str]], p: int = 3) -> None:
    """For each ``(kwargs, error, text)`` of ``cases``: ``compressed_allreduce`` of ``n``
    ones with ``defaults`` updated by ``kwargs`` (``dtype`` among them, default float32)
    raises ``error`` with ``text`` in its message on every one of ``p`` real ranks."""
    from gradcomm.comm import run_ranks
    from gradcomm.compressed import compressed_allreduce

    def fn(t, **kw):
        args = {"dtype": "float32", **defaults, **kw}
        dtype = args.pop("dtype")
        x = np.ones(n, np.int32 if dtype == "int32" else np.float32)
        try:
            compressed_allreduce(t, x, dtype, **args)
        except Exception as exc:               # noqa: BLE001 - the type is the point
            return type(exc).__name__, str(exc)
        return None, ""

    for kw, exc, text in cases:
        for name, msg in run_ranks(p, lambda t: fn(t, **kw)):
            assert name == exc.__name__ and text in msg, (kw, name, msg)
