"""CUDA's rules checked on a CPU: the device route on a torch device that is not the CPU.

CI has no GPU, and torch CPU tensors forgive what CUDA does not: a tensor made without
``device=`` lands on the CPU and mixes freely with CPU data. torch's lazy tensor backend
(TorchScript, ``torch._lazy``) gives a ``lazy`` device that computes on the CPU yet, like
CUDA, refuses to mix its tensors with CPU tensors (0-d CPU tensors excepted, as on CUDA),
and is not ``"cpu"`` to every ``device.type`` branch in gradcomm, so the code a CUDA tensor
takes runs here (e.g. ``kth_smallest``'s ``topk`` selection, ``like``'s device copy).

:class:`CudaRules` (a ``TorchFunctionMode``) also flags what is legal on any device but
differs or costs on CUDA:

- a float division by a host scalar (a Python number, or a CPU tensor dividing device
  data): CUDA multiplies by the reciprocal instead, which rounds differently;
- arithmetic or copies on uint16/uint32/uint64 tensors (views only: torch's support of
  them is "barebones" and varies by device and version);
- a tensor made on the device from Python data (``torch.tensor(v, device=...)``,
  ``asarray``), or an indexed write of a Python scalar: each a blocking host-to-device
  copy that synchronises the stream;
- reads of device values by the host (``bool``, ``int``, ``.item()``, ``.cpu()``...),
  counted per call site: the tests bound them (a per-bucket read would be a per-bucket
  synchronisation on a GPU).

What this cannot show: CUDA's arithmetic itself (canonical NaNs, IEEE division), its dtype
coverage, streams, and anything cupy. The last tests run where a GPU is (torch CUDA, cupy):
the quantizers must queue their kernels without a single device synchronisation (torch's
sync debug mode, ``cupyx.allow_synchronize(False)``), and division must be IEEE there.
"""

from __future__ import annotations

import collections
import sys
import threading

import numpy as np
import pytest

import gradcomm
from gradcomm import arrays
from gradcomm.comm import run_ranks
from gradcomm.compressors import get
from gradcomm.compressors._kernels._kth_smallest import kth_smallest
from gradcomm.compressors.base import Payload

torch = pytest.importorskip("torch")
pytest.importorskip("array_api_compat")

from torch.overrides import TorchFunctionMode  # noqa: E402

from tests.devices._devices import GPU_KINDS, data, on as on_kind, wire  # noqa: E402
from tests.compressors.test_codecs import CONFIGS, IDS  # noqa: E402

pytestmark = pytest.mark.timeout(240)

_NZ = torch.nonzero
_quiet = threading.local()         # set while the nonzero workaround runs (not audited)
#: held around every torch call on lazy tensors: the lazy backend is not thread-safe (the
#: route test's 3 rank threads tracing at once crashed the interpreter in `.ci/run` on a
#: loaded machine: a segfault in three threads' `torch.where` / copies)
_SERIAL = threading.RLock()


def _nonzero(x, *args, **kwargs):
    """``torch.nonzero`` with the lazy backend's fallback repaired: its result claims the
    lazy device but holds CPU data (``torch.where`` on it gives a CPU tensor), so it is
    computed on the CPU and moved, as a real device would hand it back."""
    if not isinstance(x, torch.Tensor) or x.device.type != "lazy":
        return _NZ(x, *args, **kwargs)
    _quiet.on = True
    try:
        r = _NZ(x.cpu(), *args, **kwargs)
        return tuple(t.to(x.device) for t in r) if isinstance(r, tuple) else r.to(x.device)
    finally:
        _quiet.on = False


@pytest.fixture(scope="module")
def lazy():
    """The ``lazy`` device (skips where torch lacks the TorchScript lazy backend)."""
    try:
        import torch._lazy
        import torch._lazy.ts_backend

        torch._lazy.ts_backend.init()
        torch.ones(2, device="lazy").cpu()
    except Exception as exc:      # a private backend: absent or broken in some builds
        pytest.skip(f"torch's lazy (TorchScript) backend is unusable here: {exc!r}")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch, "nonzero", _nonzero)
        yield torch.device("lazy")


# --- the rules ------------------------------------------------------------------------------

_DIV = {"div", "div_", "divide", "true_divide", "true_divide_", "__truediv__",
        "__itruediv__", "__div__", "__idiv__"}
_RDIV = {"__rtruediv__", "__rdiv__"}
_SYNC = {"__bool__", "__int__", "__float__", "__index__", "item", "tolist", "cpu", "numpy"}
_VIEWS = {"view", "__getitem__", "reshape", "detach", "contiguous", "is_contiguous", "numel",
          "element_size", "dim", "size", "stride", "storage_offset", "data_ptr", "__get__",
          "__len__", "__repr__", "__format__", "__hash__"}
_UNSIGNED = {getattr(torch, n) for n in ("uint16", "uint32", "uint64") if hasattr(torch, n)}
_FROM_DATA = {"tensor", "asarray", "as_tensor"}


def _on_device(t) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type not in ("cpu", "meta")


def _site() -> str:
    """The innermost gradcomm frame calling torch (where a finding is reported)."""
    f = sys._getframe(2)
    while f is not None:
        name = f.f_code.co_filename
        if "/gradcomm/" in name and "/tests/" not in name:
            return f"{name.split('/gradcomm/')[-1]}:{f.f_lineno} {f.f_code.co_name}"
        f = f.f_back
    return "(test)"


class CudaRules(TorchFunctionMode):
    """Collects ``problems`` (what CUDA forbids or does differently) and ``syncs`` (host
    reads of device values, by call site) of the torch calls made inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.problems: list[tuple[str, str]] = []
        self.syncs: collections.Counter = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        with _SERIAL:
            if not getattr(_quiet, "on", False):
                self._check(getattr(func, "__name__", ""), func, args, kwargs)
            return func(*args, **kwargs)

    def _check(self, name: str, func, args, kwargs) -> None:
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        first = args[0] if args else None
        if name in _DIV and len(args) > 1 and isinstance(first, torch.Tensor) and \
                first.is_floating_point():
            d = args[1]
            if not isinstance(d, torch.Tensor) or (_on_device(first) and not _on_device(d)):
                self.problems.append(("float division by a host scalar (CUDA multiplies "
                                      "by its reciprocal)", _site()))
        if name in _RDIV and isinstance(first, torch.Tensor) and first.is_floating_point():
            self.problems.append(("scalar / tensor (a reciprocal times the scalar)", _site()))
        if name == "__get__":
            return                                       # .dtype, .shape, .device ...
        if any(t.dtype in _UNSIGNED for t in tensors) and name not in _VIEWS:
            self.problems.append((f"{name} on an unsigned 16/32/64-bit tensor", _site()))
        if name in _FROM_DATA and func.__module__ in ("torch", None) and args and \
                not isinstance(args[0], torch.Tensor) and \
                str(kwargs.get("device", "cpu")).split(":")[0] not in ("cpu", "None"):
            self.problems.append((f"torch.{name} of Python data on the device (a blocking "
                                  "copy)", _site()))
        if name == "__setitem__" and _on_device(first) and len(args) == 3 and \
                isinstance(args[2], (bool, int, float)) and \
                any(isinstance(i, torch.Tensor) for i in
                    (args[1] if isinstance(args[1], tuple) else (args[1],))):
            self.problems.append(("indexed write of a Python scalar (a blocking copy)",
                                  _site()))
        if name in _SYNC and _on_device(first):
            self.syncs[_site()] += 1
        if name == "to" and _on_device(first) and any(
                str(a).startswith("cpu") for a in (*args[1:], kwargs.get("device", ""))):
            self.syncs[_site()] += 1

    def total(self) -> int:
        return sum(self.syncs.values())


def on(device, a: np.ndarray):
    """A fresh tensor on ``device`` with host ``a``'s elements (bfloat16 stays uint16)."""
    return arrays.like(np.array(a, copy=True), torch.zeros(1, device=device))


def _adds(codec) -> bool:
    import inspect

    return "add" in inspect.signature(codec.decompress).parameters


# --- the rules catch what they claim to ------------------------------------------------------

def test_the_rules_flag_device_hazards(lazy) -> None:
    x = torch.arange(4.0, device=lazy)
    rules = CudaRules()
    with rules:
        x / 3.0                                                  # reciprocal on CUDA
        x / torch.tensor(3.0)                                    # a CPU scalar: the same
        x / torch.full((), 3.0, device=lazy)                     # fine
        x.to(torch.int16).view(torch.uint16).clone()             # barebones dtype
        torch.tensor(1.0, device=lazy)                           # blocking copy
        torch.full((), 1.0, device=lazy)                         # fine
        y = torch.ones(4, dtype=torch.bool, device=lazy)
        y[torch.arange(2, device=lazy)] = False                  # blocking copy
        bool(x[0] > 1), int(x.sum()), x.cpu()                    # three host reads
    kinds = [p[0].split(" (")[0] for p in rules.problems]
    assert kinds == ["float division by a host scalar"] * 2 + \
        ["clone on an unsigned 16/32/64-bit tensor", "torch.tensor of Python data on the "
         "device", "indexed write of a Python scalar"], rules.problems
    assert rules.total() == 3
    with pytest.raises(RuntimeError):                        # the device refuses CPU data
        x + torch.zeros(4)


# --- codecs ---------------------------------------------------------------------------------

COUNTS = (0, 1, 9, 2100)


@pytest.mark.parametrize("name,opts", CONFIGS, ids=IDS)
def test_codecs_keep_device_rules(lazy, name: str, opts: dict) -> None:
    """On the lazy device every codec gives the host path's bytes (encode, decode of a
    host payload into a device ``out=``, add=, decompress_sum of device payloads, error
    feedback), breaks none of :class:`CudaRules`, and reads the device from the host at
    most once per call (none per bucket), besides one copy per buffer for the wire."""
    c = get(name, **opts)
    for dtype in ("float16", "float32", "float64"):
        for n in COUNTS:
            x, x2 = data(n, dtype, n), data(n, dtype, n + 7)
            ref, ref2 = c.compress(x, seed=(3, n)), c.compress(x2, seed=(3, n))
            rules = CudaRules()
            with rules:
                p = c.compress(on(lazy, x), seed=(3, n))
            assert rules.total() <= 1, (dtype, n, rules.syncs)
            assert all(arrays.meta_of(b).device.startswith("lazy")
                       for b in p.buffers.values())
            with rules:
                got = wire(p)
            assert got == wire(ref), (dtype, n)
            assert rules.total() <= 1 + len(p.buffers), (dtype, n, rules.syncs)

            rules = CudaRules()
            host = Payload.from_bytes(ref.to_bytes())
            with rules:
                out = c.decompress(host, out=on(lazy, np.full(n, 7, dtype)))
            assert arrays.host(out).tobytes() == c.decompress(ref).tobytes(), (dtype, n)
            if _adds(c):
                base = data(n, dtype, 99)
                want = c.decompress(ref, out=base.copy(), add=True)
                with rules:
                    out = c.decompress(host, out=on(lazy, base), add=True)
                assert arrays.host(out).tobytes() == want.tobytes(), (dtype, n)
            p2 = c.compress(on(lazy, x2), seed=(3, n))
            with rules:
                out = c.decompress_sum([p, p2], out=on(lazy, np.zeros(n, dtype)))
            want = c.decompress_sum([ref, ref2])
            assert arrays.host(out).tobytes() == want.tobytes(), (dtype, n)
            assert rules.total() <= 4, (dtype, n, rules.syncs)

            if c.lossy and n:
                e_ref, e = np.full(n, 0.25, dtype), on(lazy, np.full(n, 0.25, dtype))
                want = wire(c.compress(x, seed=1, residual=e_ref))
                with rules:
                    p = c.compress(on(lazy, x), seed=1, residual=e)
                assert wire(p) == want and arrays.host(e).tobytes() == e_ref.tobytes()
            assert not rules.problems, rules.problems


# --- the arrays helpers the device route uses -------------------------------------------

def test_array_helpers_keep_device_rules(lazy) -> None:
    rng = np.random.default_rng(5)
    rules = CudaRules()
    with rules:
        for dt in ("int16", "int32", "int64"):           # top-k's thresholds: CUDA's topk
            for n in (1, 2, 7, 100, 1001):
                a = rng.integers(-50, 50, n).astype(dt)  # many ties
                t = on(lazy, a)
                for j in sorted({0, n // 3, n // 2, n - 1}):
                    k = kth_smallest(t, j)
                    assert k.device.type == "lazy" and int(k) == np.partition(a, j)[j]
        bits = rng.integers(0, 1 << 16, 999).astype(np.uint16)
        u = on(lazy, bits)                               # uint16 moves as int16
        assert arrays.dtype_name(u) == "uint16" and u.device.type == "lazy"
        assert arrays.host(u).tobytes() == bits.tobytes()
        v = arrays.empty_like_kind(u, 999, "uint16")
        arrays.assign(v, u)
        w = arrays.clone(v)
        assert arrays.host(w).tobytes() == bits.tobytes()
        arrays.assign(v, 0)
        assert not arrays.host(v).any()
        f = rng.standard_normal(999).astype(np.float32) * 1e3
        for p in (3, 7, 12):                             # an IEEE division, not x * (1/p)
            y = on(lazy, f)
            arrays.divide_(y, p)
            assert arrays.host(y).tobytes() == (f / np.float32(p)).tobytes()
        g = on(lazy, f)
        out = arrays.empty_like_kind(g, 999, "float32")
        arrays.subtract(g, on(lazy, f[::-1].copy()), out)
        assert arrays.host(out).tobytes() == (f - f[::-1]).tobytes()
        assert arrays.host(arrays.cast(g, "float64")).tobytes() == \
            f.astype(np.float64).tobytes()
        b16 = torch.from_numpy(f).to(torch.bfloat16).to(lazy).reshape(9, 111)
        flat, meta = arrays.to_flat(b16, "native")
        assert arrays.dtype_name(flat) == "uint16" and flat.device.type == "lazy"
        back = arrays.from_flat(flat, meta)
        assert back.dtype == torch.bfloat16 and torch.equal(back.cpu(), b16.cpu())
        raw = arrays.copy_to_host(g, 12)
        assert raw.tobytes() == f[:3].tobytes()
        arrays.copy_from_host(g, np.zeros(2, np.float32))
        assert arrays.host(g)[:2].tolist() == [0.0, 0.0]
    assert not rules.problems, rules.problems


# --- compressed allreduce: the device route ---------------------------------------------

ROUTE_CODECS = [("fp16", {}), ("bf16", {}), ("int8", {}), ("int8", {"scale": 8.0}),
                ("qsgd", {"bits": 4}), ("terngrad", {}), ("onebit", {"bucket_size": 64}),
                ("topk", {"ratio": 0.1}), ("randomk", {"ratio": 0.3}), ("none", {})]
ROUTE_IDS = [f"{n}{'-' + '-'.join(map(str, o.values())) if o else ''}"
             for n, o in ROUTE_CODECS]
TORCH_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16,
                "float32": torch.float32, "float64": torch.float64}


def grad(rank: int, n: int, dtype: str, device="cpu"):
    g = torch.from_numpy(np.random.default_rng(rank * 7919 + n).standard_normal(n))
    return (g * (rank + 1)).to(TORCH_DTYPES[dtype]).to(device)


def raw(t) -> bytes:
    with _SERIAL:                   # called outside CudaRules on lazy results
        t = t.detach().cpu().contiguous()
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy().tobytes()


def _device_wires(monkeypatch: pytest.MonkeyPatch) -> list:
    """Records, per codec frame set made (every route makes one), whether its codecs ran
    on the device."""
    from gradcomm.compressed.frames import Frames

    seen: list = []
    init = Frames.__init__

    def spy(self, *args, **kwargs):
        init(self, *args, **kwargs)
        seen.append(self.device)
    monkeypatch.setattr(Frames, "__init__", spy)
    return seen


@pytest.mark.parametrize("name,opts", ROUTE_CODECS, ids=ROUTE_IDS)
def test_compressed_allreduce_device_route_keeps_device_rules(
        lazy, name: str, opts: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """gradcomm.allreduce of lazy tensors takes the device route (``auto``: device
    tensors need no GRADCOMM_CODEC_PLACEMENT) and gives the host gather route's bytes on
    every rank, within :class:`CudaRules`."""
    monkeypatch.delenv("GRADCOMM_CODEC_PLACEMENT", raising=False)
    route = "sparse_allgather" if name == "topk" else "allgather"
    wires = _device_wires(monkeypatch)
    for p in (1, 3):
        for dtype in ("float32", "bfloat16", "float16"):
            for n in (0, 5, 1000):
                def host(t, n=n, dtype=dtype):
                    return raw(gradcomm.allreduce(grad(t.rank, n, dtype), t, op="mean",
                                                  compressor=name, algorithm=route, **opts))

                def device(t, n=n, dtype=dtype):
                    rules = CudaRules()
                    with rules:
                        y = gradcomm.allreduce(grad(t.rank, n, dtype, lazy), t, op="mean",
                                               compressor=name, **opts)
                    assert y.device.type == "lazy" and y.dtype == TORCH_DTYPES[dtype]
                    return raw(y), rules.problems

                want = run_ranks(p, host, timeout=120)
                wires.clear()
                got = run_ranks(p, device, timeout=120)
                assert [g[0] for g in got] == want, (p, dtype, n)
                assert not any(g[1] for g in got), got[0][1]
                if p > 1 and n and name != "none":
                    assert wires and all(wires), (p, dtype, n)    # codecs ran on the device


@pytest.mark.parametrize("name,opts", [("int8", {"bits": 4}), ("topk", {"ratio": 0.02}),
                                       ("onebit", {})], ids=["int8", "topk", "onebit"])
def test_error_feedback_on_the_device_keeps_device_rules(
        lazy, name: str, opts: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """Four steps with error feedback: residuals stay on the device, results equal the
    host gather route's; the checkpoint comes to the host and resumes there bitwise."""
    monkeypatch.delenv("GRADCOMM_CODEC_PLACEMENT", raising=False)
    route = "sparse_allgather" if name == "topk" else "allgather"
    n = 3000

    def run(t, device):
        ar = gradcomm.Allreduce(t, compressor=name, algorithm=route, **opts)
        rules = CudaRules()
        with rules:
            out = [raw(ar(grad(t.rank + s, n, "float32", device), key="w")) for s in range(2)]
        with _SERIAL:                   # the lazy residuals come to the host
            sd = ar.state_dict()
        ar2 = gradcomm.Allreduce(t, compressor=name, algorithm=route, **opts)
        ar2.load_state_dict(sd)
        out += [raw(ar2(grad(t.rank + s, n, "float32"), key="w")) for s in (2, 3)]
        return out, rules.problems, sd

    want = run_ranks(2, lambda t: run(t, "cpu"), timeout=120)
    got = run_ranks(2, lambda t: run(t, lazy), timeout=120)
    assert [g[0] for g in got] == [w[0] for w in want]
    assert not any(g[1] for g in got), got[0][1]
    for g in got:
        assert all(isinstance(v, (np.ndarray, int, str)) for v in g[2].values())


# --- on a GPU: no hidden synchronisation (skipped without one) ------------------------------

SYNC_FREE = [("fp16", {}), ("bf16", {}), ("int8", {}), ("int8", {"bits": 3, "rounding":
             "stochastic"}), ("int8", {"scale": 4.0, "bits": 6}), ("qsgd", {}),
             ("terngrad", {}), ("onebit", {}), ("none", {})]
SYNC_IDS = [f"{n}{'-' + '-'.join(map(str, o.values())) if o else ''}" for n, o in SYNC_FREE]


def _no_sync(device: str):
    """A context in which a device synchronisation raises: torch's sync debug mode, or
    cupyx.allow_synchronize(False)."""
    import contextlib

    if device == "torch-cuda":
        @contextlib.contextmanager
        def strict():
            torch.cuda.set_sync_debug_mode("error")
            try:
                yield
            finally:
                torch.cuda.set_sync_debug_mode("default")
        return strict()
    import cupyx

    if not hasattr(cupyx, "allow_synchronize"):
        pytest.skip("this cupy has no cupyx.allow_synchronize")
    return cupyx.allow_synchronize(False)



@pytest.mark.parametrize("device", GPU_KINDS)
@pytest.mark.parametrize("name,opts", SYNC_FREE, ids=SYNC_IDS)
def test_gpu_quantizers_encode_and_decode_without_synchronising(
        device: str, name: str, opts: dict) -> None:
    """On a GPU the quantizers' compress and their decode of a device payload queue
    kernels only: no host read, no blocking copy (a ``torch.tensor(v, device=cuda)``, a
    cupy boolean-mask write, an ``.item()`` would each raise here); the bytes are the
    host's. (qsgd/terngrad decoding counts corrupt levels: one read, so not checked.)"""
    c = get(name, **opts)
    for dtype in ("float32", "float16"):
        x = data(100_003, dtype, 1)
        ref = c.compress(x, seed=3)
        xd, out = on_kind(device, x), on_kind(device, np.zeros(x.size, dtype))
        arrays.sync(xd)
        with _no_sync(device):
            p = c.compress(xd, seed=3)
            if name not in ("qsgd", "terngrad"):
                c.decompress(p, out=out)
        assert wire(p) == wire(ref)
        if name not in ("qsgd", "terngrad"):
            assert arrays.host(out).tobytes() == c.decompress(ref).tobytes()


@pytest.mark.parametrize("device", GPU_KINDS)
def test_gpu_division_is_ieee(device: str) -> None:
    """``arrays.divide_`` on the GPU is a true division (torch turns a division by a
    Python scalar into a product with its reciprocal on CUDA)."""
    f = data(100_003, "float32", 2) * np.float32(1e3)
    for p in (3, 7, 10, 12):
        y = on_kind(device, f)
        arrays.divide_(y, p)
        assert arrays.host(y).tobytes() == (f / np.float32(p)).tobytes(), p
