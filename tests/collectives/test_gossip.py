"""gossip_average and Gossip on in-process ranks: exact mixing, conservation, contraction,
traffic per round, bad input on every rank, CHOCO compressed gossip and its state."""

from __future__ import annotations

import numpy as np
import pytest

import gradcomm
from gradcomm._dtypes import f32_to_bf16
from gradcomm.collectives import topologies as T
from gradcomm.collectives._check import NATIVE_FIELDS
from gradcomm.collectives.gossip import Gossip, consensus_distance, gossip_average
from gradcomm.comm import run_ranks
from gradcomm.comm.base import TAG_GOSSIP
from gradcomm.compressors import Compressor, Payload
from gradcomm.errors import (ConfigError, GradcommError, MismatchError, TransportError,
                             UnsupportedError)

pytestmark = pytest.mark.timeout(60)

FLOATS = ("float16", "bfloat16", "float32", "float64")


def run(p, fn, timeout=30):
    return run_ranks(p, fn, timeout=timeout)


def fits(name, p):
    return name != "torus" or p == 1 or any(p % r == 0 for r in range(2, int(p ** 0.5) + 1))


def ref_matrix(name: str, p: int, step: int) -> np.ndarray:
    """The default mixing matrix, built here from the topology's definition alone."""
    if p == 1:
        return np.ones((1, 1))
    if name == "complete":
        return np.full((p, p), 1.0 / p)
    if name == "exponential":
        m = max(1, (p - 1).bit_length())
        d = 1 << (step % m)
        w = np.zeros((p, p))
        for i in range(p):
            w[i, i] += 0.5
            w[i, (i - d) % p] += 0.5
        return w
    if name == "ring":
        nbrs = [{(i - 1) % p, (i + 1) % p} - {i} for i in range(p)]
    else:                                   # torus, squarest rows x cols with both >= 2
        r = max(d for d in range(2, int(p ** 0.5) + 1) if p % d == 0)
        c = p // r
        nbrs = [{((i // c + da) % r) * c + (i % c + db) % c
                 for da, db in ((1, 0), (-1, 0), (0, 1), (0, -1))} - {i} for i in range(p)]
    w = np.zeros((p, p))
    for i in range(p):
        for j in nbrs[i]:
            w[i, j] = 1.0 / (len(nbrs[i]) + 1)     # every built-in graph is regular
        w[i, i] = 1.0 / (len(nbrs[i]) + 1)
    return w


def inputs(p, n, seed=0):
    return np.random.default_rng(seed).standard_normal((p, n))


def outcome(fn):
    """Run ``fn(t)`` and return "ok" or the gradcomm error class name (on every rank)."""
    def body(t):
        try:
            fn(t)
            return "ok"
        except GradcommError as exc:
            return type(exc).__name__
    return body


# -- one round is W·X ---------------------------------------------------------------------

MIX_CASES = [(name, p) for name in T.NAMES for p in (1, 2, 3, 4, 5, 6, 8, 9) if fits(name, p)]


@pytest.mark.parametrize("name,p", MIX_CASES)
def test_one_round_equals_w_times_x(name, p):
    x = inputs(p, 37)
    steps = range(T.get(name, p).period + 1)

    def fn(t):
        return [gossip_average(x[t.rank], t, topology=name, step=s) for s in steps]

    got = run(p, fn)
    for s in steps:
        want = ref_matrix(name, p, s) @ x
        for r in range(p):
            np.testing.assert_allclose(got[r][s], want[r], rtol=0, atol=1e-14)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("p", [3, 4, 5])
def test_exact_with_dyadic_weights_every_dtype(dtype, p):
    # ring weights 1/2 self, 1/4 each neighbour; small-integer multiples of 1/4 are exact
    w = np.zeros((p, p))
    for i in range(p):
        w[i, i] = 0.5
        w[i, (i - 1) % p] += 0.25
        w[i, (i + 1) % p] += 0.25
    vals = (np.arange(p * 11).reshape(p, 11) * 7 % 17 - 8).astype(np.float64)
    want = w @ vals

    def store(v):
        return f32_to_bf16(v.astype(np.float32)) if dtype == "bfloat16" else v.astype(dtype)

    def array(v):      # bfloat16 exists as a torch dtype only
        if dtype != "bfloat16":
            return store(v)
        import torch
        return torch.from_numpy(v.astype(np.float32)).to(torch.bfloat16)

    def bits(y):
        if dtype != "bfloat16":
            return y.tobytes()
        import torch
        return y.view(torch.int16).numpy().tobytes()

    got = run(p, lambda t: gossip_average(array(vals[t.rank]), t, weights=w))
    for r in range(p):
        assert bits(got[r]) == store(want[r]).tobytes(), (r, got[r], want[r])


def test_complete_gives_identical_bytes_on_every_rank():
    x = inputs(5, 101, seed=3).astype(np.float32)
    got = run(5, lambda t: gossip_average(x[t.rank], t, topology="complete"))
    assert all(g.tobytes() == got[0].tobytes() for g in got)
    np.testing.assert_allclose(got[0], x.mean(axis=0), atol=1e-6)


@pytest.mark.parametrize("p", [2, 4, 8])
def test_exponential_averages_exactly_in_log2_p_rounds(p):
    x = (np.arange(p * 9).reshape(p, 9) * 5 % 11).astype(np.float32)

    def fn(t):
        v = x[t.rank]
        for s in range(p.bit_length() - 1):
            v = gossip_average(v, t, topology="exponential", step=s)
        return v

    got = run(p, fn)
    for g in got:
        assert g.tobytes() == x.mean(axis=0, dtype=np.float64).astype(np.float32).tobytes()


def test_user_defined_topology_instance():
    class Star(T.Topology):
        name = "star"

        def recv_from(self, rank, step=0):
            return tuple(range(1, self.size)) if rank == 0 else (0,)

    x = inputs(5, 7)
    topo = Star(5)
    got = run(5, lambda t: gossip_average(x[t.rank], t, topology=Star(5)))
    np.testing.assert_allclose(np.stack(got), topo.matrix() @ x, atol=1e-15)


# -- conservation and contraction --------------------------------------------------------

@pytest.mark.parametrize("name,p", [("ring", 5), ("torus", 6), ("exponential", 7),
                                    ("complete", 4), ("ring", 2)])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_global_average_preserved(name, p, dtype):
    x = inputs(p, 64, seed=1).astype(dtype)

    def fn(t):
        v = x[t.rank]
        for s in range(6):
            v = gossip_average(v, t, topology=name, step=s)
        return v

    got = np.stack(run(p, fn))
    tol = 1e-5 if dtype == "float32" else 1e-13
    np.testing.assert_allclose(got.mean(axis=0), x.astype(np.float64).mean(axis=0),
                               atol=tol)


def distance(stack):
    return float(np.mean(np.sum((stack - stack.mean(axis=0)) ** 2, axis=1)))


@pytest.mark.parametrize("name,p", [("ring", 4), ("ring", 7), ("torus", 9), ("torus", 8),
                                    ("exponential", 5), ("exponential", 8),
                                    ("exponential", 6), ("complete", 6)])
def test_consensus_distance_contracts_at_least_as_spectral_gap_predicts(name, p):
    topo = T.get(name, p)
    rounds = 4 * topo.period
    x = inputs(p, 200, seed=2)

    def fn(t):
        hist, v = [x[t.rank]], x[t.rank]
        for s in range(rounds):
            v = gossip_average(v, t, topology=name, step=s)
            hist.append(v)
        return hist

    hist = run(p, fn)
    dist = [distance(np.stack([hist[r][k] for r in range(p)])) for k in range(rounds + 1)]
    per = topo.period
    factor = T.spectral_factor([topo.matrix(s) for s in range(per)])
    for k in range(0, rounds - per + 1, per):      # over each period (one round if static)
        assert dist[k + per] <= factor * dist[k] * (1 + 1e-9) + 1e-28, (k, dist, factor)
    assert dist[-1] < dist[0]


def test_consensus_distance_helper_matches():
    x = inputs(4, 10)
    got = run(4, lambda t: consensus_distance(x[t.rank], t))
    assert got == [got[0]] * 4
    assert got[0] == pytest.approx(distance(x), rel=1e-12)


# -- traffic per round -------------------------------------------------------------------

@pytest.mark.parametrize("name,p,degree", [("ring", 5, 2), ("ring", 2, 1), ("torus", 9, 4),
                                           ("torus", 6, 3), ("exponential", 8, 1),
                                           ("exponential", 2, 1), ("complete", 5, 4),
                                           ("ring", 1, 0)])
def test_bytes_and_messages_per_round_match_topology(name, p, degree):
    n = 1000

    def fn(t):
        x = np.ones(n, np.float32)
        t.stats.reset()
        gossip_average(x, t, topology=name, step=3, check=False)
        return t.stats.snapshot()

    for s in run(p, fn):
        assert s == {"bytes_sent": degree * 4 * n, "messages_sent": degree,
                     "bytes_received": degree * 4 * n, "messages_received": degree}


def test_check_costs_only_the_small_agreement_exchange():
    def fn(t):
        x = np.ones(1000, np.float64)
        t.stats.reset()
        gossip_average(x, t, check=True)
        return t.stats.snapshot()

    for s in run(4, fn):    # agreement: recursive doubling, 2 rounds of 2 x 16 int64s
        assert s["messages_sent"] == 2 + 2
        assert s["bytes_sent"] == 2 * 8000 + 2 * 2 * NATIVE_FIELDS * 8


def test_custom_weights_send_only_where_nonzero():
    w = [[0.5, 0.5, 0.0], [0.0, 0.5, 0.5], [0.5, 0.0, 0.5]]   # rank i receives from i+1

    def fn(t):
        t.stats.reset()
        gossip_average(np.ones(10), t, weights=w, check=False)
        return t.stats.messages_sent, t.stats.messages_received

    assert run(3, fn) == [(1, 1)] * 3


# -- arrays, dtypes, shapes --------------------------------------------------------------

def test_one_rank_returns_a_copy():
    x = np.arange(6.0).reshape(2, 3)
    y = run(1, lambda t: gossip_average(x, t, topology="torus"))[0]
    assert y is not x and y.shape == (2, 3)
    np.testing.assert_array_equal(y, x)
    y[0, 0] = 99
    assert x[0, 0] == 0


@pytest.mark.parametrize("count", [0, 1, 3, 4, 7])
def test_counts_and_shapes(count):
    x = inputs(4, count)

    def fn(t):
        v = x[t.rank].reshape(1, count)
        out = gossip_average(v, t, topology="exponential", step=1)
        assert v.tobytes() == x[t.rank].tobytes()        # input untouched
        return out

    got = run(4, fn)
    want = ref_matrix("exponential", 4, 1) @ x
    for r in range(4):
        assert got[r].shape == (1, count)
        np.testing.assert_allclose(got[r].reshape(-1), want[r], atol=1e-15)


def test_read_only_and_requires_grad_inputs():
    torch = pytest.importorskip("torch")
    x = inputs(3, 6)

    def fn(t):
        ro = x[t.rank].copy()
        ro.flags.writeable = False
        a = gossip_average(ro, t)
        tt = torch.tensor(x[t.rank], requires_grad=True)
        b = gossip_average(tt, t)
        assert not b.requires_grad and tt.detach().numpy().tobytes() == x[t.rank].tobytes()
        return a, b.numpy()

    want = ref_matrix("ring", 3, 0) @ x
    for r, (a, b) in enumerate(run(3, fn)):
        np.testing.assert_allclose(a, want[r], atol=1e-15)
        np.testing.assert_allclose(b, want[r], atol=1e-15)


def test_non_contiguous_input():
    base = inputs(3, 20)
    got = run(3, lambda t: gossip_average(base[t.rank][::2], t))
    want = ref_matrix("ring", 3, 0) @ base[:, ::2]
    np.testing.assert_allclose(np.stack(got), want, atol=1e-15)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "float64"])
def test_torch_tensors(dtype):
    torch = pytest.importorskip("torch")
    x = inputs(4, 9)
    tdt = getattr(torch, dtype)

    def fn(t):
        v = torch.tensor(x[t.rank], dtype=tdt).reshape(3, 3)
        return gossip_average(v, t, topology="ring")

    got = run(4, fn)
    want = ref_matrix("ring", 4, 0) @ x
    for r in range(4):
        assert isinstance(got[r], torch.Tensor) and got[r].dtype == tdt
        assert got[r].shape == (3, 3)
        tol = {"float64": 1e-14, "float32": 1e-6, "float16": 2e-3, "bfloat16": 2e-2}[dtype]
        np.testing.assert_allclose(got[r].double().reshape(-1).numpy(), want[r], atol=tol * 4)


def test_sixteen_bit_rounds_once():
    # float16 inputs, accumulated in float32: the result is one rounding of the mean
    x = inputs(3, 50, seed=5).astype(np.float16)
    got = run(3, lambda t: gossip_average(x[t.rank], t, topology="complete"))
    acc = x[0].astype(np.float32) + x[1].astype(np.float32)   # equal weights: sum, then
    acc = (acc + x[2].astype(np.float32)) * np.float32(1 / 3)  # scale once
    for r in range(3):
        assert got[r].dtype == np.float16
        assert got[r].tobytes() == acc.astype(np.float16).tobytes()


def test_lazy_top_level_name():
    assert gradcomm.gossip_average is gossip_average


# -- bad input: clear errors on every rank, no hang ---------------------------------------

@pytest.mark.parametrize("dtype", ["int32", "int64", "uint8", "bool"])
def test_integer_arrays_rejected(dtype):
    got = run(3, outcome(lambda t: gossip_average(np.ones(4, dtype), t)))
    assert got == ["ConfigError"] * 3
    with pytest.raises(ConfigError, match="needs a floating dtype.*got int32"):
        run(2, lambda t: gossip_average(np.ones(4, np.int32), t))


@pytest.mark.parametrize("p", [2, 3, 5, 7])
def test_torus_that_does_not_fit(p):
    got = run(p, outcome(lambda t: gossip_average(np.ones(4), t, topology="torus")))
    assert got == ["ConfigError"] * p
    with pytest.raises(ConfigError, match=f"{p} ranks do not fit"):
        run(p, lambda t: gossip_average(np.ones(4), t, topology="torus"))


def test_weights_that_do_not_sum_to_one():
    w = np.full((4, 4), 0.2)
    got = run(4, outcome(lambda t: gossip_average(np.ones(3), t, topology="complete",
                                                  weights=w)))
    assert got == ["ConfigError"] * 4
    with pytest.raises(ConfigError, match="row 0 sums to 0.8, not 1"):
        run(4, lambda t: gossip_average(np.ones(3), t, topology="complete", weights=w))


def test_weights_off_the_topology():
    w = np.full((4, 4), 0.25)           # complete weights on a ring
    with pytest.raises(ConfigError, match="ring has no edge"):
        run(4, lambda t: gossip_average(np.ones(3), t, topology="ring", weights=w))


@pytest.mark.parametrize("field", ["step", "topology", "count", "dtype", "weights"])
def test_ranks_disagreeing_raise_mismatch_on_every_rank(field):
    def fn(t):
        odd = t.rank == 2
        kw = {"step": 0, "topology": "ring", "weights": None}
        x = np.ones(5)
        if odd and field == "step":
            kw["step"] = 1
        if odd and field == "topology":
            kw["topology"] = "complete"
        if odd and field == "count":
            x = np.ones(6)
        if odd and field == "dtype":
            x = np.ones(5, np.float32)
        if field == "weights":
            w = T.get("ring", 4).matrix()
            if odd:
                w = w.copy()
                w[0, 0], w[0, 1] = w[0, 1] * 2, 0.0
            kw["weights"] = w
        gossip_average(x, t, **kw)

    got = run(4, outcome(fn), timeout=20)
    assert got == ["MismatchError"] * 4
    with pytest.raises(MismatchError, match=f"{field} "):
        run(4, fn, timeout=20)


def test_bad_step_values():
    for bad in (-1, 1.5, True, "0"):
        got = run(2, outcome(lambda t: gossip_average(np.ones(2), t, step=bad)))
        assert got == ["ConfigError"] * 2, bad
    # one rank with a bad step: it gets ConfigError, the other is told of the mismatch
    got = run(2, outcome(lambda t: gossip_average(np.ones(2), t, step=-1 if t.rank else 0)))
    assert got == ["MismatchError", "MismatchError"]


def test_unknown_topology():
    with pytest.raises(ConfigError, match="unknown topology 'star'"):
        run(3, lambda t: gossip_average(np.ones(2), t, topology="star"))


# -- Gossip (stateful) --------------------------------------------------------------------

@pytest.mark.parametrize("name", ["ring", "exponential", "torus"])
def test_gossip_object_equals_function_and_counts_steps(name):
    x = inputs(6, 33)

    def fn(t):
        g = Gossip(t, topology=name)
        a = b = x[t.rank]
        for s in range(5):
            a = g(a)
            b = gossip_average(b, t, topology=name, step=s)
            assert a.tobytes() == b.tobytes()
        return g.step

    assert run(6, fn) == [5] * 6


def test_object_and_function_mix_and_compression_mismatch_is_caught():
    x = inputs(3, 5)

    def fn(t):
        if t.rank == 0:
            return Gossip(t)(x[0])
        return gossip_average(x[t.rank], t)

    np.testing.assert_allclose(np.stack(run(3, fn)), ref_matrix("ring", 3, 0) @ x, atol=1e-15)

    def bad(t):
        if t.rank == 0:
            return Gossip(t, compressor="none")(x[0])
        return gossip_average(x[t.rank], t)

    assert run(3, outcome(bad)) == ["MismatchError"] * 3


def test_gossip_callable_weights_change_per_step():
    p = 4

    def weights(step):
        w = np.eye(p) * 0.5
        for i in range(p):
            w[i, (i + (1 if step % 2 else -1)) % p] += 0.5
        return w

    x = inputs(p, 8)
    got = run(p, lambda t: [Gossip(t, weights=weights)(x[t.rank], s) for s in range(3)])
    for s in range(3):
        want = weights(s) @ x
        np.testing.assert_allclose(np.stack([g[s] for g in got]), want, atol=1e-15)


def test_choco_with_lossless_codec_equals_dense_gossip():
    x = inputs(5, 40, seed=4)

    def fn(t):
        g = Gossip(t, topology="ring", compressor="none")
        v = w = x[t.rank]
        for s in range(4):
            v = g(v)
            w = gossip_average(w, t, step=s)
        return v, w

    for v, w in run(5, fn):
        np.testing.assert_allclose(v, w, atol=1e-13)


def lossy_codecs():
    names = gradcomm.compressors.names()
    out = []
    for name, opts in [("fp16", {}), ("int8", {}), ("qsgd", {"bits": 4}),
                       ("topk", {"ratio": 0.25}), ("randomk", {"ratio": 0.25})]:
        if name in names:
            out.append((name, opts))
    return out


@pytest.mark.parametrize("codec,opts", lossy_codecs() or [("none", {})])
def test_choco_compressed_gossip_converges_and_preserves_the_sum(codec, opts):
    p, n = 6, 64
    x = inputs(p, n, seed=6)
    gamma = 0.1 if codec in ("topk", "randomk") else 0.4

    def fn(t):
        g = Gossip(t, topology="ring", compressor=codec, gamma=gamma, **opts)
        v = x[t.rank]
        t.stats.reset()
        for _ in range(150):
            v = g(v)
        return v

    got = np.stack(run(p, fn, timeout=60))
    np.testing.assert_allclose(got.mean(axis=0), x.mean(axis=0), atol=1e-10)
    assert distance(got) < 1e-3 * distance(x), (codec, distance(got), distance(x))


class _TopK(Compressor):
    """A small real top-k codec (indices + values), so that the lossy CHOCO path is tested
    whatever the registry holds."""

    name = "test_topk"

    def __init__(self, ratio):
        self.ratio = ratio

    def compress(self, x, *, seed=None):
        k = max(1, int(self.ratio * x.size))
        idx = np.sort(np.argpartition(np.abs(x), -k)[-k:]).astype(np.int64)
        return Payload(self.name, {"n": int(x.size)}, {"i": idx, "v": x[idx].copy()})

    def decompress(self, payload, out=None):
        y = np.zeros(payload.header["n"], payload.buffers["v"].dtype)
        y[payload.buffers["i"]] = payload.buffers["v"]
        return y


@pytest.mark.parametrize("ratio,gamma,rounds", [(0.25, 0.4, 100), (0.05, 0.1, 150)])
def test_choco_with_a_lossy_codec_instance(ratio, gamma, rounds):
    p, n = 6, 64
    x = inputs(p, n, seed=8)

    def fn(t):
        g = Gossip(t, topology="ring", compressor=_TopK(ratio), gamma=gamma, check=False)
        v = x[t.rank]
        t.stats.reset()
        for _ in range(rounds):
            v = g(v)
        return v, t.stats.bytes_sent / rounds

    got = run(p, fn)
    final = np.stack([v for v, _ in got])
    np.testing.assert_allclose(final.mean(axis=0), x.mean(axis=0), atol=1e-12)
    assert distance(final) < 1e-4 * distance(x)
    nbytes = _TopK(ratio).compress(np.zeros(n)).nbytes       # k indices + k values
    assert nbytes < 8 * n * 2 * ratio + 100
    assert all(b == 2 * (8 + nbytes) for _, b in got)      # 2 neighbours: size + payload


def test_choco_unbiased_high_variance_codec_needs_scale():
    """QSGD with few levels on a long vector is not contractive (ω = √n/s ≈ 9 here): the
    estimates diverge at scale 1 and converge with the CHOCO rescaling 1/(1+ω)."""
    if "qsgd" not in gradcomm.compressors.names():
        pytest.skip("qsgd codec not installed")
    p, n = 4, 4096
    x = inputs(p, n, seed=9)

    def fn(t, scale):
        g = Gossip(t, topology="ring", compressor="qsgd", bits=4, gamma=0.3, scale=scale,
                   check=False)
        v = x[t.rank]
        for _ in range(40):
            v = g(v)
        return v

    bad = np.stack(run(p, lambda t: fn(t, 1.0)))
    good = np.stack(run(p, lambda t: fn(t, 0.1)))
    assert distance(bad) > distance(x)
    assert distance(good) < 5e-2 * distance(x)
    np.testing.assert_allclose(good.mean(axis=0), x.mean(axis=0), atol=1e-10)


def test_choco_needs_a_static_topology():
    with pytest.raises(UnsupportedError, match="static topology"):
        run(4, lambda t: Gossip(t, topology="exponential", compressor="none"))


def test_choco_bytes_per_round():
    n = 100

    def fn(t):
        g = Gossip(t, topology="ring", compressor="none", check=False)
        t.stats.reset()
        g(np.ones(n, np.float32))
        return t.stats.snapshot()

    from gradcomm.compressors import get
    payload = get("none").compress(np.ones(n, np.float32)).nbytes
    for s in run(4, fn):       # per neighbour: an 8-byte size, then the payload
        assert s["messages_sent"] == 4
        assert s["bytes_sent"] == 2 * (8 + payload)


def test_choco_state_roundtrip_continues_identically():
    p, n = 4, 30
    x = inputs(p, n, seed=7)

    def fn(t):
        a = Gossip(t, topology="ring", compressor="none", gamma=0.5)
        v = x[t.rank]
        for _ in range(3):
            v = a(v)
        sd = a.state_dict()
        b = Gossip(t, topology="ring", compressor="none", gamma=0.5)
        b.load_state_dict(sd)
        assert b.step == 3
        va, vb = a(v), b(v)
        assert va.tobytes() == vb.tobytes()
        return sd

    sd = run(p, fn)[1]
    assert sd["step"] == 3 and set(sd["peer_estimates"]) == {0, 2}
    assert sd["compressor"] == {"name": "none", "config": {}}


def test_state_of_another_rank_or_topology_is_rejected():
    def fn(t):
        sd = Gossip(t, topology="ring").state_dict()
        other = run_ranks(1, lambda u: Gossip(u).state_dict())[0]
        with pytest.raises(ConfigError, match="rank 0/1"):
            Gossip(t, topology="ring").load_state_dict(other)
        with pytest.raises(ConfigError, match="topology ring"):
            Gossip(t, topology="complete").load_state_dict(sd)
        with pytest.raises(ConfigError, match="compressor"):
            Gossip(t, topology="ring", compressor="none").load_state_dict(sd)
        with pytest.raises(ConfigError, match="missing"):
            Gossip(t).load_state_dict({})

    run(3, fn)


def test_choco_count_change_is_an_error():
    def fn(t):
        g = Gossip(t, compressor="none")
        g(np.ones(4))
        g(np.ones(5))

    assert run(3, outcome(fn)) == ["ConfigError"] * 3


def test_choco_rejects_oversized_announcement_from_a_peer():
    def fn(t):
        if t.rank == 0:
            g = Gossip(t, topology="ring", compressor="none", check=False)
            with pytest.raises(TransportError, match="announced a gossip payload of 1099511627776"):
                g(np.ones(10))
            return "rejected"
        sink = np.empty(1, np.int64)       # a hostile peer: claims a 1 TiB payload
        t.sendrecv(np.array([1 << 40], np.int64), 0, sink, 0, TAG_GOSSIP)
        return int(sink[0])

    got = run(2, fn)
    assert got[0] == "rejected" and got[1] > 0      # rank 1 got rank 0's honest size


def test_choco_decodes_a_peer_payload_into_the_count_it_expects():
    """A hostile peer sends a small topk payload claiming 2**28 float64 values: the
    receiver decodes into its n = 10 and refuses it (PayloadError) without allocating."""
    import tracemalloc

    from gradcomm.compressors import get
    from gradcomm.compressors.base import Payload
    from gradcomm.errors import PayloadError

    def fn(t):
        if t.rank == 0:
            g = Gossip(t, topology="ring", compressor="topk", k=2, check=False)
            tracemalloc.start()
            try:
                with pytest.raises(PayloadError, match="decodes to float64"):
                    g(np.ones(10))
                return tracemalloc.get_traced_memory()[1]
            finally:
                tracemalloc.stop()
        good = get("topk", k=1).compress(np.ones(10, np.float64))   # fits the size bound
        data = Payload("topk", {**good.header, "n": 1 << 28}, dict(good.buffers)).to_bytes()
        sink = np.empty(1, np.int64)
        t.sendrecv(np.array([data.size], np.int64), 0, sink, 0, TAG_GOSSIP)
        t.sendrecv(data, 0, np.empty(int(sink[0]), np.uint8), 0, TAG_GOSSIP)
        return "sent"

    peak, sent = run(2, fn)
    assert sent == "sent" and peak < 1 << 20, peak


def test_gossip_rejects_bad_gamma_and_options():
    with pytest.raises(ConfigError, match="gamma"):
        run(2, lambda t: Gossip(t, compressor="none", gamma=0))
    with pytest.raises(ConfigError, match="scale"):
        run(2, lambda t: Gossip(t, compressor="none", scale=1.5))
    with pytest.raises(ConfigError, match="unknown options"):
        run(2, lambda t: Gossip(t, ratio=0.1))
