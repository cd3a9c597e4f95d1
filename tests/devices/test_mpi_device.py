"""``wrap(comm).Allreduce`` with a compressor on arrays whose codecs run where the data is
(route "device"), under a real mpirun at 2 ranks, without a GPU: torch CPU tensors with
``GRADCOMM_CODEC_PLACEMENT=array`` take the device code path (native views of the user's
memory, the array-generic codec kernels). Every result must have the bytes the host path
gives the same tensors (placement "auto": host views, numpy codecs), in place and into a
separate receive buffer, partial counts, 16-bit floats, empty buffers; per-hop routes
(device buffers staged inside the compressed allreduce) too. CUDA and cupy buffers take
the same route on a GPU machine (tests/devices/test_gpu.py).
"""

from __future__ import annotations

import hashlib
import os
from contextlib import contextmanager
from typing import Any, Iterator

import numpy as np
import pytest

from tests._launch import mpi_call, require_mpi, require_torch

#: (codec, algorithm, codec options)
CASES = [("int8", "allgather", {}), ("topk", "sparse_allgather", {"ratio": 0.1}),
         ("fp16", "allgather", {}), ("fp16", "ring", {})]
N = 1003


@contextmanager
def _placement(mode: str) -> Iterator[None]:
    before = os.environ.get("GRADCOMM_CODEC_PLACEMENT")
    os.environ["GRADCOMM_CODEC_PLACEMENT"] = mode
    try:
        yield
    finally:
        if before is None:
            del os.environ["GRADCOMM_CODEC_PLACEMENT"]
        else:
            os.environ["GRADCOMM_CODEC_PLACEMENT"] = before


def _calls(MPI: Any, rank: int, cupy: bool) -> list[tuple[str, Any, Any, Any]]:
    """(form, sendbuf, recvbuf, the tensor whose bytes are the result) of one round as
    torch CPU tensors: fresh ones, the same values on every call at one rank."""
    import torch

    def data(n: int, dtype: Any, salt: int = 0) -> Any:
        g = np.random.default_rng(1000 * rank + salt).standard_normal(n) * (rank + 1)
        return torch.from_numpy(g).to(dtype)

    f32 = torch.float32
    x, s, r = data(N, f32), data(N, f32, 1), torch.full((N,), -7.0)
    part = data(N, f32, 2)
    b, bo = data(257, torch.bfloat16, 3), torch.zeros(257, dtype=torch.bfloat16)
    h = data(64, torch.float16, 4).reshape(8, 8)
    e = torch.zeros(0)
    return [("in_place", MPI.IN_PLACE, x, x), ("send_recv", s, r, r),
            ("count", MPI.IN_PLACE, [part, 700, MPI.FLOAT], part),
            *([] if cupy else [("bfloat16", b, bo, bo)]),        # cupy has no bfloat16
            ("float16", MPI.IN_PLACE, h, h), ("empty", MPI.IN_PLACE, e, e)]


def _to(place: str, call: tuple[str, Any, Any, Any]) -> tuple[str, Any, Any, Any]:
    """``call``'s tensors as arrays of ``place`` (the same objects stay the same)."""
    made: dict[int, Any] = {}

    def conv(t: Any) -> Any:
        if id(t) not in made:
            if place == "cupy":
                import cupy

                made[id(t)] = cupy.asarray(t.numpy())
            else:
                made[id(t)] = t.clone() if place == "torch-cpu" else t.cuda()
        return made[id(t)]

    def spec(x: Any) -> Any:
        if isinstance(x, list):
            return [conv(x[0]), *x[1:]]
        return conv(x) if hasattr(x, "shape") else x       # MPI.IN_PLACE stays

    form, send, recv, result = call
    return form, spec(send), spec(recv), conv(result)


def _digest(t: Any) -> str:
    from gradcomm import arrays

    return hashlib.sha256(arrays.copy_to_host(t).tobytes()).hexdigest()[:16]


def compressed_wrap_on_the_device(place: str = "torch-cpu") -> dict:
    """On every rank, each case twice, on separate wraps of COMM_WORLD (separate
    transports: the same step numbers): torch CPU tensors on the host path (placement
    "auto"), then the same values as ``place`` arrays with placement "array" (CUDA arrays:
    the device route in either placement). Digests of the results, routes, a few values."""
    from mpi4py import MPI

    from gradcomm import arrays
    from gradcomm.integrations.mpi import _plan, wrap

    rank = MPI.COMM_WORLD.Get_rank()
    out: dict = {"rank": rank, "env": os.environ.get("GRADCOMM_CODEC_PLACEMENT")}
    for name, algorithm, opts in CASES:
        case = f"{name}/{algorithm}"
        for mode in ("auto", "array"):
            comm = wrap(MPI.COMM_WORLD, algorithm, name, **opts)
            with _placement(mode):
                for call in _calls(MPI, rank, cupy=place == "cupy"):
                    form, send, recv, result = call if mode == "auto" else _to(place, call)
                    route = comm._gradcomm_route(*_plan(MPI, comm, send, recv, MPI.SUM))
                    before = _digest(result), arrays.copy_to_host(result)[700 * 4:].tolist()
                    comm.Allreduce(send, recv, op=MPI.SUM)
                    got = {"route": route, "bytes": _digest(result), "reduced": _digest(
                        result.reshape(-1)[:700 if form == "count" else None])}
                    got["changed"] = got["bytes"] != before[0] or form == "empty"
                    got["tail_kept"] = form != "count" or \
                        arrays.copy_to_host(result)[700 * 4:].tolist() == before[1]
                    if mode == "auto":
                        got["values"] = result.double().reshape(-1)[:4].tolist()
                    out.setdefault(f"{case}/{form}", {})[mode] = got
    return out


def check_results(results: list[dict], place: str) -> None:
    """Every device result has the host path's bytes, on every rank."""
    cases = [k for k in results[0] if k.count("/") == 2]
    assert len(cases) == len(CASES) * (5 if place == "cupy" else 6)
    for res in results:
        for key in cases:
            host, dev = res[key]["auto"], res[key]["array"]
            assert host["route"] == "direct" and dev["route"] == "device", key
            assert dev["bytes"] == host["bytes"], (place, res["rank"], key, host, dev)
            assert dev["reduced"] == results[0][key]["array"]["reduced"], key  # all ranks
            for got in (host, dev):                      # reduced, the rest kept
                assert got["tail_kept"] and got["changed"], (key, got)
    # fp16 on the wire: sums close to the exact ones (the partial count, both routes)
    for key in ("fp16/allgather/count", "fp16/ring/count"):
        want = sum(np.random.default_rng(1000 * r + 2).standard_normal(N)[:4] * (r + 1)
                   for r in range(2))
        np.testing.assert_allclose(results[0][key]["auto"]["values"], want, rtol=2e-3,
                                   atol=2e-3)


@pytest.mark.timeout(90)
def test_compressed_wrap_on_device_buffers_gives_the_host_bytes() -> None:
    require_mpi()
    require_torch()
    results = mpi_call(compressed_wrap_on_the_device, 2, timeout=75,
                       env={"GRADCOMM_CODEC_PLACEMENT": "array"})
    assert {r["env"] for r in results} == {"array"}
    check_results(results, "torch-cpu")
