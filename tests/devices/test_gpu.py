"""Array kinds and devices: numpy, torch CPU, torch CUDA, cupy through the public API.

Every test runs once per available "place": ``torch-cpu`` and ``numpy`` always (so the
logic is covered on any machine), ``torch-cuda`` where ``torch.cuda.is_available()`` and
``cupy`` where ``cupy.cuda.is_available()`` (importing cupy is not enough). The CUDA places
skip cleanly elsewhere. ``bench/gpu_check.py`` runs this file on a GPU machine.

Covered: staged allreduce (host copies that wait for the producing stream), the
device-resident path of a transport that moves device buffers (``arrays.placement`` +
``to_flat`` + ``dense_allreduce`` on cupy buffers), ``gradcomm.Allreduce`` with a compressor and error
feedback, the compressed path of the public API (staged for the codecs, result back on
the device), the byte copies ``wrap()`` stages device buffers with
(``arrays.copy_to_host`` / ``copy_from_host`` / ``byte_view``), ``wrap()``'s routes
(direct on a transport that moves device buffers, else staged) in-process on COMM_SELF and
under mpirun, and the DDP comm hook on a model on the device.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import gradcomm  # noqa: E402
from gradcomm import arrays  # noqa: E402
from gradcomm.collectives import dense_allreduce  # noqa: E402
from gradcomm.comm import run_ranks  # noqa: E402

pytestmark = pytest.mark.timeout(120)

TORCH_CUDA = arrays.cuda_usable("torch")
CUPY = arrays.cuda_usable("cupy")
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
    t = torch.from_numpy(values.copy()).to(_TORCH_DT[dtype])       # never shares values
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
    m = arrays.meta_of(x)
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
        at = arrays.placement(arrays.meta_of(x), t.devices)
        buf, meta = arrays.to_flat(x, at)
        expect_device = meta.device != "cpu" and CUPY
        assert arrays.is_device(buf) == expect_device
        assert at == ("device" if expect_device else "host")
        dense_allreduce(t, buf, "sum", meta.dtype, "ring")
        arrays.sync(buf)
        y = arrays.from_flat(buf, meta)
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
def test_to_flat_round_trips_bitwise_and_never_aliases(place):
    vals = np.linspace(-3, 3, 17)
    for dt in ("float16", "float32", "bfloat16") if place.startswith("torch") else \
            ("float16", "float32"):
        x = make(place, vals, dt)
        at = arrays.placement(arrays.meta_of(x), {"cpu", "cuda"})
        buf, meta = arrays.to_flat(x, at)
        buf[...] = 0                                     # x must not change
        assert host(x).tolist() == host(make(place, vals, dt)).tolist()
        buf2, meta2 = arrays.to_flat(x, at)
        y = arrays.from_flat(buf2, meta2)
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


def wrap_device_allreduce(place: str) -> dict:
    """On every MPI rank: wrap(COMM_WORLD).Allreduce of device arrays (in place, out of
    place, ``[buf, count, type]``, 16-bit floats, compressed); reduced on the device if the
    MPI is CUDA-aware, else staged through host memory. Returns values and gradcomm's
    bytes sent (nonzero: gradcomm handled the calls, not MPI's own Allreduce)."""
    from mpi4py import MPI

    from gradcomm.integrations.mpi import _plan, wrap

    comm = wrap(MPI.COMM_WORLD, algorithm="ring")
    t = comm.gradcomm_transport
    r = comm.Get_rank()
    out: dict = {"rank": r}
    x = make(place, np.arange(5, dtype=np.float64) + r, "float32")
    plan = _plan(MPI, comm, MPI.IN_PLACE, x, MPI.SUM)
    out["route"] = comm._gradcomm_route(*plan)
    out["cuda_aware"] = "cuda" in t.devices
    comm.Allreduce(MPI.IN_PLACE, x, op=MPI.SUM)
    y = make(place, np.zeros(5), "float32")
    comm.Allreduce(x, y, op=MPI.MAX)
    out["sum_max"] = host(x).tolist() + host(y).tolist()
    c = make(place, np.full(6, r + 1.0), "float64")
    comm.Allreduce(MPI.IN_PLACE, [c, 4, MPI.DOUBLE])              # the rest stays
    out["count"] = host(c).tolist()
    h = make(place, np.full(7, r + 0.5), "float16")
    comm.Allreduce(MPI.IN_PLACE, h)
    out["float16"] = host(h).tolist()
    if place.startswith("torch"):
        b = make(place, np.full(3, r + 1.5), "bfloat16")
        bo = make(place, np.zeros(3), "bfloat16")
        comm.Allreduce(b, bo)
        out["bfloat16"] = host(bo).tolist()
    out["gradcomm_bytes"] = t.stats.bytes_sent
    cc = wrap(MPI.COMM_WORLD, algorithm="ring", compressor="fp16")
    g = make(place, np.full(4096, r + 1.0), "float32")
    cc.Allreduce(MPI.IN_PLACE, g)
    out["compressed"] = [float(v) for v in np.unique(host(g))]
    out["compressed_route"] = cc._gradcomm_route(*_plan(MPI, cc, MPI.IN_PLACE, g, MPI.SUM))
    out["where"] = list(where(g))
    return out


@pytest.mark.parametrize("place", PLACES[2:])    # host arrays: tests/integrations/test_mpi_wrap.py
def test_wrap_accepts_device_arrays_under_mpirun(place):
    from tests._launch import mpi_call, require_mpi

    require_mpi()
    for out in mpi_call(wrap_device_allreduce, 2, place, timeout=90):
        assert out["route"] == ("direct" if out["cuda_aware"] and CUPY else "staged")
        assert out["sum_max"] == (2 * np.arange(5) + 1.0).tolist() * 2
        assert out["count"] == [3.0] * 4 + [out["rank"] + 1.0] * 2
        assert out["float16"] == [2.0] * 7
        assert out.get("bfloat16", [4.0] * 3) == [4.0] * 3
        assert out["gradcomm_bytes"] > 0
        assert out["compressed"] == [3.0] and out["compressed_route"] == "device"
        assert out["where"][1].startswith("cuda")


@pytest.mark.parametrize("place", PLACES)
def test_byte_copies_between_any_array_and_host(place):
    """The copies wrap() stages with: same bytes as the host array, partial counts,
    writes in place into existing arrays (the rest untouched), clear errors."""
    from gradcomm.errors import ConfigError

    for dt in dtypes_for(place):
        vals = np.arange(10, dtype=np.float64) - 3
        x = make(place, vals, dt)
        want = arrays.host_view(make("torch-cpu" if place.startswith("torch") else "numpy",
                                     vals, dt)).view(np.uint8)
        got = arrays.copy_to_host(x)
        assert got.dtype == np.uint8 and got.tobytes() == want.tobytes(), dt
        got[...] = 0                                          # a copy, not a view
        assert arrays.copy_to_host(x).tobytes() == want.tobytes()
        k = want.size // 10 * 4
        assert arrays.copy_to_host(x, k).tobytes() == want[:k].tobytes()
        assert arrays.copy_to_host(x, 0).size == 0
        with pytest.raises(ConfigError, match="bytes"):
            arrays.copy_to_host(x, want.size + 1)
        other = arrays.copy_to_host(make(place, vals * 2, dt), k)
        arrays.copy_from_host(x, other)                       # first 4 elements replaced
        assert np.array_equal(host(x), np.concatenate([vals[:4] * 2, vals[4:]])), dt
        with pytest.raises(ConfigError, match="bytes"):
            arrays.copy_from_host(x, np.zeros(want.size + 1, np.uint8))
        assert where(x)[1] == ("cpu" if place in ("numpy", "torch-cpu") else where(x)[1])
    m = make(place, np.arange(12.0).reshape(3, 4), "float32")
    assert arrays.is_contiguous(m) and not arrays.is_contiguous(m.T)
    if place not in ("numpy", "torch-cpu"):
        with pytest.raises(ConfigError, match="contiguous"):
            arrays.copy_to_host(m.T)
        with pytest.raises(ConfigError, match="contiguous"):
            arrays.copy_from_host(m.T, np.zeros(4, np.uint8))
    if place in ("numpy", "torch-cpu") or CUPY:              # byte_view of a device: cupy
        v = arrays.byte_view(m)
        assert v.dtype == np.uint8 and v.size == 48
        v[:4] = 255                                           # shares m's memory
        assert np.isnan(host(m)[0, 0])


@pytest.mark.parametrize("place", PLACES)
def test_wrap_routes_and_reduces_every_array_kind_on_comm_self(place):
    """On one rank nothing crosses MPI, so claiming a CUDA-aware MPI is safe anywhere:
    host memory is reduced in place; device memory directly where the transport moves
    device buffers (and cupy runs), else staged; compressed sums on the device. Both routes
    write the user's arrays in place (IN_PLACE, send/recv, ``[buf, count, type]``)."""
    from tests._launch import require_mpi

    require_mpi()
    from mpi4py import MPI

    from gradcomm.integrations.mpi import _plan, wrap

    comm = wrap(MPI.COMM_SELF, algorithm="ring")
    device = place not in ("numpy", "torch-cpu")
    x = make(place, np.arange(6.0), "float32")
    plan = _plan(MPI, comm, MPI.IN_PLACE, x, MPI.SUM)
    assert (plan[1].view is None) == device and plan[1].obj is x
    assert comm._gradcomm_route(*plan) == ("staged" if device and "cuda" not in
                                           comm.gradcomm_transport.devices else "direct")
    comm.gradcomm_transport.devices = frozenset({"cpu", "cuda"})
    assert comm._gradcomm_route(*plan) == ("staged" if device and not CUPY else "direct")
    cc = wrap(MPI.COMM_SELF, compressor="fp16")
    cc.gradcomm_transport.devices = frozenset({"cpu", "cuda"})
    assert cc._gradcomm_route(*_plan(MPI, cc, MPI.IN_PLACE, x, MPI.SUM)) == \
        ("device" if device else "direct")
    assert _plan(MPI, comm, MPI.IN_PLACE, make(place, np.ones((2, 3)), "float32").T,
                 MPI.SUM) is None                            # non-contiguous: MPI's own
    for c in (comm, cc):
        for route in (None, "direct", "staged"):
            if route == "direct" and device and (not CUPY or c is cc):
                continue                    # never chosen: compressed: "device"
            y = make(place, np.arange(6.0) + 1, "float32")
            c._gradcomm_allreduce(MPI.IN_PLACE, y, MPI.SUM, route=route)
            assert host(y).tolist() == (np.arange(6.0) + 1).tolist()
            s, r = make(place, np.full(5, 2.0), "float64"), make(place, np.zeros(5), "float64")
            c._gradcomm_allreduce([s, 3, MPI.DOUBLE], [r, 3, MPI.DOUBLE], MPI.MAX, route=route)
            assert host(r).tolist() == [2.0] * 3 + [0.0] * 2 and where(r) == where(s)
            for dt in dtypes_for(place):
                h = make(place, np.arange(4.0), dt)
                c._gradcomm_allreduce(MPI.IN_PLACE, h, MPI.SUM, route=route)
                assert host(h).tolist() == [0.0, 1.0, 2.0, 3.0] and where(h) == where(x)


@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize("devices", [("cpu",), ("cpu", "cuda")])
def test_compressed_public_api_stages_and_returns_the_same_kind(place, devices):
    """gradcomm.allreduce / allreduce_ / Allreduce with a codec: staged to host for the
    codec whatever the transport moves, the result on the input's kind, device, dtype and
    shape; bfloat16, non-contiguous inputs, sparse routes."""
    topk = "topk" in gradcomm.compressors.names()

    def fn(t):
        t.devices = frozenset(devices)
        outs = []
        for dt in [d for d in dtypes_for(place) if d != "int32"]:
            x = make(place, np.arange(12, dtype=np.float64).reshape(3, 4) * (t.rank + 1), dt)
            ys = [gradcomm.allreduce(x, t, compressor="fp16", algorithm="ring"),
                  gradcomm.allreduce(x.T, t, compressor="fp16"),
                  gradcomm.allreduce(x, t, algorithm="sparse_allgather")]
            if topk:
                ys.append(gradcomm.allreduce(x, t, compressor="topk", ratio=1.0,
                                             algorithm="allgather"))
            ar = gradcomm.Allreduce(t, op="sum", compressor="fp16", algorithm="ring")
            ys += [ar(x, key="a"), ar(x, key="a")]
            z = make(place, np.arange(12, dtype=np.float64).reshape(3, 4) * (t.rank + 1), dt)
            assert gradcomm.allreduce_(z, t, compressor="fp16") is z
            ys.append(z)
            for i, y in enumerate(ys):
                assert where(y) == where(x) and y.dtype == x.dtype, (dt, i)
                outs.append((dt, i, tuple(y.shape), host(y)))
        return outs

    base = np.arange(12, dtype=np.float64).reshape(3, 4) * 3
    for outs in run_ranks(2, fn, timeout=60):
        for dt, i, shape, y in outs:
            want = base.T if i == 1 else base
            assert shape == want.shape, (dt, i)
            np.testing.assert_array_equal(y, want, err_msg=f"{place} {dt} {i}")


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
        state, hook = make_comm_hook(compressor, model=model, start_iter=0)
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


def test_gpu_check_script_runs_here(tmp_path, capsys):
    """bench/gpu_check.py without its pytest step, on a tiny array: reports the
    environment (and the route wrap() takes for device arrays); on a GPU machine it also
    times the codecs and the staging copies."""
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "bench" / "gpu_check.py"
    spec = importlib.util.spec_from_file_location("gpu_check", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "gpu.json"
    assert mod.main(["--skip-tests", "--size", "4096", "--repeat", "1",
                     "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["environment"]["wrap_device_route"] in ("direct", "staged")
    assert res["gpu"] == (TORCH_CUDA or CUPY)
    if res["gpu"]:
        names = {r["codec"] for r in res["codecs"] if "ms" in r}
        assert {"d2d copy", "wrap staging"} <= names
    assert "environment:" in capsys.readouterr().out


@pytest.mark.parametrize("place", PLACES[2:])    # torch CPU: tests/devices/test_mpi_device.py
def test_compressed_wrap_on_device_arrays_gives_the_host_bytes(place):
    """wrap(COMM_WORLD).Allreduce with int8 / topk / fp16 (gather and per-hop routes) on
    CUDA arrays at 2 MPI ranks: codecs on the device (route "device"), results written
    into the user's device memory with the bytes the host path gives the same values."""
    from tests._launch import mpi_call, require_mpi
    from tests.devices.test_mpi_device import check_results, compressed_wrap_on_the_device

    require_mpi()
    check_results(mpi_call(compressed_wrap_on_the_device, 2, place, timeout=100), place)


@pytest.mark.skipif(not TORCH_CUDA, reason="no GPU: torch.cuda.is_available() is False")
def test_ddp_hook_on_a_one_rank_nccl_group():
    """An NCCL group: the hook sends its messages over a gloo group it makes over the same
    ranks, sums uncompressed buckets with NCCL's allreduce on the device and keeps the
    residuals of compressed ones there (checkpointed on the host)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from gradcomm.integrations.ddp import make_comm_hook

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    try:
        for compressor in (None, "int8"):
            torch.manual_seed(0)
            ref = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 2)).cuda()
            model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16),
                                            torch.nn.Linear(16, 2)).cuda())
            model.module.load_state_dict(ref.state_dict())
            state, hook = make_comm_hook(compressor, model=model)
            model.register_comm_hook(state, hook)
            assert state.transport.backend == "gloo" and state.library.backend == "nccl"
            for _ in range(3):
                x = torch.randn(5, 8, device="cuda")
                for m in (ref, model):
                    m.zero_grad()
                    m(x).square().sum().backward()
                for a, b in zip(ref.parameters(), model.parameters()):
                    torch.testing.assert_close(b.grad, a.grad, rtol=0, atol=0)
            if compressor is None:
                assert state.stats["native_nbytes"] > 0 and state.stats["bytes_sent"] == 0
            else:
                res = state.residuals._residuals
                assert res and all(where(v)[1].startswith("cuda") for v in res.values())
                saved = state.state_dict()["ranks"][0]["residuals"]
                assert all(v.device.type == "cpu" for v in saved.values())
            state.close()
    finally:
        dist.destroy_process_group()
