"""float16 ``op="mean"``: a sum that overflows float16 is reduced again in float32, so the
mean of finite inputs is finite; every other element keeps the bytes of sum-then-divide."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import gradcomm
from gradcomm.collectives import DENSE
from gradcomm.comm import run_ranks

MAX16 = float(np.finfo(np.float16).max)


def inputs(rank: int, n: int) -> np.ndarray:
    x = (np.arange(n, dtype=np.float32) % 7 - 3 + rank).astype(np.float16)
    x[::3] = np.float16(6e4 - 32 * rank)           # sums of these overflow float16
    if n > 4:
        x[4] = np.inf if rank == 0 else 1           # a genuine inf stays inf
    return x


@pytest.mark.timeout(120)
@pytest.mark.parametrize("alg", DENSE + ("auto",))
@pytest.mark.parametrize("p", [2, 3])
def test_float16_mean_does_not_overflow(p: int, alg: str) -> None:
    for n in (0, 1, p - 1, 7, 1000):
        xs = [inputs(r, n) for r in range(p)]
        res = run_ranks(p, lambda t: gradcomm.allreduce(xs[t.rank], t, op="mean",
                                                        algorithm=alg), timeout=60)
        assert len({r.tobytes() for r in res}) == 1, (alg, n)     # same bytes everywhere
        y = res[0]
        exact = (np.sum([x.astype(np.float64) for x in xs], axis=0) / p).astype(np.float16)
        big = np.isfinite(exact) & (np.abs(exact.astype(np.float64)) * p > MAX16)
        assert (y[big] == exact[big]).all(), (alg, n)             # was inf before
        if n > 4:
            assert y[4] == np.inf
        assert np.isfinite(y[np.isfinite(exact)]).all()
        # the elements that did not overflow keep the sum-then-divide bytes
        plain = run_ranks(p, lambda t: gradcomm.allreduce(xs[t.rank], t, op="sum",
                                                          algorithm=alg), timeout=60)[0]
        with np.errstate(over="ignore"):
            div = (plain / np.float16(p)).astype(np.float16)
        keep = np.isfinite(plain)
        assert y[keep].tobytes() == div[keep].tobytes(), (alg, n)


@pytest.mark.timeout(60)
def test_float16_mean_in_allreduce_object() -> None:
    def fn(t: Any) -> list[float]:
        ar = gradcomm.Allreduce(t, op="mean")
        return ar(np.full(4, 6e4, np.float16)).tolist()

    assert run_ranks(2, fn) == [[60000.0] * 4] * 2
