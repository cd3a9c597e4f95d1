"""Byte-swapped numpy arrays (``x.dtype.isnative`` false, e.g. ``">f8"`` on a
little-endian machine): ``gradcomm.allreduce``, ``allreduce_`` and ``gradcomm.Allreduce``
reduce their values (the same results as of native arrays; ``allreduce_`` keeps the
caller's byte order), on real thread ranks. ``wrap(comm).Allreduce``'s refusal (as mpi4py
refuses them): tests/integrations/test_mpi_wrap.py."""

from __future__ import annotations

import numpy as np
import pytest

import gradcomm
from gradcomm.bench.data import exact_input, exact_result
from gradcomm.comm import run_ranks

N = 1031


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dtype", ["float64", "float32", "int32"])
def test_swapped_arrays_reduce_to_their_values(dtype: str) -> None:
    def fn(t):
        x = exact_input(t.rank, N, dtype, "sum")
        sw = x.astype(x.dtype.newbyteorder("S"))
        assert not sw.dtype.isnative and np.array_equal(sw, x)
        out = {"allreduce": gradcomm.allreduce(sw, t, op="sum"),
               "class": gradcomm.Allreduce(t, op="sum", error_feedback=False)(sw, key="w")}
        y = sw.copy()
        gradcomm.allreduce_(y, t, op="sum")
        out["in_place"] = y
        if dtype != "int32":                  # fp16 is exact on these small integers
            out["fp16"] = gradcomm.allreduce(sw, t, op="sum", compressor="fp16")
        return out, y.dtype.str == sw.dtype.str

    want = exact_result(2, N, dtype, "sum")
    for out, kept in run_ranks(2, fn):
        assert kept                                          # allreduce_: caller's order
        for name, got in out.items():
            assert np.array_equal(got, want), name
