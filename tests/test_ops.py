"""``gradcomm.ops``: the reduction operators every layer shares (Reducer, reducer, OPS)."""

from __future__ import annotations

import numpy as np
import pytest

from gradcomm._dtypes import bf16_to_f32, f32_to_bf16
from gradcomm.errors import ConfigError
from gradcomm.ops import OPS, Reducer, reducer


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", ["float16", "float32", "float64", "int32", "uint8"])
def test_combine_is_numpys_elementwise_op(op: str, dtype: str) -> None:
    if op == "mean" and not dtype.startswith("float"):
        pytest.skip("mean needs a floating dtype")
    a = np.array([1, 2, 3, 0], dtype)
    b = np.array([4, 1, 3, 2], dtype)
    want = {"sum": a + b, "mean": a + b, "max": np.maximum(a, b), "min": np.minimum(a, b),
            "prod": a * b}[op]
    out = np.empty_like(a)
    Reducer(op, dtype).combine(a, b, out)
    assert out.tobytes() == want.tobytes()


def test_bfloat16_goes_through_float32_rounding_to_nearest_even() -> None:
    a = f32_to_bf16(np.array([1.0, 3.0, -2.5], np.float32))
    b = f32_to_bf16(np.array([2.0 ** -8, 0.0078125, 0.5], np.float32))
    out = np.empty_like(a)
    Reducer("sum", "bfloat16").combine(a, b, out)
    assert bf16_to_f32(out).tolist() == [1.0, 3.0, -2.0]


def test_bool_sum_is_logical_or_and_mean_finalizes_by_the_rank_count() -> None:
    out = np.empty(3, bool)
    Reducer("sum", "bool").combine(np.array([1, 0, 0], bool), np.array([1, 1, 0], bool), out)
    assert out.tolist() == [True, True, False]
    buf = np.array([3.0, 6.0], np.float32)
    red = Reducer("mean", "float32")
    assert red.base_op == "sum"
    red.finalize(buf, 3)
    assert buf.tolist() == [1.0, 2.0]


def test_reducers_are_shared_and_bad_arguments_are_config_errors() -> None:
    assert reducer("max", "int64") is reducer("max", "int64")
    with pytest.raises(ConfigError, match="unknown op"):
        Reducer("avg", "float32")
    with pytest.raises(ConfigError, match="floating dtype"):
        Reducer("mean", "int32")
    with pytest.raises(ConfigError, match="unsupported dtype"):
        Reducer("sum", "complex64")
