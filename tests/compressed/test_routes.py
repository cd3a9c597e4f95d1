"""gradcomm.compressed.routes: how far one compressed message of the per-hop ring and
tree reaches (span_bytes), and that the routes keep to it on both rings."""

from __future__ import annotations

import numpy as np
import pytest

from gradcomm import compressors
from gradcomm.compressed import compressed_allreduce, routes
from gradcomm.comm import run_ranks

pytestmark = pytest.mark.timeout(120)


def test_span_follows_the_compressed_size_up_to_the_cap() -> None:
    n = 10**8
    fp16, onebit = compressors.get("fp16"), compressors.get("onebit")
    assert routes.span_bytes(fp16, n, "float32") == pytest.approx(2 * routes.CHUNK_BYTES,
                                                                  rel=1e-3)
    assert routes.span_bytes(onebit, n, "float32") == routes.MAX_SPAN_BYTES
    # a message is about CHUNK_BYTES compressed, and less where the cap cuts it
    assert routes.message_bytes(fp16, n, "float32") == pytest.approx(routes.CHUNK_BYTES,
                                                                     rel=1e-3)
    assert routes.message_bytes(onebit, n, "float32") < routes.CHUNK_BYTES / 4
    assert routes.span_bytes(onebit, 3, "float64") >= 8


@pytest.mark.parametrize("pipeline", ["0", "1"])
@pytest.mark.parametrize("name", ["onebit", "terngrad"])
def test_a_high_ratio_codec_sends_a_segment_in_capped_messages(
        name: str, pipeline: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The ring sends each segment in ceil(segment / cap) messages, not one, on the
    serial and the pipelined ring alike, and every rank holds the same bytes."""
    monkeypatch.setenv("GRADCOMM_PIPELINE", pipeline)
    monkeypatch.setattr(routes, "MAX_SPAN_BYTES", 4096)   # 1024 floats per message
    p, n = 2, 10_007                                        # segments of 5004 and 5003

    def fn(t):
        x = np.random.default_rng([t.rank, n]).standard_normal(n).astype(np.float32)
        t.stats.reset()
        out = compressed_allreduce(t, x, "float32", op="sum", algorithm="ring",
                                   compressor=name, check=False)
        return out.tobytes(), t.stats.messages_sent

    res = run_ranks(p, fn, timeout=60)
    assert all(r[0] == res[0][0] for r in res)
    assert [r[1] for r in res] == [2 * 5] * p     # 5 messages per segment, two phases


def _gauss(rank: int, n: int, step: int) -> np.ndarray:
    return np.random.default_rng([rank, n, step]).standard_normal(n).astype(np.float32)


def _reads_where_it_lies(t, algorithm: str, name: str, **opts) -> tuple[list, bytes]:
    """gradcomm.Allreduce (sum, error feedback, the guard) for three steps, then the
    stateless allreduce, each against compressed_allreduce on a copy (its own store):
    the same bytes and residuals, the input untouched, the guard's input norm exact.
    Returns the checks and the last result's bytes."""
    import gradcomm
    from gradcomm.compressed.guard import sq_norm
    from gradcomm.error_feedback import ErrorFeedback

    n = 300_007                                            # above one pipeline chunk
    ar = gradcomm.Allreduce(t, op="sum", algorithm=algorithm, compressor=name, **opts)
    ref = ErrorFeedback(enabled=True)
    ok = []
    for step in range(3):
        x = _gauss(t.rank, n, step)
        keep = x.copy()
        got = ar(x, key="w")
        want = compressed_allreduce(t, keep.copy(), "float32", op="sum",
                                    algorithm=algorithm, compressor=name, residuals=ref,
                                    key="w", **opts)
        ok += [got.tobytes() == want.tobytes(), x.tobytes() == keep.tobytes(),
               ar.error_feedback.residual("w", n, np.float32).tobytes()
               == ref.residual("w", n, np.float32).tobytes()]
    ok.append(ar.guard._scale["w"] == max(sq_norm(_gauss(t.rank, n, s)) for s in range(3)))
    tree = gradcomm.Allreduce(t, op="sum", algorithm="tree", compressor=name, **opts)
    ok += [ar._reads(t, n), not tree._reads(t, n)]         # the tree copies, norm in pass
    plain = gradcomm.allreduce(x, t, op="sum", algorithm=algorithm, compressor=name, **opts)
    want = compressed_allreduce(t, keep.copy(), "float32", op="sum", algorithm=algorithm,
                                compressor=name, **opts)
    ok += [plain.tobytes() == want.tobytes(), x.tobytes() == keep.tobytes()]
    return ok, got.tobytes()


def test_a_sparse_sum_reads_its_input_where_it_lies() -> None:
    """Top-k sums take their pairs from the caller's array, not from a copy
    (:func:`_reads_where_it_lies`)."""
    res = run_ranks(3, lambda t: _reads_where_it_lies(t, "auto", "topk", ratio=0.01),
                    timeout=60)
    assert all(all(ok) for ok, _ in res), [ok for ok, _ in res]
    assert all(r[1] == res[0][1] for r in res)


def _topk_replay(x: np.ndarray, e: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """One top-k error-feedback step done as its definition says, from the stateless
    codec: ``y = x + e``, the decoded ``d`` of ``compress(y)``, the new ``e = y - d``."""
    c = compressors.get("topk", k=k)
    y = x + e
    d = c.decompress(c.compress(y))
    return d, y - d


@pytest.mark.parametrize("p", [2, 3])
def test_topk_feedback_on_the_sparse_route_is_its_definition(
        p: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """gradcomm.Allreduce with top-k and error feedback on the sparse route (the fused
    selection, the pairs read where they lie, each rank's own block not decoded back):
    each step's residual and result are those of the definition (:func:`_topk_replay`,
    sums in rank order). After an exchange that fails (a DeadlineError raised at once)
    the residual is as the codec's pass left it: the kept pairs taken out."""
    import gradcomm
    from gradcomm.errors import DeadlineError

    n, k = 300_007, 3_000                              # the numba kernels' sampled path
    calls = [0] * p
    exchange = routes._sparse_sum

    def failing_fourth(t, *a, **kw):
        calls[t.rank] += 1
        if calls[t.rank] == 4:
            raise DeadlineError("planted: the peers never came")
        return exchange(t, *a, **kw)

    monkeypatch.setattr(routes, "_sparse_sum", failing_fourth)

    def fn(t):
        ar = gradcomm.Allreduce(t, op="sum", algorithm="sparse_allgather",
                                compressor="topk", k=k)
        seen = []
        for step in range(4):
            try:
                out = ar(_gauss(t.rank, n, step), key="w")
            except DeadlineError:
                out = None
            seen.append((out, ar.error_feedback.residual("w", n, np.float32).copy()))
        return seen

    res = run_ranks(p, fn, timeout=60)
    e = [np.zeros(n, np.float32) for _ in range(p)]
    for step in range(4):
        total = np.zeros(n, np.float32)
        for r in range(p):
            d, e[r] = _topk_replay(_gauss(r, n, step), e[r], k)
            total += d
        for r in range(p):
            out, got_e = res[r][step]
            assert got_e.tobytes() == e[r].tobytes(), (step, r)
            assert (out is None) == (step == 3), (step, r)
            assert out is None or out.tobytes() == total.tobytes(), (step, r)


@pytest.mark.parametrize("kernels", ["auto", "numpy"])
@pytest.mark.parametrize("name", ["int8", "onebit", "fp16"])
@pytest.mark.parametrize("p", [2, 3])
def test_the_planned_gather_reads_its_input_where_it_lies(name: str, p: int, kernels: str,
                                                          monkeypatch) -> None:
    """A planned codec's frames on the allgather route are encoded from the caller's
    array and the sum decoded into a fresh buffer (:func:`_reads_where_it_lies`), and
    PlannedGather.run was handed the input for the codecs that plan. numpy's kernels do
    not fuse the residual: the plan's step-by-step path decodes into the result."""
    from gradcomm.compressed.planned import PlannedGather

    monkeypatch.setenv("GRADCOMM_KERNELS", kernels)
    given = []
    run = PlannedGather.run

    def spy(self, t, x, *a, src=None, **kw):
        given.append(src is not None and not np.shares_memory(src, x))
        return run(self, t, x, *a, src=src, **kw)

    monkeypatch.setattr(PlannedGather, "run", spy)
    res = run_ranks(p, lambda t: _reads_where_it_lies(t, "allgather", name), timeout=60)
    assert all(all(ok) for ok, _ in res), [ok for ok, _ in res]
    assert all(r[1] == res[0][1] for r in res)
    plans = name in ("int8", "onebit")
    assert bool(given) == plans and (not plans or sum(given) == 4 * p), given


@pytest.mark.parametrize("name", [c for c in compressors.names() if c != "powersgd"])
def test_the_serial_ring_folds_from_src(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """compressed_allreduce(src=...) on the ring, several messages per segment, three
    steps with error feedback, p = 3: the bytes and every hop's residual of the copying
    path, src untouched, whatever the result buffer held (NaN here); on the serial ring
    (which encodes and folds from src) and the pipelined one (which copies it in)."""
    from gradcomm.compressed.wire import CompressedWire
    from gradcomm.error_feedback import ErrorFeedback

    monkeypatch.setattr(routes, "MAX_SPAN_BYTES", 4096)
    monkeypatch.setattr(routes, "CHUNK_BYTES", 2048)
    p, n = 3, 20_011
    given: list[bool] = []
    init = CompressedWire.__init__

    def spy(self, *a, src=None, **kw):
        given.append(src is not None)
        init(self, *a, src=src, **kw)

    monkeypatch.setattr(CompressedWire, "__init__", spy)

    def fn(t):
        a, b = ErrorFeedback(enabled=True), ErrorFeedback(enabled=True)
        ok = []
        for step in range(3):
            x = _gauss(t.rank, n, step)
            keep = x.copy()
            got = compressed_allreduce(t, np.full_like(x, np.nan), "float32", op="sum",
                                       algorithm="ring", compressor=name, residuals=a,
                                       key="w", src=x)
            want = compressed_allreduce(t, keep.copy(), "float32", op="sum",
                                        algorithm="ring", compressor=name, residuals=b,
                                        key="w")
            ok += [got.tobytes() == want.tobytes(), x.tobytes() == keep.tobytes(),
                   sorted(a.names()) == sorted(b.names())]
            ok += [a._residuals[k].tobytes() == b._residuals[k].tobytes()
                   for k in b.names()]
        return ok

    for pipeline in ("0", "1"):
        monkeypatch.setenv("GRADCOMM_PIPELINE", pipeline)
        given.clear()
        res = run_ranks(p, fn, timeout=60)
        assert all(all(ok) for ok in res), (pipeline, res)
        # the serial ring's wire got src in each call that passed it (half of them)
        assert sum(given) == (3 * p if pipeline == "0" else 0), (pipeline, given)
