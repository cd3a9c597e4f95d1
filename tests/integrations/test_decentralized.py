"""DecentralizedSGD: parameter mixing, state, and digits training vs allreduce."""

from __future__ import annotations

import io
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import gradcomm  # noqa: E402
from gradcomm.collectives import topologies as T  # noqa: E402
from gradcomm.comm import run_ranks  # noqa: E402
from gradcomm.errors import ConfigError, MismatchError  # noqa: E402
from gradcomm.integrations.decentralized import DecentralizedSGD  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
from gossip_train import train  # noqa: E402

pytestmark = pytest.mark.timeout(90)


@pytest.fixture(autouse=True)
def one_torch_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def model_for(rank, dtype=torch.float32):
    m = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    with torch.no_grad():
        for i, p in enumerate(m.parameters()):
            p.copy_(torch.arange(p.numel(), dtype=torch.float64).reshape(p.shape) * (rank + 1)
                    + i)
    return m.to(dtype)


def flat_params(model):
    return torch.cat([p.detach().double().reshape(-1) for p in model.parameters()]).numpy()


@pytest.mark.parametrize("topology", ["ring", "exponential", "torus"])
def test_step_mixes_parameters_like_w_times_theta(topology):
    p = 6

    def fn(t):
        m = model_for(t.rank, torch.float64)
        before = flat_params(m)
        opt = DecentralizedSGD(torch.optim.SGD(m.parameters(), lr=0.0), t, topology=topology)
        out = [before]
        for _ in range(3):
            opt.step()
            out.append(flat_params(m))
        return out

    got = run_ranks(p, fn, timeout=30)
    topo = T.get(topology, p)
    theta = np.stack([g[0] for g in got])
    for s in range(3):
        theta = topo.matrix(s) @ theta
        np.testing.assert_allclose(np.stack([g[s + 1] for g in got]), theta, atol=1e-12)


def test_one_flat_buffer_per_dtype_and_messages_per_round():
    def fn(t):
        m = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2).double())
        opt = DecentralizedSGD(torch.optim.SGD(m.parameters(), lr=0.0), t, topology="ring",
                               check=False)
        t.stats.reset()
        opt.step()
        return t.stats.snapshot()

    for s in run_ranks(4, fn, timeout=30):     # 2 neighbours x 2 dtype groups
        assert s["messages_sent"] == 4
        assert s["bytes_sent"] == 2 * (16 * 4) + 2 * (10 * 8)


def test_every_and_check_first():
    def fn(t):
        m = model_for(t.rank)
        opt = DecentralizedSGD(torch.optim.SGD(m.parameters(), lr=0.0), t, every=2)
        counts = []
        for _ in range(4):
            t.stats.reset()
            opt.step()
            counts.append(t.stats.messages_sent)
        return counts

    # step 2: agreement (2 rounds at p=4) + 2 neighbours; step 4: 2 neighbours only
    assert run_ranks(4, fn, timeout=30) == [[0, 4, 0, 2]] * 4


def test_first_round_detects_ranks_with_different_models():
    def fn(t):
        m = torch.nn.Linear(3, 2 if t.rank else 3)
        DecentralizedSGD(torch.optim.SGD(m.parameters(), lr=0.1), t).step()

    with pytest.raises(MismatchError, match="count"):
        run_ranks(3, fn, timeout=20)


def test_state_dict_roundtrip_through_torch_save_with_choco_state():
    p = 4

    def fn(t):
        torch.manual_seed(t.rank)
        m = torch.nn.Linear(5, 3)
        kw = dict(topology="ring", compressor="none", gamma=0.5)
        opt = DecentralizedSGD(torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), t, **kw)
        x = torch.randn(8, 5, generator=torch.Generator().manual_seed(t.rank))

        def step(model, o):
            o.zero_grad()
            model(x).square().mean().backward()
            o.step()

        for _ in range(3):
            step(m, opt)
        buf = io.BytesIO()
        torch.save({"model": m.state_dict(), "opt": opt.state_dict()}, buf)
        buf.seek(0)
        ck = torch.load(buf, weights_only=True)
        m2 = torch.nn.Linear(5, 3)
        m2.load_state_dict(ck["model"])
        opt2 = DecentralizedSGD(torch.optim.SGD(m2.parameters(), lr=0.1, momentum=0.9), t, **kw)
        opt2.load_state_dict(ck["opt"])
        assert opt2.steps == 3
        step(m, opt)
        step(m2, opt2)
        return flat_params(m).tobytes() == flat_params(m2).tobytes()

    assert run_ranks(p, fn, timeout=30) == [True] * p


def test_state_dict_rejects_other_groups():
    def fn(t):
        a = DecentralizedSGD(torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1), t)
        b = DecentralizedSGD(torch.optim.SGD(torch.nn.Linear(2, 2).double().parameters(),
                                             lr=0.1), t)
        with pytest.raises(ConfigError, match="parameter groups"):
            b.load_state_dict(a.state_dict())
        with pytest.raises(ConfigError, match="missing"):
            b.load_state_dict({})

    run_ranks(2, fn, timeout=20)


def test_bad_arguments():
    def fn(t):
        params = torch.nn.Linear(2, 2).parameters()
        with pytest.raises(ConfigError, match="every"):
            DecentralizedSGD(torch.optim.SGD(params, lr=0.1), t, every=0)
        with pytest.raises(ConfigError, match="torus"):
            DecentralizedSGD(torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1), t,
                             topology="torus")

    run_ranks(3, fn, timeout=20)


def test_average_parameters_and_consensus_distance():
    def fn(t):
        m = model_for(t.rank, torch.float64)
        opt = DecentralizedSGD(torch.optim.SGD(m.parameters(), lr=0.1), t)
        d = opt.consensus_distance()
        opt.average_parameters()
        return flat_params(m), d, opt.consensus_distance()

    got = run_ranks(3, fn, timeout=20)
    theta = np.stack([flat_params(model_for(r, torch.float64)) for r in range(3)])
    want_d = np.mean(np.sum((theta - theta.mean(0)) ** 2, axis=1))
    for avg, d, d_after in got:
        np.testing.assert_allclose(avg, theta.mean(0), atol=1e-12)
        assert d == pytest.approx(want_d, rel=1e-12)
        assert d_after == 0.0


# -- training on digits (4 ranks) ------------------------------------------------------------

def _train(**kw):
    return run_ranks(4, lambda t: train(t, epochs=6, **kw), timeout=80)


@pytest.fixture(scope="module")
def allreduce_run():
    return _train(mode="allreduce")


@pytest.mark.parametrize("topology", ["ring", "exponential"])
def test_digits_decentralized_close_to_allreduce(allreduce_run, topology):
    ref = allreduce_run[0]["accuracy"]
    assert all(r["accuracy"] == ref for r in allreduce_run)    # one model everywhere
    assert ref > 0.9
    got = _train(mode="gossip", topology=topology)
    avg_acc = got[0]["accuracy"]
    assert all(r["accuracy"] == avg_acc for r in got)
    assert avg_acc >= ref - 0.03, (avg_acc, ref)
    assert min(r["local_accuracy"] for r in got) >= ref - 0.05
    norm = np.mean([r["param_norm_sq"] for r in got])
    rel = got[0]["consensus"] / norm
    assert rel < 1e-2, rel
    print(f"\n[digits, 4 ranks] allreduce acc {ref:.4f} | gossip {topology}: averaged acc "
          f"{avg_acc:.4f}, local acc {[round(r['local_accuracy'], 4) for r in got]}, "
          f"consensus {got[0]['consensus']:.3g} (relative {rel:.2e})")


@pytest.mark.parametrize("codec,gamma,opts", [("int8", 0.5, {}), ("topk", 0.2, {"ratio": 0.1})])
def test_digits_compressed_gossip(allreduce_run, codec, gamma, opts):
    if codec not in gradcomm.compressors.names():
        pytest.skip(f"codec {codec} not installed")
    ref = allreduce_run[0]["accuracy"]
    got = _train(mode="gossip", topology="ring", compressor=codec, gamma=gamma, **opts)
    avg_acc = got[0]["accuracy"]
    rel = got[0]["consensus"] / np.mean([r["param_norm_sq"] for r in got])
    assert avg_acc >= ref - 0.03, (codec, avg_acc, ref)
    assert rel < 5e-3, rel
    print(f"\n[digits, 4 ranks] CHOCO gossip ring {codec} {opts} gamma={gamma}: averaged acc "
          f"{avg_acc:.4f}, local acc {[round(r['local_accuracy'], 4) for r in got]}, "
          f"consensus {got[0]['consensus']:.3g} (relative {rel:.2e})")


# -- real launchers ---------------------------------------------------------------------------

SCRIPTS = Path(__file__).parent / "scripts"


def _same_training(got, ref):
    for g, r in zip(got, ref):
        assert g["accuracy"] == r["accuracy"] and g["local_accuracy"] == r["local_accuracy"]
        assert g["consensus"] == pytest.approx(r["consensus"], rel=1e-9)


@pytest.mark.timeout(150)
def test_gossip_and_training_under_mpirun():
    """Checks of one round on MPI, then digits training with comm=None (MPI.COMM_WORLD)
    giving the same numbers as the in-process run."""
    from tests._launch import mpirun, require_mpi

    require_mpi()
    got = mpirun(SCRIPTS / "gossip_check.py", 4, "--train-epochs", "1", "--train-steps",
                 "5", timeout=100).results(4)
    for r in got:
        assert r["transport"] == "mpi" and r["errors"] == [], r
        assert r["mismatch"] == "MismatchError"
        assert r["choco_max_diff"] < 1e-12
    _same_training([r["train"] for r in got],
                   run_ranks(4, lambda t: train(t, epochs=1, max_steps=5), timeout=60))


@pytest.mark.timeout(150)
def test_gossip_and_training_under_torchrun_gloo():
    """The same with torch.distributed (gloo): comm=None picks the default group."""
    from tests._launch import require_torch, torchrun

    require_torch()
    got = torchrun(SCRIPTS / "gossip_check.py", 3, "--launcher", "torch", "--train-epochs",
                   "1", "--train-steps", "5", "--topology", "exponential",
                   timeout=100).results(3)
    for r in got:
        assert r["transport"] == "torch" and r["errors"] == [], r
        assert r["mismatch"] == "MismatchError"
        assert r["choco_max_diff"] < 1e-12
    _same_training([r["train"] for r in got],
                   run_ranks(3, lambda t: train(t, epochs=1, max_steps=5,
                                                topology="exponential"), timeout=60))
