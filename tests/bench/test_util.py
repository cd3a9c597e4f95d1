"""``gradcomm.bench._util``: the helpers the benchmark's modules share."""

from __future__ import annotations

import numpy as np
import pytest

from gradcomm.bench import _util
from gradcomm.comm import run_ranks
from gradcomm.errors import ConfigError


def test_sizes_parse_in_binary_units_and_bad_ones_are_config_errors() -> None:
    assert _util.parse_sizes("1k, 2MiB,3") == [1024, 2 << 20, 3]
    assert _util.parse_size("1G") == 1 << 30
    for bad in ("4X", "-1", "0"):
        with pytest.raises(ConfigError):
            _util.parse_size(bad)


def test_rank_0_gathers_every_ranks_vector_and_shares_its_status() -> None:
    def fn(t):
        table = _util.gather(t, np.array([t.rank, 10.0 * t.rank]))
        status = _util.agree_status(t, 7 if t.rank == 0 else t.rank)
        return None if table is None else table.tolist(), status

    assert run_ranks(3, fn) == [([[0.0, 0.0], [1.0, 10.0], [2.0, 20.0]], 7), (None, 7),
                                (None, 7)]


def test_the_timer_reports_the_slowest_ranks_median_on_rank_0_only() -> None:
    calls = []

    def fn(t):
        return _util.median_slowest_us(t, lambda: calls.append(t.rank), iters=3, warmup=1)

    out = run_ranks(2, fn)
    assert out[0] is not None and out[0] >= 0.0 and out[1] is None
    assert sorted(calls) == [0] * 4 + [1] * 4


def test_user_arrays_are_numpy_except_bfloat16() -> None:
    x = np.arange(3, dtype=np.float32)
    assert _util.user_array(x, "float32") is x
    torch = pytest.importorskip("torch")
    y = _util.user_array(np.zeros(2, np.uint16), "bfloat16")
    assert y.dtype == torch.bfloat16 and y.shape == (2,)
