"""The small-call path (``gradcomm.collectives.small``) under a real mpirun, 3 ranks.

A checked dense allreduce below one pipeline chunk that goes to ``MPI_Allreduce`` is
resolved once per (count, dtype, op, algorithm); later calls skip the general path (numpy
arrays, also into ``out=``, CPU tensors, ``wrap(comm).Allreduce``). Each case checks that the short cut was taken (the general path's ``dense_allreduce`` not
called), the exact result (per-rank integers, no period) at counts 1, 2 (< p), 5 (not
divisible by p) and 1000, and that it is still a checked call: a rank passing another
count, op or dtype is a MismatchError on every rank (whether or not the others took the
short cut), a rank that never joins a DeadlineError, and a rank without the entry (the
general path) still meets the ones with it.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests._late import late_rank, outcome
from tests._launch import mpi_call, require_mpi

COUNTS = (1, 2, 5, 1000)
CASES = (("float32", "sum"), ("float64", "mean"), ("int32", "max"), ("int64", "min"),
         ("float64", "prod"))


def small_calls() -> dict[str, Any]:

    import numpy as np
    from mpi4py import MPI

    import gradcomm
    import gradcomm._plan as plan_module
    from gradcomm.bench.data import exact_input, exact_result
    from gradcomm.comm import get_transport
    from gradcomm.integrations.mpi import wrap

    t = get_transport(MPI.COMM_WORLD, timeout=20)
    rank, p = t.rank, t.size
    general = [0]
    inner = plan_module.dense_allreduce

    def counted(*args: Any, **kwargs: Any) -> Any:
        general[0] += 1
        return inner(*args, **kwargs)

    plan_module.dense_allreduce = counted
    out: dict[str, Any] = {"wrong": [], "general": []}

    for dtype, op in CASES:
        for n in COUNTS:
            x = exact_input(rank, n, dtype, op)
            want = exact_result(p, n, dtype, op).tobytes()
            before = general[0]
            for i in range(3):                  # the general path once, then the short cut
                y = gradcomm.allreduce(x, t, op=op)
                z = x.copy()
                gradcomm.allreduce_(z, t, op=op)
                w = np.full_like(x, 7)          # out=: written by the short cut too
                if y.tobytes() != want or z.tobytes() != want or y.shape != x.shape or \
                        np.shares_memory(x, y) or \
                        gradcomm.allreduce(x, t, op=op, out=w) is not w or \
                        w.tobytes() != want:
                    out["wrong"].append((dtype, op, n, i))
            out["general"].append(general[0] - before)
            assert x.tobytes() == exact_input(rank, n, dtype, op).tobytes()

    # CPU tensors: the same short cut through a numpy view of their memory
    import torch

    out["torch_general"] = []
    for dtype, op, n in (("float32", "sum", 6), ("int64", "max", 77), ("float64", "mean", 3)):
        base = exact_input(rank, n, dtype, op)
        want = exact_result(p, n, dtype, op)
        before = general[0]
        for i in range(3):
            x = torch.from_numpy(base.copy()).reshape(1, n)
            x.requires_grad_(dtype != "int64")
            y = gradcomm.allreduce(x, t, op=op)
            z = x.detach().clone()
            zz = gradcomm.allreduce_(z, t, op=op)
            if not (type(y) is torch.Tensor and y.shape == (1, n) and zz is z and
                    y.numpy().tobytes() == want.tobytes() == z.numpy().tobytes() and
                    x.detach().numpy().tobytes() == base.tobytes()):
                out["wrong"].append(("torch", dtype, op, n, i))
        out["torch_general"].append(general[0] - before)
    strided = torch.from_numpy(exact_input(rank, 12, "float32", "sum")).reshape(3, 4).t()
    before = general[0]
    for i in range(2):                      # not contiguous: the general path every time
        if gradcomm.allreduce(strided, t).numpy().tobytes() != \
                torch.from_numpy(exact_result(p, 12, "float32", "sum")).reshape(3, 4).t() \
                .contiguous().numpy().tobytes():
            out["wrong"].append(("strided", i))
    out["strided_general"] = general[0] - before
    import gradcomm.arrays as arrays_module     # a full type cache: backends found each time

    limit, arrays_module._TYPES_LIMIT = arrays_module._TYPES_LIMIT, 0
    arrays_module._TYPES.clear()
    x = torch.from_numpy(exact_input(rank, 6, "float32", "sum")).reshape(1, 6)
    y = gradcomm.allreduce(x, t)                # resolved above: the short cut
    out["uncached"] = type(y) is torch.Tensor and \
        y.numpy().tobytes() == exact_result(p, 6, "float32", "sum").tobytes()
    arrays_module._TYPES_LIMIT = limit

    x = exact_input(rank, 5, "float32", "sum")
    y = np.empty_like(x)
    comm = wrap(MPI.COMM_WORLD)
    want = exact_result(p, 5, "float32", "sum").tobytes()
    before = general[0]
    for i in range(3):
        y[:] = -1
        comm.Allreduce(x, y)
        z = x.copy()
        comm.Allreduce(MPI.IN_PLACE, z)
        if y.tobytes() != want or z.tobytes() != want:
            out["wrong"].append(("wrap", i))
    out["wrap_general"] = general[0] - before
    y[:] = -1
    out["wrap_count"] = outcome(lambda: comm.Allreduce(x[:4 + (rank == 1)],
                                                       y[:4 + (rank == 1)]))
    out["wrap_untouched"] = bool((y == -1).all())

    # the short cut is still checked: rank 1 passes other arguments (which it has
    # resolved too, or not: the general path)
    ones = {n: np.ones(n, np.float32) for n in (7, 8)}
    for n in (7, 8):
        for i in range(2):
            gradcomm.allreduce(ones[n], t)
    before = general[0]
    out["count"] = outcome(lambda: gradcomm.allreduce(ones[8 if rank == 1 else 7], t))
    out["op"] = outcome(lambda: gradcomm.allreduce(ones[7], t, op="max" if rank == 1
                                                   else "sum"))
    out["dtype"] = outcome(lambda: gradcomm.allreduce(
        ones[7].astype(np.float64) if rank == 1 else ones[7], t))
    out["new_count"] = outcome(lambda: gradcomm.allreduce(np.ones(9 if rank == 1 else 7,
                                                                  np.float32), t))
    out["mismatch_general"] = general[0] - before
    if rank == 1:
        t.state.small.clear()               # rank 1 goes the general way, the others not
    before = general[0]
    out["mixed"] = gradcomm.allreduce(ones[7], t).tolist() == [float(p)] * 7
    out["mixed_general"] = general[0] - before

    # a rank that never joins: the short cut's check expires (DeadlineError); what a
    # transport keeps (its resolved calls) holds no reference back to it
    out.update(late_rank(warm=True))
    plan_module.dense_allreduce = inner
    return out


@pytest.mark.timeout(120)
def test_small_calls_take_the_short_cut_and_stay_checked() -> None:
    require_mpi()
    res = mpi_call(small_calls, 3, timeout=100, env={"GRADCOMM_PROFILE": "none"})
    for r in res:
        assert r["wrong"] == []
        # allreduce and allreduce_ resolve the same entry: the general path once per case
        assert r["general"] == [1] * (len(CASES) * len(COUNTS))
        assert r["wrap_general"] == 1
        assert r["torch_general"] == [1, 1, 1] and r["strided_general"] == 2
        assert r["uncached"]
        for case in ("count", "op", "dtype", "new_count", "wrap_count"):
            assert r[case].startswith("MismatchError"), (case, r[case])
        assert "count ranges from 7 to 8" in r["count"]
        assert r["wrap_untouched"]
        assert r["mixed"] and r["after_late"] and r["freed"]
    assert [r["mismatch_general"] for r in res] == [0, 3, 0]   # rank 1: new op, dtype, count
    assert [r["mixed_general"] for r in res] == [0, 1, 0]
    assert res[0]["late"].startswith("DeadlineError") and 0.4 < res[0]["late_seconds"] < 5
