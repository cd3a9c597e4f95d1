"""The DDP comm hook's device path: compressed buckets reduced where they live.

``GRADCOMM_CODEC_PLACEMENT=array`` sends CPU buckets down the path CUDA buckets take
(working copy, residuals and codecs on the tensors, payload bytes alone to the host), so
it runs here on real gloo processes (``scripts/ddp_device_checks.py``): bitwise equal to
the host path for int8, onebit, topk and fp16 (fp32, fp16 and bf16 models), identical on
every rank, checkpoints of device residuals resume bitwise (on either path), and the
pieces of the NCCL set-up that run on gloo (the payload group over the same ranks, the
library allreduce). In-process: the residual store's arithmetic on tensors equals that on
numpy arrays, and the route each bucket takes.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from gradcomm import arrays  # noqa: E402
from gradcomm.comm import run_ranks  # noqa: E402
from gradcomm.integrations import ddp  # noqa: E402
from gradcomm.integrations.ddp.residuals import ParameterResiduals  # noqa: E402
from tests._launch import torchrun  # noqa: E402

CHECKS = Path(__file__).parent / "scripts" / "ddp_device_checks.py"


# -- real processes ---------------------------------------------------------------------------
@pytest.mark.timeout(90)
def test_device_path_on_two_gloo_processes():
    run = torchrun(CHECKS, 2, "parity", "resume", "groups", timeout=80)
    info = run.clean_results(2)[0]["info"]
    assert len(info["parity"]) == 10, info


@pytest.mark.timeout(90)
def test_device_path_on_three_gloo_processes():
    run = torchrun(CHECKS, 3, "parity", "groups", timeout=80)
    run.clean_results(3)


# -- in-process: the residual store on tensors, the routes -------------------------------------
def _store(kind: str) -> ParameterResiduals:
    """Residuals of parameters a (3) and b (4), a unit u = [a, b] with hop residuals."""
    make = np.asarray if kind == "numpy" else (lambda v: torch.tensor(v))
    r = ParameterResiduals(True)
    r._residuals = {"a": make(np.float32([0.5, -1.0, 2.0])),
                    "u#e0": make(np.float32([1.0, 2.0, 3.0])),       # covers b[0:3]
                    "u#f1": make(np.float32([0.25] * 7))}            # all of u, 2 copies
    r.units = {"u": (["a", "b"], [3, 4])}
    r.offsets = {"u#e0": 3, "u#f1": 0}
    return r


def _host(d: dict) -> dict:
    return {k: arrays.host(v).tobytes() for k, v in d.items()}


def test_residual_store_on_tensors_gives_the_bytes_of_numpy():
    x_np = np.linspace(-1, 1, 7).astype(np.float32)
    dec_np = np.round(x_np * 4) / 4
    out = {}
    for kind in ("numpy", "torch"):
        r = _store(kind)
        x = x_np.copy() if kind == "numpy" else torch.from_numpy(x_np.copy())
        dec = dec_np if kind == "numpy" else torch.from_numpy(dec_np)
        digests = r.digests(["u"])
        unit = r.open(["a", "b"], [3, 4], x, 0)             # adds a's residual, resets it
        assert arrays.kind(r._residuals["a"]) == kind and not arrays.host(
            r._residuals["a"]).any()
        r.store.update(unit, x, dec)                        # e = x - decoded, per parameter
        assert {arrays.kind(r._residuals[k]) for k in "ab"} == {kind}
        after_update = _host(r._residuals)
        r.units["u"] = (["a", "b"], [3, 4])
        r.fold("u", {"u#f1": 2})                            # hops into a and b
        local, meta = r.local_state()
        assert all(isinstance(v, np.ndarray) for v in local["residuals"].values())
        out[kind] = (arrays.host(x).tobytes(), digests, after_update, _host(r._residuals),
                     meta)
    assert out["torch"] == out["numpy"]
    x, _, _, folded, _ = out["numpy"]
    e = np.frombuffer(x, np.float32) - dec_np
    want_b = e[3:] + np.float32([1, 2, 3, 0]) + np.float32(0.125)
    assert np.frombuffer(folded["b"], np.float32).tolist() == want_b.tolist()


def test_residuals_loaded_on_the_host_move_to_the_bucket_and_back():
    r = ParameterResiduals(True)
    r._residuals["a"] = np.float32([1.0, 2.0])              # as load_state_dict leaves it
    x = torch.tensor([10.0, 20.0, 30.0])
    unit = r.open(["a", "c"], [2, 1], x, 0)
    assert x.tolist() == [11.0, 22.0, 30.0] and isinstance(r._residuals["a"], torch.Tensor)
    r.store.update(unit, x, torch.tensor([11.0, 21.0, 30.0]))
    assert r.local_state()[0]["residuals"]["a"].tolist() == [0.0, 1.0]
    copy = r.copy()
    copy._residuals["a"] += 1                               # never aliased
    assert r._residuals["a"].tolist() == [0.0, 1.0]


def test_each_bucket_takes_its_route(monkeypatch):
    cpu = arrays.Meta("torch", "float32", (10,), "cpu")
    cuda = arrays.Meta("torch", "float32", (10,), "cuda:0")

    def routes(t, codec, algorithm, **kw):
        state, _ = ddp.make_comm_hook(codec, algorithm=algorithm, transport=t, **kw)
        try:
            out = [state.routes.route(m, codec is not None) for m in (cpu, cuda)]
            state.routes.library = t        # as for an NCCL group (its own allreduce)
            out += [state.routes.route(m, codec is not None) for m in (cpu, cuda)]
            return out
        finally:
            state.close()

    def fn(t):
        got = {}
        for codec, algo in (("int8", "allgather"), ("topk", "auto"), ("topk", "ring"),
                            ("fp16", "sparse_allgather"), ("powersgd", "auto"),
                            (None, "auto"), (None, "native"), (None, "ring")):
            got[codec, algo] = routes(t, codec, algo, **({"rank": 1} if codec ==
                                                          "powersgd" else {}))
        monkeypatch.setenv("GRADCOMM_CODEC_PLACEMENT", "array")
        got["int8", "array"] = routes(t, "int8", "allgather")
        got["int8", "ring", "array"] = routes(t, "int8", "ring")
        monkeypatch.delenv("GRADCOMM_CODEC_PLACEMENT")
        return got

    got = run_ranks(1, fn, timeout=30)[0]
    dev, host, lib = "device", "host", "library"
    assert got["int8", "allgather"] == [host, dev, host, dev]
    assert got["topk", "auto"] == [host, dev, host, dev]
    assert got["fp16", "sparse_allgather"] == [host, dev, host, dev]
    assert got["topk", "ring"] == [host, dev, host, dev]
    assert got["powersgd", "auto"] == [host] * 4                         # staged
    assert got[None, "auto"] == got[None, "native"] == [host, host, host, lib]
    assert got[None, "ring"] == [host] * 4
    assert got["int8", "array"] == [dev, dev, dev, dev]
    assert got["int8", "ring", "array"] == [dev] * 4
