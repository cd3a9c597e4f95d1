"""The pipelined compressed ring (codec on a worker thread) against the serial ring.

Bars: the same bytes as the serial ring for every codec (the wire sees the same calls in
the same order), the same error-feedback residuals, identical bytes on every rank; a bad
peer frame raises PayloadError on the receiving rank and the others are released, not
left waiting; a rank that never joins gives a DeadlineError.
"""

from __future__ import annotations

import numpy as np
import pytest

from gradcomm import compressors
from gradcomm.compressed import compressed_allreduce
from gradcomm.compressed import ring as compressed_ring
from gradcomm.compressed import routes
from gradcomm.compressed.wire import CompressedWire
from gradcomm.comm import run_ranks
from gradcomm.error_feedback import ErrorFeedback
from gradcomm.errors import DeadlineError, PayloadError

pytestmark = pytest.mark.timeout(300)

CODECS = [("none", {}), ("fp16", {}), ("bf16", {}), ("int8", {}), ("qsgd", {}),
          ("terngrad", {}), ("onebit", {}), ("topk", {"ratio": 0.1}),
          ("randomk", {"ratio": 0.2}), ("int8", {"scale": 8.0})]


def _input(rank: int, n: int, step: int = 0) -> np.ndarray:
    rng = np.random.default_rng(100 * rank + step)
    return rng.standard_normal(n).astype(np.float32)


def _steps(p: int, n: int, codec, pipeline: str, monkeypatch, T: int = 3, ef: bool = True):
    monkeypatch.setenv("GRADCOMM_PIPELINE", pipeline)
    monkeypatch.setattr(routes, "CHUNK_BYTES", 4096)     # several chunks per segment

    def fn(t):
        state = ErrorFeedback(enabled=ef)
        outs = [compressed_allreduce(t, _input(t.rank, n, s), "float32", op="mean",
                                     algorithm="ring", compressor=codec,
                                     residuals=state, key="w").copy() for s in range(T)]
        return outs, {k: state._residuals[k].copy() for k in state.names()}
    return run_ranks(p, fn, timeout=120)


@pytest.mark.parametrize("name,opts", CODECS, ids=[f"{n}{o}" for n, o in CODECS])
@pytest.mark.parametrize("p", [2, 3, 4])
def test_same_bytes_as_the_serial_ring(name: str, opts: dict, p: int, monkeypatch) -> None:
    codec = compressors.get(name, **opts)
    n = 5000 + p
    serial = _steps(p, n, codec, "0", monkeypatch)
    piped = _steps(p, n, codec, "1", monkeypatch)
    for r in range(p):
        for a, b in zip(serial[r][0], piped[r][0]):
            assert a.tobytes() == b.tobytes(), (r, name)
        assert piped[r][0][-1].tobytes() == piped[0][0][-1].tobytes()
        assert serial[r][1].keys() == piped[r][1].keys()
        for k in serial[r][1]:
            assert serial[r][1][k].tobytes() == piped[r][1][k].tobytes(), (r, k)


def test_large_default_threshold_takes_the_pipeline(monkeypatch) -> None:
    monkeypatch.delenv("GRADCOMM_PIPELINE", raising=False)
    for var in compressed_ring.LOCAL_SIZE_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(compressed_ring.os, "cpu_count", lambda: 4)
    assert compressed_ring.wanted(compressed_ring.MIN_BYTES)
    assert not compressed_ring.wanted(compressed_ring.MIN_BYTES - 1)
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "3")       # 3 ranks on 4 cores
    assert not compressed_ring.wanted(compressed_ring.MIN_BYTES)
    monkeypatch.delenv("OMPI_COMM_WORLD_LOCAL_SIZE")
    n = compressed_ring.MIN_BYTES // 4 + 3
    calls = []
    real = compressed_ring.allreduce

    def spy(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(compressed_ring, "allreduce", spy)
    res = run_ranks(2, lambda t: compressed_allreduce(
        t, np.full(n, t.rank + 1.0, np.float32), "float32", op="sum", algorithm="ring",
        compressor="fp16"))
    assert calls and np.all(res[0] == 3.0) and res[0].tobytes() == res[1].tobytes()


def test_bad_peer_frame_is_a_payload_error_and_releases_the_others(monkeypatch) -> None:
    monkeypatch.setenv("GRADCOMM_PIPELINE", "1")
    real = CompressedWire.encode

    def corrupt(self, seg):
        frame = real(self, seg)
        if self.seeds.rank == 1:
            frame[0] = 7                     # announces 7 parts
        return frame

    monkeypatch.setattr(CompressedWire, "encode", corrupt)
    with pytest.raises(PayloadError, match="parts"):
        run_ranks(3, lambda t: compressed_allreduce(
            t, np.ones(3000, np.float32), "float32", op="sum", algorithm="ring",
            compressor="fp16", check=False), timeout=60)


def test_absent_rank_gives_a_deadline(monkeypatch) -> None:
    monkeypatch.setenv("GRADCOMM_PIPELINE", "1")

    def fn(t):
        if t.rank == 1:
            return None
        return compressed_allreduce(t, np.ones(3000, np.float32), "float32", op="sum",
                                    algorithm="ring", compressor="fp16", check=False)

    with pytest.raises(DeadlineError):
        run_ranks(2, fn, timeout=30, wait_timeout=1.0)


def launched(n: int) -> dict[str, str]:
    """On every launched rank: digests of serial and pipelined ring results per codec."""
    import hashlib
    import os

    from gradcomm.comm import get_transport

    t = get_transport(None)
    out = {}
    for name, opts in CODECS:
        codec = compressors.get(name, **opts)
        for pipe in ("0", "1"):
            os.environ["GRADCOMM_PIPELINE"] = pipe
            y = compressed_allreduce(t, _input(t.rank, n), "float32", op="mean",
                                     algorithm="ring", compressor=codec,
                                     residuals=ErrorFeedback(enabled=False))  # step 0
            out[f"{name}{opts}/{pipe}"] = hashlib.sha1(y.tobytes()).hexdigest()
    return out


@pytest.mark.parametrize("launcher,p", [("mpi", 2), ("mpi", 3), ("torch", 2)])
# torch (gloo) is not pollable: both settings take the serial ring there
def test_pipelined_ring_on_real_launchers(launcher: str, p: int) -> None:
    from tests._launch import mpi_call, require_mpi, torch_call

    if launcher == "mpi":
        require_mpi()
        res = mpi_call(launched, p, 300_001, timeout=240)
    else:
        res = torch_call(launched, p, 300_001, timeout=240)
    for name, opts in CODECS:
        digests = {r[f"{name}{opts}/{pipe}"] for r in res for pipe in ("0", "1")}
        assert len(digests) == 1, (name, opts)


def test_a_slow_link_in_the_profile_takes_the_pipeline(monkeypatch) -> None:
    """Without a spare core, a calibrated profile whose link is slow against the codec
    (1 Gbit/s-like beta) still turns the worker on for wire-heavy codecs; a fast one not."""
    from gradcomm.collectives import auto
    from gradcomm.collectives.costmodel import Profile

    monkeypatch.delenv("GRADCOMM_PIPELINE", raising=False)
    monkeypatch.setattr(compressed_ring.os, "cpu_count", lambda: 1)

    def bound(beta):
        prof = Profile("threads", 2, alpha=5e-5, beta=beta, gamma={"float32": 1e-10},
                       copy=1e-10)

        def fn(t):
            auto.use_profile(t, prof)
            auto.agree_profile(t)
            x = np.zeros(1 << 22, np.float32)
            out = {}
            for name in ("fp16", "onebit"):
                link = routes.link_bound(t, compressors.get(name), x)
                out[name] = link and compressed_ring.wanted(x.nbytes, t, link)
            return out
        return run_ranks(2, fn)[0]

    assert bound(8e-9) == {"fp16": True, "onebit": False}
    assert bound(1e-10) == {"fp16": False, "onebit": False}
