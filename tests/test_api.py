"""gradcomm.allreduce / allreduce_ on numpy arrays and torch CPU tensors.

Contiguous and non-contiguous inputs, any shape; ``x`` untouched; a new array of the same
kind, dtype and shape returned; ``allreduce_`` writes through ``x``'s own strides.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import pytest
import torch

import gradcomm
from gradcomm.bench.data import exact_input, exact_result, exact_values
from gradcomm.collectives import DENSE
from gradcomm.comm import run_ranks
from gradcomm.errors import ConfigError

pytestmark = pytest.mark.timeout(60)
P = 3
OPS = ("sum", "mean", "max", "min", "prod")


def on_ranks(fn: Callable[[Any], Any], p: int = P) -> list[Any]:
    return run_ranks(p, fn, timeout=30)


def ints(rank: int, n: int) -> np.ndarray:
    """``rank``'s n small integers in -8..8 (float64), drawn per (rank, n): no period."""
    return exact_values(rank, n, "int8", "sum")


def numpy_inputs(rank: int) -> dict[str, np.ndarray]:
    """Each rank's inputs: small integers, so every sum is exact."""
    a = ints(rank, 24).reshape(4, 6).astype(np.float32)
    return {
        "scalar": np.array(rank + 1.5),
        "vector": ints(rank, 7).astype(np.int32),
        "matrix": a,
        "transposed": a.T,
        "strided": ints(rank, 40)[::3],
        "fortran": np.asfortranarray(a.astype(np.int16)),
        "column": a[:, 2],
        "3d_slice": ints(rank, 60).astype(np.int64).reshape(3, 4, 5)[:, 1:3, ::2],
        "long": ints(rank, 300).astype(np.float32).reshape(3, 100)[:, ::2],
        "empty": np.zeros((0, 3), np.float16),
        "float16": ints(rank, 10).astype(np.float16),
        "readonly": ints(rank, 5),
    }


def test_numpy_out_of_place() -> None:
    def fn(t: Any) -> dict[str, Any]:
        out = {}
        for name, x in numpy_inputs(t.rank).items():
            if name == "readonly":
                x.flags.writeable = False
            before = x.copy()
            y = gradcomm.allreduce(x, t)
            assert type(y) is np.ndarray and y.dtype == x.dtype and y.shape == x.shape, name
            assert x.tobytes() == before.tobytes(), f"{name}: input modified"
            assert not np.shares_memory(x, y), name
            out[name] = y
        return out

    res = on_ranks(fn)
    for name in res[0]:
        want = sum(numpy_inputs(r)[name].astype(np.float64) for r in range(P))
        for r in range(P):
            assert np.array_equal(res[r][name], want), (name, r)
            assert res[r][name].tobytes() == res[0][name].tobytes(), (name, r)


def test_numpy_in_place_through_strides() -> None:
    def fn(t: Any) -> list[bool]:
        ok = []
        base = np.arange(20, dtype=np.float64).reshape(4, 5) + t.rank
        keep = base.copy()
        view = base[1:, ::2]                # non-contiguous window into base
        y = gradcomm.allreduce_(view, t, op="max")
        ok.append(y is view)
        want = keep.copy()
        want[1:, ::2] = np.arange(20).reshape(4, 5)[1:, ::2] + P - 1
        ok.append(np.array_equal(base, want))           # only the view changed
        z = np.arange(6, dtype=np.int8).reshape(2, 3)
        ok.append(gradcomm.allreduce_(z, t) is z and z.tolist() == [[0, 3, 6], [9, 12, 15]])
        return ok

    assert all(all(r) for r in on_ranks(fn))


@pytest.mark.parametrize("algorithm,compressor", [
    (a, c) for c in (None, "int8") for a in ("auto", "ring", "recursive_doubling",
                                            "rabenseifner")
    if not (c and a == "recursive_doubling")])      # no compressed recursive doubling
def test_contiguous_in_place_reduces_in_the_arrays_own_memory(algorithm: str,
                                                              compressor: Any) -> None:
    """A C-contiguous numpy array is reduced where it lies: ``allreduce_`` allocates at
    least one array per rank less than ``allreduce`` (its working copy, returned) in the
    same call (the transport's scratch kept from a first call; the algorithms' own
    receive buffers remain, none at all for the dense ring), and the sums are exact and
    the same bytes on every rank; a CPU tensor too. Counts 0, 1, below p and not
    divisible by p."""
    import tracemalloc

    n = 1 << 18                             # 1 MiB of float32
    kw = {"algorithm": algorithm, "compressor": compressor}
    counts = (0, 1, P - 1, 2 * P + 1)

    def traced(t: Any, call: Callable[[], Any]) -> tuple[Any, int]:
        """``call()`` on every rank and the peak of what all ranks allocated meanwhile."""
        t.barrier()
        if t.rank == 0:
            tracemalloc.start()
        t.barrier()
        y = call()
        t.barrier()
        peak = tracemalloc.get_traced_memory()[1] if t.rank == 0 else 0
        t.barrier()
        if t.rank == 0:
            tracemalloc.stop()
        return y, peak

    def fn(t: Any) -> list[Any]:
        x = ints(t.rank, n).astype(np.float32)
        gradcomm.allreduce_(x.copy(), t, **kw), gradcomm.allreduce(x, t, **kw)   # warm
        _, fresh = traced(t, lambda: gradcomm.allreduce(x, t, **kw))
        before = x.ctypes.data
        y, peak = traced(t, lambda: gradcomm.allreduce_(x, t, **kw))
        small = []
        for m in counts:
            z = ints(t.rank + 7, m).astype(np.float32)
            zt = torch.from_numpy(z.copy())
            small.append((gradcomm.allreduce_(z, t, **kw) is z, z.copy(),
                          gradcomm.allreduce_(zt, t, **kw) is zt, zt.numpy().copy()))
        return [y is x and x.ctypes.data == before, x, (fresh, peak), small]

    res = on_ranks(fn)
    exact = sum(ints(r, n).astype(np.float32).astype(np.float64) for r in range(P))
    for r, (same, x, _, small) in enumerate(res):
        assert same, r
        assert x.tobytes() == res[0][1].tobytes(), r
        if compressor is None:
            assert np.array_equal(x, exact), r
        for i, m in enumerate(counts):
            is_z, z, is_zt, zt = small[i]
            assert is_z and is_zt and z.tobytes() == res[0][3][i][1].tobytes(), (r, m)
            assert zt.tobytes() == z.tobytes(), (r, m)
            if compressor is None:
                want = sum(ints(q + 7, m).astype(np.float64) for q in range(P))
                assert np.array_equal(z, want), (r, m)
    fresh, peak = res[0][2]
    assert peak <= fresh - P * n * 4 * 9 // 10, f"allreduce_ {peak} B, allreduce {fresh} B"
    if compressor is None and algorithm in ("auto", "ring"):
        assert peak < n * 4 // 10, f"{peak} B traced for {n * 4} B arrays"


TORCH_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64,
                torch.int32, torch.int16, torch.int8, torch.uint8)


def torch_inputs(rank: int) -> dict[str, torch.Tensor]:
    out = {}
    for dt in TORCH_DTYPES:
        vals = exact_values(rank, 30, "uint8" if dt == torch.uint8 else "int8", "sum")
        base = torch.from_numpy(vals).reshape(5, 6).to(dt)
        key = str(dt).removeprefix("torch.")
        out[key] = base
        out[key + "_t"] = base.t()                       # non-contiguous
        out[key + "_slice"] = base[1:4, ::2]             # non-contiguous
    out["scalar"] = torch.tensor(rank + 0.5)
    out["grad"] = torch.ones(4, requires_grad=True) * (rank + 1)
    out["empty"] = torch.zeros(0, 2, dtype=torch.bfloat16)
    return out


def test_torch_out_of_place() -> None:
    def fn(t: Any) -> dict[str, torch.Tensor]:
        out = {}
        for name, x in torch_inputs(t.rank).items():
            before = x.detach().clone()
            y = gradcomm.allreduce(x, t)
            assert isinstance(y, torch.Tensor), name
            assert y.dtype == x.dtype and y.shape == x.shape and y.device == x.device, name
            assert torch.equal(x.detach(), before), f"{name}: input modified"
            assert not y.requires_grad, name
            if x.numel():
                assert y.data_ptr() != x.data_ptr(), name
            out[name] = y
        return out

    res = on_ranks(fn)
    for name in res[0]:
        want = sum(torch_inputs(r)[name].detach().double() for r in range(P))
        for r in range(P):
            got = res[r][name]
            assert torch.equal(got.double(), want), (name, r, got)
            assert torch.equal(got, res[0][name]), (name, r)


def test_large_torch_tensors_out_of_place_are_read_where_they_lie() -> None:
    """Tensors of a pipeline chunk and more take the no-copy source path (the ring reads
    them in place): the input is untouched, the result a new tensor of its dtype and
    shape, exact, and the same bytes on every rank."""
    from gradcomm._plan import Reduction

    def fn(t: Any) -> list[Any]:
        out = []
        for dt in (torch.float32, torch.bfloat16, torch.float16, torch.int64):
            x = torch.from_numpy(ints(t.rank, 1 << 18)).to(dt).reshape(512, -1)
            keep = x.clone()
            assert Reduction().views(x, t) is not None
            y = gradcomm.allreduce(x, t, algorithm="ring")
            out.append((torch.equal(x, keep), y.dtype == dt and y.shape == x.shape,
                        y.data_ptr() != x.data_ptr(), y))
        return out

    res = on_ranks(fn)
    for i, dt in enumerate((torch.float32, torch.bfloat16, torch.float16, torch.int64)):
        want = sum(torch.from_numpy(ints(r, 1 << 18)).double().reshape(512, -1)
                   for r in range(P))
        for r in range(P):
            kept, kind, fresh, y = res[r][i]
            assert kept and kind and fresh, (dt, r)
            assert torch.equal(y.double(), want), (dt, r)
            assert torch.equal(y.view(torch.uint8), res[0][i][3].view(torch.uint8)), (dt, r)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_torch_in_place(dtype: torch.dtype) -> None:
    def fn(t: Any) -> list[bool]:
        ok = []
        x = torch.full((3, 4), float(t.rank), dtype=dtype)
        ok.append(gradcomm.allreduce_(x, t, op="mean") is x)
        ok.append(torch.equal(x, torch.full((3, 4), 1.0, dtype=dtype)))
        base = torch.zeros(4, 6, dtype=dtype)
        view = base.t()[::2]                 # non-contiguous
        view.fill_(t.rank + 1)
        ok.append(gradcomm.allreduce_(view, t) is view)
        want = torch.zeros(4, 6, dtype=dtype)
        want.t()[::2] = 6
        ok.append(torch.equal(base, want))
        return ok

    assert all(all(r) for r in on_ranks(fn))


def test_bfloat16_rounds_like_torch() -> None:
    """Sums that are not exact in bfloat16 round to nearest even, as torch's own add does."""
    vals = [1.0, 2 ** -8, 2 ** -8 + 2 ** -9]

    def fn(t: Any) -> torch.Tensor:
        return gradcomm.allreduce(torch.tensor([vals[t.rank]] * 4, dtype=torch.bfloat16), t,
                                  algorithm="tree")

    res = on_ranks(fn)
    x = [torch.tensor([v] * 4, dtype=torch.bfloat16) for v in vals]
    want = (x[0] + x[1]) + x[2]              # the binomial tree's order for 3 ranks
    for y in res:
        assert torch.equal(y.view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("alg", DENSE + ("auto",))
def test_every_algorithm_and_op(alg: str) -> None:
    def fn(t: Any) -> list[list[float]]:
        x = torch.tensor([[1.0, -2.0], [3.0, 0.5]]) * (t.rank + 1)
        return [gradcomm.allreduce(x, t, op=op, algorithm=alg).flatten().tolist()
                for op in ("sum", "mean", "max", "min", "prod")]

    for res in on_ranks(fn, 4):
        assert res == [[10.0, -20.0, 30.0, 5.0], [2.5, -5.0, 7.5, 1.25],
                       [4.0, -2.0, 12.0, 2.0], [1.0, -8.0, 3.0, 0.5],
                       [24.0, 384.0, 1944.0, 1.5]]

    def long(t: Any) -> list[bytes]:      # 203 elements: a misplaced segment shows
        return [gradcomm.allreduce(exact_input(t.rank, 203, "float32", op), t, op=op,
                                   algorithm=alg).tobytes() for op in OPS]

    want = [exact_result(4, 203, "float32", op).tobytes() for op in OPS]
    assert on_ranks(long, 4) == [want] * 4


def test_single_rank_is_a_copy() -> None:
    def fn(t: Any) -> bool:
        x = np.arange(5.0)
        y = gradcomm.allreduce(x, t, op="mean")
        return y is not x and np.array_equal(x, y) and not np.shares_memory(x, y)

    assert on_ranks(fn, 1) == [True]


def test_bad_arguments() -> None:
    def fn(t: Any) -> list[str]:
        errs = []
        for call in (lambda: gradcomm.allreduce([1.0, 2.0], t),
                     lambda: gradcomm.allreduce(np.ones(2), t, ratio=0.1),
                     lambda: gradcomm.allreduce(torch.ones(2, dtype=torch.complex64), t),
                     lambda: gradcomm.allreduce(np.ones(2), object())):
            try:
                call()
                errs.append("no error")
            except ConfigError as exc:
                errs.append(str(exc))
        return errs

    for errs in on_ranks(fn, 2):
        assert "numpy array, torch tensor or cupy array" in errs[0] and "list" in errs[0]
        assert "unknown options ['ratio']" in errs[1]
        assert "complex64" in errs[2]
        assert "mpi4py communicator" in errs[3]


def test_importing_gradcomm_imports_no_framework() -> None:
    import subprocess
    import sys

    code = ("import sys, gradcomm, gradcomm.collectives.ring, gradcomm.collectives.tree, "
            "gradcomm.collectives.rabenseifner, gradcomm.collectives.auto; "
            "print(sorted(m for m in ('torch', 'mpi4py', 'cupy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "[]"


def test_byte_order_is_normalised():
    """A big-endian array on one rank and a little-endian one on another still sum right."""
    res = run_ranks(2, lambda t: gradcomm.allreduce(
        np.arange(3.0, dtype=">f8" if t.rank else "<f8"), t), timeout=30)
    for r in res:
        assert r.tolist() == [0.0, 2.0, 4.0]


def test_sparse_allgather_without_compressor_sends_the_nonzeros():
    def fn(t):
        x = np.where(np.arange(10) == t.rank, 1.0, 0.0)
        return gradcomm.allreduce(x, t, algorithm="sparse_allgather").tolist()

    for r in run_ranks(3, fn, timeout=30):
        assert r == [1.0, 1.0, 1.0] + [0.0] * 7


def test_a_renamed_copy_of_the_package_resolves_its_lazy_names_in_itself(tmp_path) -> None:
    """``gradcomm.Allreduce`` and the other lazily imported names come from the package
    they are asked of: a copy under another name (bench/compressed_ab.py's baseline)
    must not hand out the installed gradcomm's classes, or an A/B of the stateful
    ``Allreduce`` times the new code twice."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    shutil.copytree(Path(gradcomm.__file__).parent, tmp_path / "gradcomm_copy",
                    ignore=shutil.ignore_patterns("__pycache__"))
    names = ["Allreduce", "sparse_allgather", "gossip_average", "Gossip", "ErrorFeedback",
             "reduce_scatter"]
    code = ("import gradcomm_copy as g\n"
            f"print(all(getattr(g, n).__module__.startswith('gradcomm_copy.') for n in {names}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                         text=True, timeout=120)
    assert out.stdout.strip() == "True", out.stdout + out.stderr
