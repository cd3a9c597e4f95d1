"""Compressed allreduce of device buffers: codecs on the device, payloads through the host.

``GRADCOMM_CODEC_PLACEMENT=array`` makes torch CPU tensors take the device route (the code
a CUDA tensor runs, on another device), so it is checked here against the host route:
same bytes on every rank, equal to the host's gather and per-hop routes;
error feedback and checkpoints across placements; a placement mismatch under ``auto`` is
caught on every rank.
"""

from __future__ import annotations

import numpy as np
import pytest

import gradcomm
from gradcomm.comm import run_ranks
from gradcomm.errors import MismatchError

torch = pytest.importorskip("torch")
pytest.importorskip("array_api_compat")

pytestmark = pytest.mark.timeout(240)

CODECS = [("fp16", {}), ("bf16", {}), ("int8", {}), ("int8", {"scale": 8.0}),
          ("qsgd", {"bits": 4}), ("terngrad", {}), ("onebit", {"bucket_size": 64}),
          ("topk", {"ratio": 0.1}), ("randomk", {"ratio": 0.3}), ("none", {})]
IDS = [f"{n}{'-' + '-'.join(map(str, o.values())) if o else ''}" for n, o in CODECS]
TORCH_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16,
                "float32": torch.float32, "float64": torch.float64}


def grad(rank: int, n: int, dtype: str) -> "torch.Tensor":
    g = torch.from_numpy(np.random.default_rng(rank * 7919 + n).standard_normal(n))
    return (g * (rank + 1)).to(TORCH_DTYPES[dtype])


def gather_route(name: str) -> str:
    """The host route that the device route's ``auto`` corresponds to."""
    return "sparse_allgather" if name == "topk" else "allgather"


def raw(t: "torch.Tensor") -> bytes:
    t = t.contiguous()
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy().tobytes()


def run(p: int, fn, placement: str, monkeypatch: pytest.MonkeyPatch) -> list:
    if placement == "array":
        monkeypatch.setenv("GRADCOMM_CODEC_PLACEMENT", "array")
    else:
        monkeypatch.delenv("GRADCOMM_CODEC_PLACEMENT", raising=False)
    return run_ranks(p, fn, timeout=120)


@pytest.mark.parametrize("name,opts", CODECS, ids=IDS)
def test_device_route_equals_the_host_gather_route(name: str, opts: dict,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    for p in (1, 2, 3):
        for dtype in ("float32", "bfloat16", "float16", "float64"):
            for n in (0, 1, 2, 5, 1000):
                for op in ("sum", "mean"):
                    def host(t, n=n, dtype=dtype, op=op):
                        return raw(gradcomm.allreduce(grad(t.rank, n, dtype), t, op=op,
                                                      compressor=name,
                                                      algorithm=gather_route(name), **opts))

                    def device(t, n=n, dtype=dtype, op=op):
                        y = gradcomm.allreduce(grad(t.rank, n, dtype), t, op=op,
                                               compressor=name, **opts)
                        assert y.dtype == TORCH_DTYPES[dtype] and y.shape == (n,)
                        return raw(y)

                    want = run(p, host, "auto", monkeypatch)
                    got = run(p, device, "array", monkeypatch)
                    assert len(set(got)) == 1, (p, dtype, n, op)      # every rank alike
                    assert got == want, (p, dtype, n, op)


@pytest.mark.parametrize("name,opts", [("int8", {}), ("topk", {"ratio": 0.05})],
                         ids=["int8", "topk"])
def test_per_hop_algorithms_on_the_device(name: str, opts: dict,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Explicit per-hop algorithms run on the device (each hop's payload through the
    host): the host's bytes, with error feedback on every hop, at p = 3 and 4."""
    for p in (3, 4):
        for algorithm in ("ring", "tree", "recursive_doubling", "rabenseifner"):
            def fn(t, algorithm=algorithm):
                ar = gradcomm.Allreduce(t, compressor=name, algorithm=algorithm, **opts)
                return [raw(ar(grad(t.rank + s, 777, "float32"), key="w")) for s in range(3)]
            got = run(p, fn, "array", monkeypatch)
            assert got == run(p, fn, "auto", monkeypatch), (p, algorithm)
            assert all(g == got[0] for g in got), (p, algorithm)


@pytest.mark.parametrize("name,opts", [("onebit", {}), ("topk", {"ratio": 0.02}),
                                       ("int8", {"bits": 4})], ids=["onebit", "topk", "int8"])
def test_error_feedback_and_checkpoints_across_placements(
        name: str, opts: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """Allreduce with error feedback: 4 steps on the device route equal 4 steps on the host
    gather route bitwise; a checkpoint taken on the device resumes on the host (and back)
    with the bytes of the unbroken run."""
    n, steps = 3000, 4

    def make(t):
        return gradcomm.Allreduce(t, compressor=name, algorithm=gather_route(name),
                                  **opts)

    def unbroken(t):
        ar = make(t)
        return [raw(ar(grad(t.rank + s, n, "float32"), key="w")) for s in range(steps)]

    def first_half(t):
        ar = make(t)
        out = [raw(ar(grad(t.rank + s, n, "float32"), key="w")) for s in range(2)]
        return out, ar.state_dict()

    want = run(2, unbroken, "auto", monkeypatch)
    assert run(2, unbroken, "array", monkeypatch) == want
    for first, second in (("array", "auto"), ("auto", "array")):
        halves = run(2, first_half, first, monkeypatch)
        for r, (_, sd) in enumerate(halves):
            assert all(isinstance(v, (np.ndarray, int, str)) for v in sd.values())

        def second_half(t):
            ar = make(t)
            ar.load_state_dict(halves[t.rank][1])
            return [raw(ar(grad(t.rank + s, n, "float32"), key="w")) for s in (2, 3)]

        rest = run(2, second_half, second, monkeypatch)
        assert [h[0] + r for h, r in zip(halves, rest)] == want, (first, second)


def test_auto_with_mixed_placements_is_a_mismatch_on_every_rank(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def fn(t):
        x = grad(t.rank, 100, "float32")
        try:
            gradcomm.allreduce(x if t.rank == 0 else x.numpy(), t, compressor="int8")
        except MismatchError as exc:
            return str(exc)
        return "no error"

    msgs = run(3, fn, "array", monkeypatch)
    assert all("algorithm differs" in m and "auto (" in m for m in msgs), msgs
