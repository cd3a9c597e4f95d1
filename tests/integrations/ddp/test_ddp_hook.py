"""The DDP comm hook: real gloo processes and real mpirun, plus the state logic in-process.

The multi-process checks live in ``scripts/ddp_checks.py`` and run many per launch
(process start-up dominates): parity with DDP's built-in allreduce (bitwise), every codec
trains with identical parameters on every rank, residuals survive bucket rebuilds and a
change of bucket_cap_mb (telescoping identity), checkpoint-resume is bitwise equal to the
unbroken run, join() with uneven inputs, the uncompressed warm-up (start_iter),
checkpoints moving between rank counts, and every compressed bucket equal to an
independent reduction of all ranks' recorded bucket inputs ('exact').
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import gradcomm  # noqa: E402
from gradcomm.comm import run_ranks  # noqa: E402
from gradcomm.errors import ConfigError, UnsupportedError  # noqa: E402
from gradcomm.integrations import ddp  # noqa: E402
from gradcomm.integrations.ddp.checkpoint import residuals_of  # noqa: E402
from gradcomm.integrations.ddp.residuals import redistribute  # noqa: E402
from tests._launch import free_port, mpirun, require_mpi, torchrun  # noqa: E402

SCRIPTS = Path(__file__).parents[1] / "scripts"
CHECKS = SCRIPTS / "ddp_checks.py"
EXAMPLES = Path(__file__).resolve().parents[3] / "examples"


# -- real processes ---------------------------------------------------------------------------
@pytest.mark.timeout(150)
def test_hook_on_two_gloo_processes():
    run = torchrun(CHECKS, 2, "parity", "warmup", "compressors", "rebuild", "resume", "join",
                   "errors", timeout=140)
    info = run.clean_results(2)[0]["info"]
    assert info["compressors"], info
    # errors keep their type through DDP's backward(): MismatchError, sparse ConfigError
    assert (info["mismatch"], info["sparse"]) == ("MismatchError", "ConfigError"), info


@pytest.mark.timeout(120)
def test_hook_on_three_gloo_processes_and_between_rank_counts():
    run = torchrun(CHECKS, 3, "parity", "join", "resize", timeout=110)
    run.clean_results(3)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("p, placement", [(2, None), (3, None), (2, "array")])
def test_compressed_hook_equals_an_independent_reduction_of_every_ranks_buckets(p, placement):
    """Each bucket the compressed hook returns == compressed_allreduce over every rank's
    recorded bucket inputs (hook's keys, seed, steps, per-parameter residuals, folds;
    gradcomm.bench.replay agreeing), bitwise, every step: a hook returning zeros (its
    error mass kept in the residuals) passes the telescoping check of 'rebuild' but fails
    this one. ``placement="array"``: the hook's device route (torch residuals, device
    kernels) on CPU tensors."""
    env = {"GRADCOMM_CODEC_PLACEMENT": placement} if placement else None
    run = torchrun(CHECKS, p, "exact", timeout=110, env=env)
    info = run.clean_results(p)[0]["info"]
    folded = [int(s.split(": ")[1].split()[0]) for s in info["exact"]]
    assert len(folded) == 12 and max(folded) > 0, info   # the fold path ran too


@pytest.mark.timeout(120)
def test_hook_under_mpirun_with_the_mpi_transport():
    require_mpi()
    run = mpirun(CHECKS, 2, "parity", "compressors", "resume", "join", "exact", "--quick",
                 "--port", str(free_port()), timeout=110)
    run.clean_results(2)


@pytest.mark.timeout(120)
def test_ddp_train_example_under_torchrun_and_mpirun():
    run = torchrun(EXAMPLES / "ddp_train.py", 2, "--compressor", "topk", "--ratio", "0.05",
                   "--epochs", "2", timeout=100)
    res = run.results(1)[0]
    assert res["accuracy"] > 0.5 and res["bytes_sent"] > 0, res
    require_mpi()
    run = mpirun(EXAMPLES / "ddp_train.py", 2, "--compressor", "fp16", "--algorithm", "ring",
                 "--epochs", "1", timeout=100)
    res = run.results(1)[0]
    assert res["transport"] == "mpi" and res["bytes_sent"] > 0, res


@pytest.mark.timeout(120)
def test_ddp_train_example_keeps_adamw_through_the_adam_route():
    run = torchrun(EXAMPLES / "ddp_train.py", 2, "--optimizer", "adamw", "--compressor",
                   "onebit", "--start-iter", "20", "--epochs", "2", timeout=100)
    res = run.results(1)[0]
    assert res["adam_route"] and res["accuracy"] > 0.5 and res["bytes_sent"] > 0, res


@pytest.mark.timeout(90)
def test_mpi_allreduce_example_gives_the_same_bytes_through_wrap():
    require_mpi()
    run = mpirun(EXAMPLES / "mpi_allreduce.py", 2, "--size", "1048576", "--steps", "3",
                 timeout=80)
    res = run.results(1)[0]
    assert res["bitwise_equal"] and res["gradcomm_s"] > 0 and res["mpi_s"] > 0, res


# -- in-process: arguments, the state dict ---------------------------------------------------
def one_rank(fn):
    return run_ranks(1, fn, timeout=30)[0]


def test_sparsifiers_and_powersgd_warm_up_by_default():
    # 150 dense steps for topk, randomk and powersgd; top-k below 1 % then DGC's sparsity
    # ramp (test_ddp_ramp.py)
    def fn(t):
        got = []
        for codec, kw in (("topk", {"ratio": 0.001}), ("randomk", {"ratio": 0.005}),
                          ("topk", {}), ("onebit", {}), (None, {}),
                          ("topk", {"ratio": 0.001, "start_iter": 0}), ("powersgd", {}),
                          ("powersgd", {"rank": 1, "start_iter": 0})):
            state, _ = ddp.make_comm_hook(codec, transport=t, **kw)
            c = state.compressor
            ramp = state.routes.ramp
            got.append((state.start_iter, c.get_config()["rank"]) if codec == "powersgd"
                       else state.start_iter if ramp is None else
                       (state.start_iter, "ramp", ramp.stage_steps))
            state.close()
        with pytest.raises(ConfigError, match="start_iter"):
            ddp.make_comm_hook("topk", start_iter="later", transport=t)
        return got
    assert one_rank(fn) == [(150, "ramp", 25), 150, 150, 0, 0, (0, "ramp", 25), (150, 4),
                            (0, 1)]


def test_arguments_are_validated_early():
    def fn(t):
        with pytest.raises(ConfigError, match="unknown algorithm"):
            ddp.make_comm_hook(None, algorithm="bogus", transport=t)
        with pytest.raises(ConfigError, match="start_iter"):
            ddp.make_comm_hook(None, start_iter=-1, transport=t)
        with pytest.raises(ConfigError, match="compressor options"):
            ddp.make_comm_hook(None, ratio=0.1, transport=t)
        with pytest.raises(ConfigError, match="transport"):
            ddp.make_comm_hook(None, transport="carrier-pigeon")
        with pytest.raises(KeyError, match="unknown compressor"):
            ddp.make_comm_hook("nope", transport=t)
        for name in gradcomm.compressors.names():
            if name in ("none", "powersgd"):
                continue
            with pytest.raises(UnsupportedError, match="native.*powersgd"):
                ddp.make_comm_hook(name, algorithm="native", transport=t)
        ddp.make_comm_hook("powersgd", algorithm="native", transport=t)[0].close()
        state, hook = ddp.make_comm_hook(None, transport=t)
        assert hook is ddp.comm_hook and "rank=0/1" in repr(state)
        with pytest.raises(ConfigError, match="Module"):
            state.bind(object())
        state.close()
        state.close()                                   # idempotent
        return True

    assert one_rank(fn)


def test_the_hook_refuses_misuse_in_the_words_of_every_other_entry_point():
    """make_comm_hook validates through _plan.Reduction: the same misuse gets the same
    error class and message as wrap()'s configuration and as the collective itself."""
    from gradcomm._plan import Reduction
    from gradcomm.compressed import compressed_allreduce

    def message(fn):
        try:
            fn()
        except Exception as exc:                        # noqa: BLE001 - compared below
            return type(exc), str(exc)
        raise AssertionError("no error")

    def fn(t):
        cases = [(None, "bogus", {}), ("topk", "native", {}), ("topk", "bogus", {}),
                 (None, "auto", {"ratio": 0.1}), ("fp16", "ring", {"seed": -1}),
                 ("powersgd", "bogus", {})]
        out = []
        for codec, algorithm, kw in cases:
            seed = kw.pop("seed", None)
            hook = message(lambda: ddp.make_comm_hook(codec, algorithm=algorithm, transport=t,
                                                      **({} if seed is None else
                                                         {"seed": seed}), **kw))
            plan = message(lambda: Reduction.configure(
                algorithm=algorithm, compressor=codec, options=kw, seed=seed,
                check_algorithm=True))
            assert hook == plan, (codec, algorithm, hook, plan)
            if codec is not None and not kw and seed is None:
                x = np.ones(4, np.float32)
                call = message(lambda: compressed_allreduce(
                    t, x, "float32", op="sum", algorithm=algorithm, compressor=codec))
                assert call == hook, (codec, algorithm, call, hook)
            out.append(hook[0].__name__)
        return out

    assert one_rank(fn) == ["ConfigError", "UnsupportedError", "ConfigError",
                            "UnknownOptionError", "ConfigError", "ConfigError"]


def test_state_dict_round_trips_through_torch_save_weights_only():
    def fn(t):
        state, _ = ddp.make_comm_hook(None, transport=t)
        state.residuals.residual("w", 3, np.float32)[...] = [1, 2, 3]
        state.residuals.set_extra("w#q", np.array([0.5, -1.0], np.float32))
        state.residuals.set_extra("n", np.array([3], np.int64))
        state.iter = 7
        sd = state.state_dict()
        buf = io.BytesIO()
        torch.save(sd, buf)
        loaded = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
        other, _ = ddp.make_comm_hook(None, transport=t)
        other.load_state_dict(loaded)
        out = (other.iter, other.residuals._residuals["w"].tolist(),
               {k: other.residuals.extra(k).tolist() for k in other.residuals.extra_names()})
        with pytest.raises(ConfigError, match="format"):
            other.load_state_dict({"format": "something else"})
        with pytest.raises(ConfigError, match="rank0_only"):
            other.load_state_dict({})
        state.close(), other.close()
        return out

    assert one_rank(fn) == (7, [1.0, 2.0, 3.0], {"n": [3], "w#q": [0.5, -1.0]})


def test_load_state_dict_refuses_a_checkpoint_of_another_configuration():
    def fn(t):
        state, _ = ddp.make_comm_hook("topk", ratio=0.1, transport=t)
        sd = state.state_dict()
        out = []
        for codec, kw in (("onebit", {}), ("topk", {"ratio": 0.2}), ("topk", {"seed": 3}),
                          ("topk", {"algorithm": "ring"})):
            other, _ = ddp.make_comm_hook(codec, transport=t, **{"ratio": 0.1, **kw}
                                          if codec == "topk" else kw)
            with other, pytest.raises(ConfigError, match="state saved by a hook with") as e:
                other.load_state_dict(sd)
            out.append(str(e.value).split(";")[0])
        with ddp.make_comm_hook("topk", ratio=0.1, transport=t)[0] as same:
            same.load_state_dict(sd)                        # the same configuration loads
        state.close()
        return out

    got = one_rank(fn)
    assert got[0].startswith("state saved by a hook with compressor='topk'"), got
    assert "compressor_options" in got[1] and "seed=0" in got[2] and "algorithm" in got[3]


def test_close_is_idempotent_and_reached_by_with_and_by_exit():
    from gradcomm.errors import GradcommError
    from gradcomm.integrations.ddp import lifecycle

    def fn(t):
        with ddp.make_comm_hook(None, transport=t)[0] as state:
            assert state in lifecycle._LIVE and state._worker._thread.is_alive()
        assert state not in lifecycle._LIVE and not state._worker._thread.is_alive()
        with pytest.raises(GradcommError, match="closed"):
            state.flush()
        state.close()                                   # idempotent
        other, _ = ddp.make_comm_hook(None, transport=t)
        lifecycle.close_all()                           # what atexit runs
        return other._worker._thread.is_alive(), other.uses(object())

    assert one_rank(fn) == (False, False)


def test_destroy_process_group_closes_the_states_that_use_the_group_first():
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        state, _ = ddp.make_comm_hook(None)                  # over the default group
        assert state.uses(dist.group.WORLD) and state._worker._thread.is_alive()
    finally:
        dist.destroy_process_group()                         # the wrapped one
    assert not state._worker._thread.is_alive() and state._closed
    assert dist.destroy_process_group.__wrapped__ is not None   # torch's, wrapped once


def test_a_failed_reduction_is_raised_on_the_hook_thread_with_its_type():
    """A rank that never joins: the last bucket's hook raises the worker's DeadlineError
    itself (DDP passes an exception raised by the hook on unchanged, but turns one set
    on the future into "Unable to cast ... to Tensor")."""
    from gradcomm.errors import DeadlineError

    def fn(t):
        if t.rank == 1:
            return "absent"
        model = _psgd_model()
        state, _ = ddp.make_comm_hook("topk", ratio=0.5, transport=t, model=model)
        params = list(model.parameters())
        with state, pytest.raises(DeadlineError):
            ddp.comm_hook(state, _Bucket(params, torch.zeros(sum(p.numel() for p in params))))
        return "raised"

    assert run_ranks(2, fn, timeout=30, wait_timeout=1) == ["raised", "absent"]


def test_the_last_bucket_runs_on_the_autograd_thread_when_nothing_is_queued():
    """The hand-off to the worker is skipped only where nothing is queued: the earlier
    buckets keep overlapping backward, the order of collectives stays DDP's, and the
    bytes are the same either way."""
    import threading

    def fn(t, queue_all=False):
        model = _psgd_model()
        state, _ = ddp.make_comm_hook("int8", transport=t, model=model)
        if queue_all:                                       # every bucket on the worker
            state._worker.run_here = lambda task: False
        params = list(model.parameters())
        ran: list[str] = []
        bucket = state._bucket

        def spy(*args, **kw):
            ran.append(threading.current_thread().name)
            return bucket(*args, **kw)
        state._bucket = spy
        buf = torch.arange(sum(p.numel() for p in params), dtype=torch.float32) * (t.rank + 1)
        with state:
            outs = []
            for lasts in ((True,), (False, True), (False, False, True)):
                futs = [ddp.comm_hook(state, _Bucket(params, buf.clone() / len(lasts), last))
                        for last in lasts]
                outs += [f.wait().numpy().tobytes() for f in futs]
        return ran, outs, threading.current_thread().name

    (ran, outs, here), (_, other, _) = run_ranks(2, fn, timeout=30)
    (queued, alone, _), _ = run_ranks(2, lambda t: fn(t, True), timeout=30)
    assert outs == other == alone and queued == ["gradcomm-ddp-hook"] * 6
    # the first last bucket finds the worker idle; the others before a last one queue
    assert ran[0] == here != "gradcomm-ddp-hook", ran
    assert ran[1] == ran[3] == ran[4] == "gradcomm-ddp-hook", ran


# -- PowerSGD through the hook, in-process (the gloo runs are in scripts/ddp_checks.py) -------
SHAPES = {"w": (24, 16), "b": (24,), "v": (8, 30)}


class _Bucket:
    """What DDP hands the hook (a GradBucket): parameters, flat gradients, last or not."""

    def __init__(self, params: list, buf, last: bool = True) -> None:
        self.params, self.buf, self.last = params, buf, last

    def parameters(self):
        return self.params

    def buffer(self):
        return self.buf

    def index(self) -> int:
        return 0

    def is_last(self) -> bool:
        return self.last


def _psgd_model():
    m = torch.nn.Module()
    for name, shape in SHAPES.items():
        m.register_parameter(name, torch.nn.Parameter(torch.zeros(shape)))
    return m


def _psgd_steps(state, model, rank: int, steps: range) -> list[bytes]:
    """Run the hook on one bucket of every parameter per step; the reduced bytes."""
    params = list(model.parameters())
    out = []
    for step in steps:
        g = torch.Generator().manual_seed(100 * step + rank)
        buf = torch.randn(sum(p.numel() for p in params), generator=g)
        fut = ddp.comm_hook(state, _Bucket(params, buf))
        out.append(fut.wait().numpy().tobytes())
    return out


def test_powersgd_hook_uses_shapes_runs_on_native_and_counts_its_bytes():
    from gradcomm.compressed.powersgd import parts_of, wire_values

    def fn(t, algorithm):
        model = _psgd_model()
        state, _ = ddp.make_comm_hook("powersgd", rank=2, algorithm=algorithm, transport=t,
                                      start_iter=0,
                                      model=model)
        got = _psgd_steps(state, model, t.rank, range(3))
        unit, (names, _) = next(iter(state.residuals.units.items()))
        wire = sum(wire_values(parts_of(sum(map(np.prod, SHAPES.values())), unit,
                                        state.compressor, shapes=[SHAPES[k] for k in names])))
        extras = {k: state.residuals.extra(k).size for k in state.residuals.extra_names()}
        state.close()
        return got, dict(state.residuals.shapes), extras, state.stats["native_nbytes"], wire

    native, ring = run_ranks(2, lambda t: fn(t, "native"), timeout=60), \
        run_ranks(2, lambda t: fn(t, "ring"), timeout=60)
    assert native[0][0] == native[1][0] == ring[0][0]      # p = 2: fl(a + b) either way
    _, shapes, extras, nbytes, wire = native[0]
    assert shapes == SHAPES
    assert extras == {"w#q": 2 * 16, "v#q": 2 * 30}         # (shape[0], rest) views; b plain
    assert nbytes == 3 * wire * 4 and wire == 24 + 2 * (24 + 8) + 2 * (16 + 30)
    assert ring[0][3] == 0


def test_powersgd_hook_resumes_bitwise_and_at_other_rank_counts():
    def run(t, load=None, steps=range(4)):
        model = _psgd_model()
        state, _ = ddp.make_comm_hook("powersgd", rank=2, algorithm="ring", transport=t,
                                      start_iter=0,
                                      model=model)
        if load is not None:
            state.load_state_dict(torch.load(io.BytesIO(load), weights_only=True))
        got = _psgd_steps(state, model, t.rank, steps)
        buf = io.BytesIO()
        torch.save(state.state_dict(), buf)
        q = {k: state.residuals.extra(k).tobytes() for k in state.residuals.extra_names()}
        state.close()
        return got, buf.getvalue(), q

    unbroken = run_ranks(2, run, timeout=60)
    first = run_ranks(2, lambda t: run(t, steps=range(2)), timeout=60)
    resumed = run_ranks(2, lambda t: run(t, first[0][1], range(2, 4)), timeout=60)
    for r in range(2):
        assert resumed[r][0] == unbroken[r][0][2:], f"rank {r}"
        assert resumed[r][2] == unbroken[r][2]
    sd = torch.load(io.BytesIO(first[0][1]), weights_only=True)
    assert sorted(sd["ranks"][1]["extra"]) == ["v#q", "w#q"]
    saved = [residuals_of(e, r) for r, e in enumerate(sd["ranks"])]
    for r in range(3):
        moved = redistribute(saved, 3, r)._extras
        assert {k: v.tobytes() for k, v in moved.items()} == \
            {k: v.tobytes() for k, v in saved[0]._extras.items()}
    for p_new in (1, 3):                  # every new rank takes rank 0's (identical) Q
        out = run_ranks(p_new, lambda t: run(t, first[0][1], range(2, 3)), timeout=60)
        assert all(o[0] == out[0][0] for o in out) and all(o[2] == out[0][2] for o in out)
