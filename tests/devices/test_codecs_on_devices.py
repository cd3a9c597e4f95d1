"""Every codec on torch tensors (and on CUDA / cupy where a GPU is): the device kernels
(``_kernels._xp``) give the bytes of the host path, payloads cross between host and
device, error feedback runs where the data is.

On this CPU-only CI the torch-CPU tensors run exactly the code a CUDA tensor runs (the
same array-API calls, another device), so every line of the device path is covered; the
``cuda`` and ``cupy`` parametrizations run the same checks on a GPU machine.
"""

from __future__ import annotations

import numpy as np
import pytest

from gradcomm import arrays
from gradcomm.compressors import Payload, get
from gradcomm.errors import ConfigError, PayloadError

torch = pytest.importorskip("torch")
pytest.importorskip("array_api_compat")

from tests.compressors.test_codecs import CONFIGS, IDS  # noqa: E402
from tests.devices._devices import GPU_KINDS, data, on, wire  # noqa: E402

DEVICES = ["torch-cpu", *GPU_KINDS]

COUNTS = (0, 1, 7, 9, 100, 1025, 4099)


def host(a) -> np.ndarray:
    return arrays.host(a)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name,opts", CONFIGS, ids=IDS)
def test_device_payload_bytes_equal_the_host_path(name: str, opts: dict, device: str) -> None:
    """compress on the device == compress on the host, byte for byte (wire form), and the
    payload buffers stay on the device until the wire form is written."""
    c = get(name, **opts)
    for dtype in ("float16", "float32", "float64"):
        for n in COUNTS:
            x = data(n, dtype, n)
            ref = c.compress(x, seed=(3, n))
            p = c.compress(on(device, x), seed=(3, n))
            assert wire(p) == wire(ref), (dtype, n)
            assert p.nbytes == ref.nbytes
            for b in p.buffers.values():
                assert arrays.kind(b) == arrays.kind(on(device, x[:1]))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name,opts", CONFIGS, ids=IDS)
def test_decode_on_the_device_equals_the_host_decode(name: str, opts: dict,
                                                     device: str) -> None:
    """A host payload (as received from the wire) decodes into a device ``out=`` with the
    host's bytes; add=True adds; a device payload decodes without ``out`` to its device."""
    c = get(name, **opts)
    for dtype in ("float16", "float32", "float64"):
        for n in COUNTS:
            x = data(n, dtype, n + 1)
            p = Payload.from_bytes(c.compress(x, seed=5).to_bytes())
            want = c.decompress(p)
            out = on(device, np.full(n, 7, dtype))
            got = c.decompress(p, out=out)
            assert got is out and host(out).tobytes() == want.tobytes(), (dtype, n)
            base = data(n, dtype, 99)
            acc_host = base.copy()
            c.decompress(p, out=acc_host, add=True)
            acc = on(device, base)
            c.decompress(p, out=acc, add=True)
            assert host(acc).tobytes() == acc_host.tobytes(), (dtype, n)
            dev = c.compress(on(device, x), seed=5)
            y = c.decompress(dev)
            assert arrays.kind(y) == arrays.kind(out) and host(y).tobytes() == want.tobytes()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name,opts", CONFIGS, ids=IDS)
def test_decompress_sum_on_the_device(name: str, opts: dict, device: str) -> None:
    c = get(name, **opts)
    n = 1000
    payloads = [Payload.from_bytes(c.compress(data(n, "float32", r), seed=(1, r)).to_bytes())
                for r in range(3)]
    want = c.decompress_sum(payloads)
    out = on(device, np.zeros(n, np.float32))
    c.decompress_sum(payloads, out=out)
    assert host(out).tobytes() == want.tobytes()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name,opts", [(n, o) for n, o in CONFIGS if n != "none"],
                         ids=[i for i, (n, _) in zip(IDS, CONFIGS) if n != "none"])
def test_error_feedback_on_the_device_matches_the_host(name: str, opts: dict,
                                                       device: str) -> None:
    """compress(x, residual=e, decoded=d) on the device leaves the host's e and d bytes
    (the host may fuse them into one kernel pass; the device composes: same bytes)."""
    c = get(name, **opts)
    for n in (0, 9, 4099):
        x = data(n, "float32", n)
        e0 = data(n, "float32", n + 7) * np.float32(0.01)
        e_h, d_h = e0.copy(), np.empty(n, np.float32)
        ref = c.compress(x.copy(), seed=2, residual=e_h, decoded=d_h)
        e_d, d_d = on(device, e0), on(device, np.empty(n, np.float32))
        p = c.compress(on(device, x), seed=2, residual=e_d, decoded=d_d)
        assert wire(p) == wire(ref)
        assert host(e_d).tobytes() == e_h.tobytes()
        assert host(d_d).tobytes() == d_h.tobytes()


def test_device_arguments_are_checked() -> None:
    c = get("int8")
    x = torch.ones(8)
    with pytest.raises(ConfigError, match="residual"):
        c.compress(x, residual=np.zeros(8, np.float32))       # host residual, torch x
    with pytest.raises(ConfigError, match="residual"):
        c.compress(x, residual=torch.zeros(7))
    with pytest.raises(ConfigError, match="float16, float32 or float64"):
        c.compress(torch.ones(8, dtype=torch.int32))
    p = Payload.from_bytes(c.compress(np.ones(8, np.float32)).to_bytes())
    with pytest.raises(PayloadError, match="decodes to"):
        c.decompress(p, out=torch.zeros(9))
    with pytest.raises(PayloadError, match="decodes to"):
        c.decompress(p, out=torch.zeros(8, dtype=torch.float64))


def test_kernel_path_xp_on_numpy_gives_the_reference_bytes(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    """GRADCOMM_KERNELS=xp sends numpy arrays through the device kernels: same bytes."""
    rows = []
    for name, opts in CONFIGS:
        c = get(name, **opts)
        x = data(4099, "float32", 1)
        rows.append((wire(c.compress(x, seed=4)), c.decompress(c.compress(x, seed=4))))
    monkeypatch.setenv("GRADCOMM_KERNELS", "xp")
    for (name, opts), (w, y) in zip(CONFIGS, rows):
        c = get(name, **opts)
        x = data(4099, "float32", 1)
        assert wire(c.compress(x, seed=4)) == w, name
        assert c.decompress(c.compress(x, seed=4)).tobytes() == y.tobytes(), name
