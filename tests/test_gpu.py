"""Array kinds and devices: numpy, torch CPU, torch CUDA, cupy through the public API.

Every test runs once per available "place": ``torch-cpu`` and ``numpy`` always (so the
logic is covered on any machine), ``torch-cuda`` where ``torch.cuda.is_available()`` and
``cupy`` where ``cupy.cuda.is_available()`` (importing cupy is not enough). The CUDA places
skip cleanly elsewhere. ``bench/gpu_check.py`` runs this file on a GPU machine.

Covered: staged allreduce (host copies that wait for the producing stream), the
device-resident path of a transport that moves device buffers (``to_flat_for`` +
``dense_allreduce`` on cupy buffers), ``gradcomm.Allreduce`` with a compressor and error
feedback, and the DDP comm hook on a model on the device.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import gradcomm  # noqa: E402
from gradcomm import _array  # noqa: E402
from gradcomm.collectives import dense_allreduce  # noqa: E402
from gradcomm.comm import run_ranks  # noqa: E402

pytestmark = pytest.mark.timeout(120)

TORCH_CUDA = _array.cuda_usable("torch")
CUPY = _array.cuda_usable("cupy")
PLACES = [
    pytest.param("numpy"),
    pytest.param("torch-cpu"),
    pytest.param("torch-cuda", marks=pytest.mark.skipif(
        not TORCH_CUDA, reason="no GPU: torch.cuda.is_available() is False")),
    pytest.param("cupy", marks=pytest.mark.skipif(
        not CUPY, reason="no GPU: cupy missing or cupy.cuda.is_available() is False")),
]
_TORCH_DT = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
             "float64": torch.float64, "int32": torch.int32}


def make(place: str, values: np.ndarray, dtype: str):
    """``values`` (float64) as an array of ``place`` and logical ``dtype``."""
    if place == "numpy":
        return values.astype(dtype)
    if place == "cupy":
        import cupy

        return cupy.asarray(values.astype(dtype))
    t = torch.from_numpy(values).to(_TORCH_DT[dtype])
    return t.cuda() if place == "torch-cuda" else t


def host(x) -> np.ndarray:
    """Values of any array as float64 numpy."""
    if isinstance(x, np.ndarray):
        return x.astype(np.float64)
    if isinstance(x, torch.Tensor):
        return x.detach().double().cpu().numpy()
    import cupy

    return cupy.asnumpy(x).astype(np.float64)


def where(x) -> tuple[str, str]:
    m = _array.meta_of(x)
    return m.kind, m.device


def dtypes_for(place: str) -> list[str]:
    if place in ("numpy", "cupy"):
        return ["float16", "float32", "float64", "int32"]
    return ["float16", "bfloat16", "float32", "float64", "int32"]


@pytest.mark.parametrize("place", PLACES)
def test_allreduce_keeps_kind_device_dtype_and_sums_exactly(place):
    dts = dtypes_for(place)

    def fn(t):
        out = []
        for dt in dts:
            vals = np.arange(12, dtype=np.float64).reshape(3, 4) + t.rank
            x = make(place, vals, dt)
            before = host(x)
            for algo in ("ring", "recursive_doubling"):
                y = gradcomm.allreduce(x, t, algorithm=algo)
                assert where(y) == where(x) and y.dtype == x.dtype and y.shape == x.shape
                np.testing.assert_array_equal(host(x), before)     # input untouched
                out.append((dt, algo, host(y)))
            yt = gradcomm.allreduce(x.T, t, op="max")                # non-contiguous input
            assert tuple(yt.shape) == (4, 3) and where(yt) == where(x)
            out.append((dt, "max", host(yt)))
        return out

    results = run_ranks(3, fn, timeout=60)
    base = np.arange(12, dtype=np.float64).reshape(3, 4)
    for r in results:
        for dt, algo, y in r:
            want = (base.T + 2) if algo == "max" else 3 * base + 3
            np.testing.assert_array_equal(y, want, err_msg=f"{place} {dt} {algo}")


@pytest.mark.parametrize("place", PLACES)
def test_device_resident_path_for_transports_that_move_device_buffers(place):
    """With ``"cuda" in t.devices`` a CUDA array is reduced on its device (cupy buffers);
    host arrays take the host path whatever the transport can do."""

    def fn(t):
        t.devices = frozenset({"cpu", "cuda"})      # as a CUDA-aware MPI transport says
        x = make(place, np.arange(10, dtype=np.float64) * (t.rank + 1), "float32")
        buf, meta = _array.to_flat_for(x, t.devices)
        expect_device = meta.device != "cpu" and CUPY
        assert _array.is_device(buf) == expect_device
        assert _array.placement(meta, t.devices) == ("device" if expect_device else "host")
        dense_allreduce(t, buf, "sum", meta.dtype, "ring")
        _array.sync(buf)
        y = _array.from_device_flat(buf, meta)
        assert where(y) == where(x)
        return host(y)

    for y in run_ranks(2, fn, timeout=60):
        np.testing.assert_array_equal(y, np.arange(10) * 3.0)


@pytest.mark.parametrize("place", PLACES)
def test_public_api_on_a_transport_that_moves_device_buffers(place):
    """gradcomm.allreduce / Allreduce keep CUDA arrays on the device for dense sums when
    the transport says it can move them; compressed sums are staged; same results."""

    def fn(t):
        t.devices = frozenset({"cpu", "cuda"})
        x = make(place, np.arange(6, dtype=np.float64) * (t.rank + 1), "float32")
        outs = [gradcomm.allreduce(x, t, algorithm=a) for a in ("ring", "tree", "native")]
        outs.append(gradcomm.Allreduce(t, op="sum")(x, key="w"))
        outs.append(gradcomm.allreduce(x, t, compressor="fp16"))
        for y in outs:
            assert where(y) == where(x) and y.dtype == x.dtype
        return [host(y) for y in outs]

    for ys in run_ranks(2, fn, timeout=60):
        for y in ys:
            np.testing.assert_array_equal(y, np.arange(6) * 3.0)


@pytest.mark.parametrize("place", PLACES)
def test_to_flat_for_round_trips_bitwise_and_never_aliases(place):
    vals = np.linspace(-3, 3, 17)
    for dt in ("float16", "float32", "bfloat16") if place.startswith("torch") else \
            ("float16", "float32"):
        x = make(place, vals, dt)
        buf, meta = _array.to_flat_for(x, {"cpu", "cuda"})
        buf[...] = 0                                     # x must not change
        assert host(x).tolist() == host(make(place, vals, dt)).tolist()
        buf2, meta2 = _array.to_flat_for(x, {"cpu", "cuda"})
        y = _array.from_device_flat(buf2, meta2)
        assert where(y) == where(x) and y.dtype == x.dtype
        np.testing.assert_array_equal(host(y), host(x))


@pytest.mark.parametrize("place", PLACES)
def test_Allreduce_object_with_compressor_and_error_feedback(place):
    lossy = [n for n in gradcomm.compressors.names() if n != "none"]
    codec = "fp16" if "fp16" in lossy else (lossy[0] if lossy else "none")

    def fn(t):
        ar = gradcomm.Allreduce(t, compressor=codec, algorithm="ring")
        outs = []
        for step in range(3):
            x = make(place, np.linspace(0, 1, 40) * (t.rank + 1) + step, "float32")
            y = ar(x, key="w")
            assert where(y) == where(x) and y.dtype == x.dtype
            outs.append(host(y))
        return outs, ar.state_dict()

    results = run_ranks(2, fn, timeout=60)
    for step, y in enumerate(results[0][0]):
        np.testing.assert_array_equal(y, results[1][0][step])    # same bytes on every rank
        np.testing.assert_allclose(y, np.linspace(0, 1, 40) * 1.5 + step, atol=2e-2)


def wrap_device_allreduce(place: str) -> list[float]:
    """On every MPI rank: wrap(COMM_WORLD).Allreduce of a device array (in place and out
    of place); staged through host memory unless the MPI is CUDA-aware."""
    from mpi4py import MPI

    from gradcomm.integrations.mpi import wrap

    comm = wrap(MPI.COMM_WORLD, algorithm="ring")
    r = comm.Get_rank()
    x = make(place, np.arange(5, dtype=np.float64) + r, "float32")
    comm.Allreduce(MPI.IN_PLACE, x, op=MPI.SUM)
    y = make(place, np.zeros(5), "float32")
    comm.Allreduce(x, y, op=MPI.MAX)
    return host(x).tolist() + host(y).tolist()


@pytest.mark.parametrize("place", PLACES[2:])    # host arrays: tests/integrations/test_mpi_wrap.py
def test_wrap_accepts_device_arrays_under_mpirun(place):
    from tests._launch import mpi_call, require_mpi

    require_mpi()
    for out in mpi_call(wrap_device_allreduce, 2, place, timeout=90):
        assert out == (2 * np.arange(5) + 1.0).tolist() * 2


def _one_rank_group():
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return dist


@pytest.mark.parametrize("place", [p for p in PLACES if p.values[0].startswith("torch")])
@pytest.mark.parametrize("compressor", [None, "lossy"])
def test_ddp_hook_on_the_device(place, compressor):
    """One rank: the hook's result is the gradient itself (p = 1 sends nothing lossy)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from gradcomm.integrations.ddp import make_comm_hook

    lossy = [n for n in gradcomm.compressors.names() if n != "none"]
    if compressor == "lossy":
        compressor = "topk" if "topk" in lossy else (lossy[0] if lossy else "none")
    dev = "cuda" if place == "torch-cuda" else "cpu"
    dist = _one_rank_group()
    try:
        torch.manual_seed(0)
        ref = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 2)).to(dev)
        model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 2)).to(dev))
        model.module.load_state_dict(ref.state_dict())
        state, hook = make_comm_hook(compressor, model=model)
        model.register_comm_hook(state, hook)
        for _ in range(3):
            x = torch.randn(5, 8, device=dev)
            for m in (ref, model):
                m.zero_grad()
                m(x).square().sum().backward()
            for a, b in zip(ref.parameters(), model.parameters()):
                assert b.grad.device == a.grad.device
                torch.testing.assert_close(b.grad, a.grad, rtol=0, atol=0)
        assert state.iter == 3
        state.close()
    finally:
        dist.destroy_process_group()
