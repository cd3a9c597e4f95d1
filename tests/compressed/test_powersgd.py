"""PowerSGD allreduce: identical bytes, exact low-rank recovery, warm start, error feedback,
bitwise resume, wire bytes, cross-rank checks, the DDP hook next to PyTorch's PowerSGD hook.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import gradcomm
from gradcomm.collectives import dense_allreduce
from gradcomm.collectives._check import agree
from gradcomm.compressed import POWERSGD_ALGORITHMS as ALGORITHMS
from gradcomm.compressed import compressed_allreduce
from gradcomm.compressed.powersgd import parts_of, wire_values
from gradcomm.comm import run_ranks
from gradcomm.compressors.powersgd import PowerSGD
from gradcomm.error_feedback import ErrorFeedback
from gradcomm.errors import ConfigError, MismatchError, UnknownOptionError, UnsupportedError
from tests._cases import refused_on_every_rank, torch_roundtrip
from tests._launch import have_torch, torch_call

pytestmark = pytest.mark.timeout(60)


def _same(values: list[Any]) -> None:
    for r, v in enumerate(values):
        assert v == values[0], f"rank {r} differs from rank 0"


def _grad(rank: int, step: int, shape: tuple[int, ...] = (24, 40)) -> np.ndarray:
    return np.random.default_rng(1000 * step + rank).standard_normal(shape).astype(np.float32)


# -- identical bytes ----------------------------------------------------------------------
@pytest.mark.parametrize("p", [1, 2, 3, 4, 5])
def test_identical_bytes_on_every_algorithm(p: int) -> None:
    def fn(t):
        out = []
        for algorithm in ALGORITHMS:
            ar = gradcomm.Allreduce(t, algorithm=algorithm, compressor="powersgd", rank=2)
            ys = [ar(_grad(t.rank, s), key="w") for s in range(3)]       # flat layout
            ys.append(gradcomm.allreduce(_grad(t.rank, 9), t, algorithm=algorithm,
                                         compressor="powersgd", rank=3, shape=(24, 40)))
            out.append(b"".join(y.tobytes() for y in ys))
            assert all(y.shape == (24, 40) and y.dtype == np.float32 for y in ys)
        return out

    res = run_ranks(p, fn)
    _same(res)
    if p == 1:                                       # nothing to compress at one rank
        assert res[0][0][:24 * 40 * 4] == _grad(0, 0).tobytes()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float64"])
def test_narrow_and_wide_dtypes(dtype: str) -> None:
    torch = pytest.importorskip("torch")
    tdt = getattr(torch, dtype)

    def fn(t):
        ar = gradcomm.Allreduce(t, compressor="powersgd", rank=2, op="sum")
        ys = [ar(torch.from_numpy(_grad(t.rank, s)).to(tdt), key="w") for s in range(3)]
        assert all(y.dtype == tdt and y.shape == (24, 40) for y in ys)
        return [y.float().numpy().tobytes() for y in ys], ys[0].float().numpy()

    res = run_ranks(3, fn)
    _same([r[0] for r in res])
    ref = run_ranks(3, lambda t: gradcomm.Allreduce(t, compressor="powersgd", rank=2,
                                                    op="sum")(_grad(t.rank, 0), key="w"))[0]
    tol = 1e-5 if dtype == "float64" else 0.05
    assert np.abs(res[0][1] - ref).max() <= tol * np.abs(ref).max()


# -- what PowerSGD computes ---------------------------------------------------------------
@pytest.mark.parametrize("p", [1, 2, 3, 4, 5])
def test_sums_of_rank_r_matrices_are_recovered_exactly(p: int) -> None:
    """Ranks hold U A_k V^T with shared factors U, V and their own A_k: the sum has rank
    <= r, so P spans U and the output equals the sum (to rounding) at every step, with
    warm starts, through Allreduce (flat 32 x 32 layout) and with an explicit shape."""
    steps = 4

    def fn(t):
        out = []
        for r, (n, m), how in [(1, (32, 32), "flat"), (2, (32, 32), "flat"),
                               (3, (50, 20), "shape"), (2, (7, 90), "shape")]:
            u = np.random.default_rng(1).standard_normal((n, r))
            v = np.random.default_rng(2).standard_normal((m, r))
            ar = gradcomm.Allreduce(t, compressor="powersgd", rank=r, op="sum")
            ef = ErrorFeedback()
            for s in range(steps):
                a = [np.random.default_rng((s, k)).standard_normal((r, r)) for k in range(p)]
                mine = u @ a[t.rank] @ v.T
                exact = u @ sum(a) @ v.T
                if how == "flat":
                    y = ar(mine, key="w")
                    res = ar.error_feedback.residual("w", n * m, np.float64)
                else:
                    y = compressed_allreduce(t, mine.reshape(-1).copy(), "float64", op="sum",
                                             algorithm="auto", compressor="powersgd", rank=r,
                                             residuals=ef, key="w", shape=(n, m))
                    res = ef.residual("w", n * m, np.float64)
                err = np.abs(y.reshape(n, m) - exact).max() / np.abs(exact).max()
                out.append((r, how, s, err, float(np.abs(res).max())))
        return out

    for rows in run_ranks(p, fn):
        for r, how, s, err, resid in rows:
            assert err < 1e-10 and resid < 1e-9 * 100, (r, how, s, err, resid)


def test_warm_start_converges_to_the_best_rank_r_approximation() -> None:
    """On a fixed matrix without error feedback, warm-started steps are power iterations:
    the error falls to the Eckart-Young optimum; restarting from random Q each step
    (warm_start=False) stays above it."""
    p, r, n, m = 3, 2, 60, 40
    rng = np.random.default_rng(3)
    left_, _ = np.linalg.qr(rng.standard_normal((n, m)))
    right_, _ = np.linalg.qr(rng.standard_normal((m, m)))
    sigma = 0.7 ** np.arange(m)
    total = (left_ * sigma) @ right_.T                   # known spectrum
    best = np.sqrt((sigma[r:] ** 2).sum())
    def fn(t, warm):
        share = total * ((t.rank + 1) / (p * (p + 1) / 2))          # the shares sum to total
        ef = ErrorFeedback(enabled=False)
        errs = []
        for _ in range(12):
            y = compressed_allreduce(t, share.reshape(-1).copy(), "float64", op="sum",
                                     algorithm="ring", compressor="powersgd", rank=r,
                                     warm_start=warm, residuals=ef, key="w", shape=(n, m))
            errs.append(np.linalg.norm(y.reshape(n, m) - total) / best)
        return errs

    warm = run_ranks(p, lambda t: fn(t, True))[0]
    cold = run_ranks(p, lambda t: fn(t, False))[0]
    assert warm[-1] < 1.001 and warm[0] > warm[-1], warm
    assert min(cold) > 1.001 and max(cold) > 1.01, cold


@pytest.mark.parametrize("p", [2, 3, 4])
def test_error_feedback_telescopes(p: int) -> None:
    """Σ_t output_t + Σ_ranks e_T = Σ_t Σ_ranks g_t (to float rounding): a rank's residual
    is its matrix minus its own projection, and the projections sum to the output.
    Parts of several shapes, one sent uncompressed."""
    shapes = [(30, 20), (20,), (12, 5, 4)]
    n, T = 600 + 20 + 240, 10

    def fn(t):
        ef = ErrorFeedback()
        outs, ins = [], []
        for s in range(T):
            g = np.random.default_rng((s, t.rank)).standard_normal(n)
            ins.append(g.copy())
            outs.append(compressed_allreduce(t, g, "float64", op="sum", algorithm="ring",
                                             compressor="powersgd", rank=1, residuals=ef,
                                             key="w", shapes=shapes))
        return outs, ins, ef.residual("w", n, np.float64).copy()

    res = run_ranks(p, fn)
    _same([[o.tobytes() for o in r[0]] for r in res])
    total_in = sum(g for r in res for g in r[1])
    resid = sum(r[2] for r in res)
    np.testing.assert_allclose(sum(res[0][0]) + resid, total_in, atol=1e-9)
    assert np.abs(resid[:600]).max() > 0.1                 # compressed: error carried
    assert not resid[600:620].any()                        # the 1-D part went uncompressed


# -- checkpoints --------------------------------------------------------------------------
def _train(t, steps, state=None, **kw):
    ar = gradcomm.Allreduce(t, compressor="powersgd", rank=2, seed=3, **kw)
    if state is not None:
        ar.load_state_dict(state)
    outs = [ar(_grad(t.rank, s), key=k).tobytes() for s in steps for k in ("a", "b")]
    return outs, ar.state_dict()


@pytest.mark.parametrize("kw", [{}, {"error_feedback": False}, {"algorithm": "tree"}])
def test_resume_is_bitwise_equal_to_the_unbroken_run(kw: dict, tmp_path) -> None:
    p, k, T = 3, 3, 6
    unbroken = run_ranks(p, lambda t: _train(t, range(T), **kw)[0])
    first = run_ranks(p, lambda t: _train(t, range(k), **kw))
    states = []
    for r, (_, sd) in enumerate(first):
        assert sd["extra/a#q"].shape == (2 * 40,)       # Q of key a: (24, 40) viewed by shape
        np.savez(tmp_path / f"{r}.npz", **sd)
        with np.load(tmp_path / f"{r}.npz", allow_pickle=False) as data:
            states.append(dict(data))
    rest = run_ranks(p, lambda t: _train(t, range(k, T), states[t.rank], **kw)[0])
    for r in range(p):
        assert first[r][0] + rest[r] == unbroken[r], f"rank {r} diverged after resume"
    cold = [{n: v for n, v in s.items() if not n.startswith("extra/")} for s in states]
    again = run_ranks(p, lambda t: _train(t, range(k, T), cold[t.rank], **kw)[0])
    assert again[0] != rest[0]                             # the warm start is state


def test_resume_through_torch_save_weights_only() -> None:
    pytest.importorskip("torch")
    unbroken = run_ranks(2, lambda t: _train(t, range(4))[0])
    first = run_ranks(2, lambda t: _train(t, range(2)))
    states = [torch_roundtrip(sd) for _, sd in first]
    rest = run_ranks(2, lambda t: _train(t, range(2, 4), states[t.rank])[0])
    assert [f[0] + r for f, r in zip(first, rest)] == unbroken


def test_reset_forgets_the_warm_start() -> None:
    ef = ErrorFeedback()
    run_ranks(1, lambda t: compressed_allreduce(t, np.ones(400), "float64", op="sum",
                                                algorithm="ring", compressor="powersgd",
                                                residuals=ef, key="w"))
    assert list(ef.extra_names()) == []                    # p = 1: nothing compressed
    ef2 = [ErrorFeedback(), ErrorFeedback()]
    run_ranks(2, lambda t: compressed_allreduce(t, np.ones(400), "float64", op="sum",
                                                algorithm="ring", compressor="powersgd",
                                                residuals=ef2[t.rank], key="w"))
    assert list(ef2[0].extra_names()) == ["w#q"]
    ef2[0].reset("w")
    assert list(ef2[0].extra_names()) == []


# -- wire bytes ---------------------------------------------------------------------------
def _agree_bytes(t) -> int:
    before = t.stats.bytes_sent
    agree(t, "compressed allreduce", count=0, dtype="float32", op="sum", algorithm="ring",
          compressor="powersgd", config="", seed=0, step=0, key="", error_feedback=True,
          valid=True)
    return t.stats.bytes_sent - before


@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("algorithm", ["ring", "recursive_doubling", "tree", "allgather"])
def test_wire_bytes_are_two_rounds_of_factors(p: int, algorithm: str) -> None:
    """Bytes sent = a dense allreduce of r·rows values (plus the uncompressed parts) and one
    of r·cols values, with the same algorithm; plus one cross-rank check when checking.
    At p = 2 on a ring that is exactly r(rows + cols) float32 values per rank."""
    shapes, r = [(300, 200), (200,)], 4
    parts = parts_of(60_200, "w", PowerSGD(rank=r), shapes=shapes)
    v1, v2 = wire_values(parts)
    assert (v1, v2) == (200 + r * 300, r * 200)

    def fn(t):
        x = _grad(t.rank, 0, (60_200,))
        sent = []
        for check in (False, True):
            t.stats.reset()
            compressed_allreduce(t, x.copy(), "float32", op="sum", algorithm=algorithm,
                                 compressor="powersgd", rank=r, shapes=shapes, check=check)
            sent.append(t.stats.bytes_sent)
        t.stats.reset()
        if algorithm == "allgather":                     # every rank's block to every rank
            ref = (p - 1) * 4 * (v1 + v2) if p == 2 else None
        else:
            for v in (v1, v2):
                dense_allreduce(t, np.zeros(v, np.float32), "sum", "float32", algorithm,
                                check=False)
            ref = t.stats.bytes_sent
        return sent, ref, _agree_bytes(t)

    for (plain, checked), ref, check_cost in run_ranks(p, fn):
        if ref is not None:
            assert plain == ref
        assert checked == plain + check_cost
        if p == 2 and algorithm == "ring":
            assert plain == 4 * (v1 + v2) == 4 * (200 + r * (300 + 200))
    dense = 4 * 60_200
    assert 4 * (v1 + v2) < dense / 20


# -- refusals and mismatches --------------------------------------------------------------
@pytest.mark.parametrize("diff", ["rank", "shape", "warm", "algorithm", "compressor"])
def test_mismatch_raises_on_every_rank(diff: str) -> None:
    def fn(t):
        odd = t.rank == 1
        ef = ErrorFeedback()
        kw: dict[str, Any] = dict(op="mean", algorithm="ring", compressor="powersgd",
                                  rank=2, shape=(20, 50), residuals=ef, key="w")
        x = _grad(t.rank, 0, (1000,))
        compressed_allreduce(t, x.copy(), "float32", **{**kw, "check": False})
        if diff == "rank" and odd:
            kw["rank"] = 3
        if diff == "shape" and odd:
            kw["shape"] = (50, 20)
        if diff == "warm" and odd:                       # one rank holds another warm start
            ef.set_extra("w#q", ef.extra("w#q") + np.float32(0.5))
        if diff == "algorithm" and odd:
            kw["algorithm"] = "tree"
        if diff == "compressor" and odd:
            kw = {k: v for k, v in kw.items() if k not in ("rank", "shape")}
            kw["compressor"] = "fp16"
        try:
            compressed_allreduce(t, x.copy(), "float32", **kw)
        except MismatchError as exc:
            return str(exc)
        return "no error"

    for msg in run_ranks(3, fn):
        assert "different arguments" in msg, msg


def test_bad_arguments_raise_on_every_rank() -> None:
    cases = [({"op": "max"}, UnsupportedError, "sum, mean"),
             ({"dtype": "int32"}, UnsupportedError, "floating"),
             ({"algorithm": "star"}, ConfigError, "powersgd runs on"),
             ({"rank": 0}, ConfigError, "rank"), ({"colour": 1}, UnknownOptionError, "colour"),
             ({"shape": (7, 7)}, ConfigError, "49 elements, the buffer 120"),
             ({"shapes": [(100,), (2, 2)]}, ConfigError, "104"),
             ({"shape": (12, 10), "shapes": [(120,)]}, ConfigError, "not both"),
             ({"shape": (12, -10)}, ConfigError, "ints >= 0"),
             ({"seed": -1}, ConfigError, "seed")]
    refused_on_every_rank(dict(op="sum", algorithm="ring", compressor="powersgd"), 120, cases)


def test_start_iter_sends_uncompressed_first() -> None:
    """Before start_iter the mean is exact (integer inputs, p = 4: every step exact);
    afterwards it is compressed."""
    p = 4

    def fn(t):
        ar = gradcomm.Allreduce(t, compressor="powersgd", rank=1, start_iter=2)
        xs = [np.round(_grad(t.rank, s) * 8) for s in range(3)]
        return [ar(x, key="w") for x in xs], xs

    res = run_ranks(p, fn)
    exact = [sum(res[r][1][s] for r in range(p)) / p for s in range(3)]
    assert all(np.array_equal(res[0][0][s], exact[s]) for s in range(2))
    assert not np.array_equal(res[0][0][2], exact[2])


def test_empty_and_one_rank() -> None:
    def fn(t):
        ar = gradcomm.Allreduce(t, compressor="powersgd")
        e = ar(np.zeros(0, np.float32), key="e")
        x = _grad(t.rank, 0)
        return e.shape, ar(x, key="w").tobytes() == x.tobytes()

    assert run_ranks(1, fn) == [((0,), True)]
    assert run_ranks(2, fn)[0] == ((0,), False)


# -- the DDP hook's residual store, in-process --------------------------------------------
def test_parts_follow_the_hooks_parameters() -> None:
    """With the DDP hook's residual store (units of named parameters), every parameter is
    its own part: warm starts and residuals are per parameter; shapes the store exposes
    give PyTorch's matrix views."""
    from gradcomm.integrations.ddp.residuals import ParameterResiduals

    names, lengths = ["fc1.weight", "fc1.bias", "fc2.weight"], [64 * 32, 64, 10 * 64]

    def fn(t, shaped):
        res = ParameterResiduals(True)
        if shaped:
            res.shapes = {"fc1.weight": (64, 32), "fc1.bias": (64,), "fc2.weight": (10, 64)}
        x = _grad(t.rank, 0, (sum(lengths),))
        key = res.open(names, lengths, x, 0)
        y = compressed_allreduce(t, x.copy(), "float32", op="sum", algorithm="ring",
                                 compressor=PowerSGD(rank=2), residuals=res.store, key=key)
        parts = parts_of(x.size, key, PowerSGD(rank=2), res.store)
        return (y.tobytes(), sorted(res.extra_names()), sorted(res.names()),
                [(q.name, q.lay) for q in parts])

    for shaped in (False, True):
        out = run_ranks(2, lambda t: fn(t, shaped))
        _same([o[0] for o in out])
        _, extras, resid, parts = out[0]
        assert resid == sorted(names)
        if shaped:
            assert extras == ["fc1.weight#q", "fc2.weight#q"]
            assert [lay for _, lay in parts] == [(64, 32, 2), (64, 1, 0), (10, 64, 2)]
        else:
            assert extras == ["fc1.weight#q", "fc2.weight#q"]      # the bias: too small
            assert [lay for _, lay in parts] == [(45, 46, 2), (8, 8, 0), (25, 26, 2)]


# -- next to PyTorch's PowerSGD hook, on 2 gloo processes ---------------------------------
def ddp_against_torch(steps: int, start: int, rank: int) -> dict[str, Any]:
    """On every gloo rank: the same model under DDP's built-in allreduce (the exact mean),
    PyTorch's powerSGD_hook and gradcomm's hook (parameter shapes exposed, and the flat
    layouts); per-step relative gradient errors; then a few SGD steps with gradcomm's hook."""
    import copy

    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_psgd
    from torch.nn.parallel import DistributedDataParallel as DDP

    from gradcomm.integrations.ddp import make_comm_hook

    torch.manual_seed(0)
    torch.set_num_threads(1)
    base = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.ReLU(),
                               torch.nn.Linear(96, 48), torch.nn.ReLU(), torch.nn.Linear(48, 10))
    me = dist.get_rank()
    models = {"exact": DDP(copy.deepcopy(base)), "torch": DDP(copy.deepcopy(base))}
    ts = torch_psgd.PowerSGDState(process_group=None, matrix_approximation_rank=rank,
                                  start_powerSGD_iter=start, random_seed=0)
    models["torch"].register_comm_hook(ts, torch_psgd.powerSGD_hook)
    states = []
    for label in ("shapes", "flat"):
        m = models[label] = DDP(copy.deepcopy(base))
        state, hook = make_comm_hook("powersgd", rank=rank, start_iter=start, model=m)
        if label == "flat":            # None: the flat layout (the hook records the shapes)
            state.residuals.shapes = dict.fromkeys(n for n, _ in m.module.named_parameters())
        m.register_comm_hook(state, hook)
        states.append(state)
    errs: dict[str, list[float]] = {k: [] for k in models if k != "exact"}
    for s in range(steps):
        g = torch.Generator().manual_seed(1000 * s + me)
        x, y = torch.randn(32, 64, generator=g), torch.randint(0, 10, (32,), generator=g)
        grads = {}
        for k, m in models.items():
            m.zero_grad()
            torch.nn.functional.cross_entropy(m(x), y).backward()
            grads[k] = torch.cat([q.grad.reshape(-1) for q in m.parameters()])
        for k in errs:
            errs[k].append(float((grads[k] - grads["exact"]).norm() / grads["exact"].norm()))
    for st in states:
        st.close()
    m = DDP(copy.deepcopy(base))
    state, hook = make_comm_hook("powersgd", rank=rank, model=m, algorithm="recursive_doubling",
                                 start_iter=0)
    m.register_comm_hook(state, hook)
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    for s in range(4):
        g = torch.Generator().manual_seed(77 + 1000 * s + me)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(m(torch.randn(32, 64, generator=g)),
                                          torch.randint(0, 10, (32,), generator=g)).backward()
        opt.step()
    flat = torch.cat([q.detach().reshape(-1) for q in m.parameters()])
    both = [torch.zeros_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(both, flat)
    state.close()
    return {"errors": errs, "same_params": all(torch.equal(b, both[0]) for b in both),
            "finite": bool(torch.isfinite(flat).all()), "sent": state.stats["bytes_sent"]}


@pytest.mark.timeout(120)
@pytest.mark.skipif(not have_torch(), reason="torch not installed")
def test_ddp_hook_next_to_pytorchs_powersgd_hook() -> None:
    steps, start = 10, 2
    res = torch_call(ddp_against_torch, 2, steps, start, 2, timeout=110)
    for r in res:
        assert r["same_params"] and r["finite"] and r["sent"] > 0, r
    errs = res[0]["errors"]
    for k, e in errs.items():
        assert max(e[:start]) < 1e-6, (k, e)              # warm-up: DDP's exact average
    mean = {k: float(np.mean(e[start:])) for k, e in errs.items()}
    print(f"\nmean relative gradient error over {steps - start} compressed steps: {mean}")
    assert 0.8 < mean["shapes"] / mean["torch"] < 1.25, mean
    assert 0.7 < mean["flat"] / mean["torch"] < 1.5, mean
