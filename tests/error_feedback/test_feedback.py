"""ErrorFeedback and gradcomm.Allreduce: residuals, steps, checkpoints, bitwise resume."""

from __future__ import annotations

import io
from typing import Any

import numpy as np
import pytest

import gradcomm
from gradcomm import compressors
from gradcomm.comm import run_ranks
from gradcomm.error_feedback import (ErrorFeedback, ErrorFeedbackWarning,
                                     ResidualResetWarning, ResidualStore, contractive,
                                     torch_safe_globals)
from gradcomm.errors import ConfigError
from tests._grid import Grid
from tests._cases import torch_roundtrip

pytestmark = pytest.mark.timeout(300)

LOSSY = tuple(n for n in compressors.names() if compressors.get(n).lossy)


def _grad(rank: int, step: int, shape=(6, 7)) -> np.ndarray:
    rng = np.random.default_rng(rank * 1000 + step)
    return rng.standard_normal(shape).astype(np.float32)


# -- the state object -----------------------------------------------------------------------
def test_telescopes_with_a_toy_codec() -> None:
    ef = ErrorFeedback()
    total_in = np.zeros(5)
    total_out = np.zeros(5)
    for s in range(50):
        g = _grad(0, s, (5,))
        total_in += g
        x = ef.compensate("w", g.copy())
        decoded = np.round(x * 2) / 2                 # drops everything below 1/4
        ef.update("w", x, decoded)
        total_out += decoded
    np.testing.assert_allclose(total_out + ef.residual("w", 5, np.float32), total_in,
                               atol=1e-5)


def test_disabled_keeps_steps_only() -> None:
    ef = ErrorFeedback(enabled=False)
    x = np.ones(3, np.float32)
    assert ef.compensate("w", x) is x and x.tolist() == [1, 1, 1]
    ef.update("w", x, np.zeros(3, np.float32))
    ef.advance("w")
    assert list(ef.names()) == [] and ef.step("w") == 1


def test_is_a_residual_store_with_one_piece_per_key() -> None:
    """The ResidualStore side: the key's residual is one flat array (fused codecs update
    it in place), hops are residuals by name, and no tensor layout is known."""
    ef = ErrorFeedback()
    assert isinstance(ef, ResidualStore)
    e = ef.flat_residual("w", 3, np.float32)
    e[...] = [1, 2, 3]
    assert ef.residual("w", 3, np.float32) is e
    assert ef.compensate("w", np.zeros(3, np.float32)).tolist() == [1, 2, 3]
    h = ef.hop_residual("w#e0", 5, 2, np.float32)
    assert ef.residual("w#e0", 2, np.float32) is h and ef.parts("w") is None
    assert list(ef.names()) == ["w", "w#e0"]


def test_shape_change_resets_with_warning() -> None:
    ef = ErrorFeedback()
    ef.update("w", np.ones(4, np.float32), np.zeros(4, np.float32))
    with pytest.warns(ResidualResetWarning, match="'w' held 4 x float32"):
        e = ef.residual("w", 5, np.float32)
    assert e.tolist() == [0.0] * 5
    with pytest.warns(ResidualResetWarning):
        ef.residual("w", 5, np.float64)


def _filled() -> ErrorFeedback:
    ef = ErrorFeedback()
    ef.update("a.weight", np.arange(4, dtype=np.float32), np.zeros(4, np.float32))
    ef.update("a.weight#f1", np.ones(2), np.zeros(2))
    ef.advance("a.weight")
    ef.advance("a.weight")
    return ef


def _assert_same(a: ErrorFeedback, b: ErrorFeedback) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sorted(sa) == sorted(sb)
    for k in sa:
        va, vb = np.asarray(sa[k]), np.asarray(sb[k])
        assert va.dtype == vb.dtype and va.tobytes() == vb.tobytes(), k


def test_state_dict_numpy_savez(tmp_path) -> None:
    ef = _filled()
    path = tmp_path / "ef.npz"
    np.savez(path, **ef.state_dict())
    with np.load(path, allow_pickle=False) as data:
        back = ErrorFeedback()
        back.load_state_dict(data)
    _assert_same(ef, back)
    assert back.step("a.weight") == 2


def test_state_dict_torch_save() -> None:
    torch = pytest.importorskip("torch")
    ef = _filled()
    buf = io.BytesIO()
    torch.save({"ef": ef.state_dict()}, buf)
    for weights_only in (False, True):
        buf.seek(0)
        if weights_only:
            with torch.serialization.safe_globals(torch_safe_globals()):
                sd = torch.load(buf, weights_only=True)["ef"]
        else:
            sd = torch.load(buf, weights_only=False)["ef"]
        back = ErrorFeedback()
        back.load_state_dict(sd)
        _assert_same(ef, back)


def test_state_dict_is_a_copy_and_bad_states_are_refused() -> None:
    ef = _filled()
    sd = ef.state_dict()
    sd["residual/a.weight"][:] = 99
    assert ef.residual("a.weight", 4, np.float32).tolist() == [0, 1, 2, 3]
    with pytest.raises(ConfigError, match="not an ErrorFeedback state"):
        ErrorFeedback().load_state_dict({})
    with pytest.raises(ConfigError, match="version 9"):
        ErrorFeedback().load_state_dict({**sd, "gradcomm_error_feedback_version": 9})
    with pytest.raises(ConfigError, match="flat float"):
        ErrorFeedback().load_state_dict({**sd, "residual/x": np.zeros((2, 2))})
    with pytest.raises(ConfigError, match="unexpected entry"):
        ErrorFeedback().load_state_dict({**sd, "junk": 1})


def test_reset_one_key_and_its_hops() -> None:
    ef = _filled()
    ef.update("b", np.ones(1), np.zeros(1))
    ef.reset("a.weight")
    assert list(ef.names()) == ["b"] and ef.step("a.weight") == 0


# -- Allreduce ------------------------------------------------------------------------------
def _train(t, ar_factory, steps: range, state=None, kind: str = "numpy"):
    ar = ar_factory(t)
    if state is not None:
        ar.load_state_dict(state[t.rank])
    outs = []
    for s in steps:
        for key, shape in (("fc1.weight", (6, 7)), ("fc1.bias", (7,))):
            g = _grad(t.rank, s * 2 + len(key), shape)
            if kind == "torch":
                import torch

                g = torch.from_numpy(g)
            y = ar(g, key=key)
            outs.append(np.asarray(y).tobytes())
    return outs, ar.state_dict()


CASES = [("none", "none", "ring"), ("grid", Grid(0.5), "ring"),
         ("grid", Grid(0.5), "recursive_doubling"), ("grid", Grid(0.5), "tree"),
         ("grid", Grid(0.5), "rabenseifner"), ("grid", Grid(0.5), "allgather")] + [
    (name, name, alg) for name in LOSSY for alg in ("auto", "ring", "recursive_doubling")]


@pytest.mark.filterwarnings("ignore::gradcomm.error_feedback.ErrorFeedbackWarning")
@pytest.mark.parametrize("label,codec,algorithm", CASES)
def test_resume_is_bitwise_equal_to_unbroken_run(label: str, codec: Any, algorithm: str,
                                                 tmp_path) -> None:
    p, k, T = 3, 3, 7

    def factory(t):
        return gradcomm.Allreduce(t, algorithm=algorithm, compressor=codec, seed=5)

    unbroken = run_ranks(p, lambda t: _train(t, factory, range(T))[0])
    first = run_ranks(p, lambda t: _train(t, factory, range(k)))
    states = []
    for r, (_, sd) in enumerate(first):                # through numpy.savez and back
        path = tmp_path / f"rank{r}.npz"
        np.savez(path, **sd)
        with np.load(path, allow_pickle=False) as data:
            states.append(dict(data))
    rest = run_ranks(p, lambda t: _train(t, factory, range(k, T), states)[0])
    for r in range(p):
        assert first[r][0] + rest[r] == unbroken[r], f"rank {r} diverged after resume"


def test_resume_torch_tensors_and_torch_save() -> None:
    pytest.importorskip("torch")
    if not LOSSY:
        pytest.skip("no lossy codec registered yet")
    p, k, T = 2, 2, 5

    def factory(t):
        return gradcomm.Allreduce(t, compressor=LOSSY[0], seed=1)

    unbroken = run_ranks(p, lambda t: _train(t, factory, range(T), kind="torch")[0])
    first = run_ranks(p, lambda t: _train(t, factory, range(k), kind="torch"))
    states = [torch_roundtrip(sd) for _, sd in first]
    rest = run_ranks(p, lambda t: _train(t, factory, range(k, T), states, kind="torch")[0])
    for r in range(p):
        assert first[r][0] + rest[r] == unbroken[r]


def test_allreduce_object_basics() -> None:
    def fn(t):
        ar = gradcomm.Allreduce(t, op="sum")
        x = np.arange(4, dtype=np.float64).reshape(2, 2)
        y = ar(x, key="w")
        return y.shape, y.dtype, y.tolist(), x.tolist()

    for shape, dtype, y, x in run_ranks(3, fn):
        assert shape == (2, 2) and dtype == np.float64
        assert y == [[0.0, 3.0], [6.0, 9.0]] and x == [[0.0, 1.0], [2.0, 3.0]]
    with pytest.raises(ConfigError, match="compressor options"):
        gradcomm.Allreduce(None, ratio=0.1)
    with pytest.raises(ConfigError, match="seed"):
        gradcomm.Allreduce(None, compressor="none", seed=-3)


def test_a_dense_allreduce_object_reads_a_large_input_where_it_lies() -> None:
    """Without a codec, an input of a pipeline chunk and more goes to the reduction as its
    source (no copy in): exact sum and mean, the input untouched, a fresh result."""
    n = (1 << 17) + 3                                   # float64: 1 MiB and 24 B

    def fn(t):
        x = (np.arange(n, dtype=np.int64) * 7919 % 1013 + t.rank).astype(np.float64)
        keep = x.copy()
        s = gradcomm.Allreduce(t, op="sum")(x, key="w")
        m = gradcomm.Allreduce(t, op="mean", algorithm="ring")(x, key="w")
        return np.array_equal(x, keep) and not np.shares_memory(s, x), s, m

    want = sum((np.arange(n, dtype=np.int64) * 7919 % 1013 + r).astype(np.float64)
               for r in range(3))
    for kept, s, m in run_ranks(3, fn):
        assert kept and np.array_equal(s, want) and np.array_equal(m, want / 3)


def test_load_state_of_another_configuration_is_refused() -> None:
    a = gradcomm.Allreduce(None, compressor="none", seed=1)
    b = gradcomm.Allreduce(None, compressor="none", seed=2)
    with pytest.raises(ConfigError, match="seed 1"):
        b.load_state_dict(a.state_dict())


def test_error_feedback_makes_the_running_mean_converge() -> None:
    """With a lossy codec, the time-average of Allreduce outputs approaches the true mean
    with error feedback (residual / T), and does not without it for a biased codec."""
    if "topk" not in compressors.names():
        pytest.skip("topk not registered yet")
    p, T, n = 2, 60, 200

    def fn(t, ef):
        ar = gradcomm.Allreduce(t, compressor="topk", ratio=0.05, error_feedback=ef)
        g = np.random.default_rng(t.rank).standard_normal(n).astype(np.float32)
        return sum(ar(g, key="w").astype(np.float64) for _ in range(T)) / T

    exact = sum(np.random.default_rng(r).standard_normal(n).astype(np.float32)
                .astype(np.float64) for r in range(p)) / p
    err = {ef: np.linalg.norm(run_ranks(p, lambda t: fn(t, ef))[0] - exact) /
           np.linalg.norm(exact) for ef in (True, False)}
    assert err[True] < 0.25 * err[False], err


def test_error_feedback_refused_for_non_contractions() -> None:
    """QSGD with few levels and 1-bit int8 would make the residuals diverge: Allreduce
    says so and runs without them. TernGrad (not a contraction, but every element's error
    below max|v|, the largest exact: ``feedback_stable``) takes error feedback."""
    assert not contractive(compressors.get("qsgd", levels=4))
    assert contractive(compressors.get("qsgd", levels=127))
    assert contractive(compressors.get("terngrad"))
    for name, opts in (("int8", {"bits": 1}), ("qsgd", {"levels": 2})):
        with pytest.warns(ErrorFeedbackWarning, match="not applied"):
            ar = gradcomm.Allreduce(None, compressor=name, **opts)
        assert not ar.error_feedback.enabled
    gradcomm.Allreduce(None, compressor="qsgd", levels=2, error_feedback=False)  # silent


def test_residual_shape_change_through_allreduce() -> None:
    """A key whose tensor changed shape gets a fresh residual, with a warning."""
    def fn(t):
        ar = gradcomm.Allreduce(t, compressor=Grid(0.5), algorithm="allgather")
        ar(np.full(4, 0.2, np.float32), key="w")
        return ar(np.full(6, 0.2, np.float32), key="w").tolist()

    with pytest.warns(ResidualResetWarning, match="'w' held 4 x float32"):
        assert run_ranks(2, fn)[0] == [0.0] * 6


def test_uncompressed_sparse_gradient_through_sparse_allgather() -> None:
    """Allreduce(algorithm="sparse_allgather") without a codec: the nonzeros travel."""
    n = 1000

    def fn(t):
        x = np.zeros(n, np.float32)
        x[[t.rank, 500 + t.rank, 999]] = 1.0
        t.stats.reset()
        y = gradcomm.Allreduce(t, op="sum", algorithm="sparse_allgather", check=False)(x)
        return y, t.stats.bytes_sent

    for y, sent in run_ranks(3, fn):
        assert np.flatnonzero(y).tolist() == [0, 1, 2, 500, 501, 502, 999]
        assert y[999] == 3.0 and sent < 200
