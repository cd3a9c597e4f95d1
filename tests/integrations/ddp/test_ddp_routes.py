"""The hook's routes (gradcomm.integrations.ddp.routes): at p = 2 ``auto`` takes the planned
allgather for a gathered codec that plans, where the cost model picks the per-hop ring
(both routes move the same bytes per rank); every step's result is the exact replay of the allgather route with
the hook's residuals, on every rank, in one piece and after the ranks voted for pieces; at
p = 3 the cost model's choice stands."""

from __future__ import annotations

import numpy as np
import pytest

from gradcomm._plan import Reduction
from gradcomm.bench.replay import replay
from gradcomm.comm import run_ranks
from gradcomm.compressed.auto import auto_route
from gradcomm.error_feedback import ErrorFeedback
from gradcomm.integrations.ddp.residuals import ParameterResiduals, unit_key
from gradcomm.integrations.ddp.routes import Routes

torch = pytest.importorskip("torch")

N, STEPS, KEYS = 1_000_003, 3, ["w", "b"]


def _inputs(rank: int, step: int) -> np.ndarray:
    rng = np.random.default_rng((5, rank, step))
    return rng.standard_normal(N).astype(np.float32) * (1 + step)


def _hook_steps(t, codec: str):
    routes = Routes(t, None, Reduction.configure(algorithm="auto", compressor=codec),
                    ParameterResiduals(True), guard=False)
    outs = []
    for step in range(STEPS):
        flat = torch.from_numpy(_inputs(t.rank, step))
        routes.reduce(flat, KEYS, [1000, N - 1000], True, step)
        outs.append(flat.numpy().copy())
    plan, = routes.plans.values()
    return outs, plan.route, plan.gather is not None


@pytest.mark.timeout(240)
@pytest.mark.parametrize("codec", ["int8", "onebit"])
def test_auto_takes_the_planned_allgather_at_two_ranks(codec: str) -> None:
    assert run_ranks(2, lambda t: auto_route(t, codec, N, "float32"))[0] == "ring"
    got = run_ranks(2, lambda t: _hook_steps(t, codec), timeout=200)
    stores = [ErrorFeedback() for _ in range(2)]
    for step in range(STEPS):
        # the hook averages: each rank's input is scaled by 1/p (exact at p = 2) first
        want = replay([_inputs(r, step) * np.float32(0.5) for r in range(2)],
                      dtype="float32", algorithm="allgather", compressor=codec,
                      residuals=stores, key=unit_key(KEYS), step=step)
        for r in range(2):
            assert got[r][0][step].tobytes() == want.tobytes(), (codec, step, r)
    assert [g[1:] for g in got] == [("allgather", True)] * 2


@pytest.mark.timeout(240)
def test_at_three_ranks_the_cost_model_chooses() -> None:
    want = run_ranks(3, lambda t: auto_route(t, "int8", N, "float32"))[0]
    got = run_ranks(3, lambda t: _hook_steps(t, "int8")[1:], timeout=200)
    assert got == [(want, False)] * 3 and want != "allgather"


@pytest.mark.timeout(240)
def test_a_layout_whose_ranks_wait_on_the_wire_is_cut_into_pieces() -> None:
    """With every rank's exchange timed longer than its codec (planted before the vote),
    the layout's planned allgather becomes the pieced one at run VOTE_AT, on every rank,
    and every step before and after is the exact replay of the allgather route."""
    from gradcomm.compressed.planned import VOTE_AT
    from gradcomm.compressed.planned_pipeline import PipelinedGather

    steps = VOTE_AT + 3

    def fn(t):
        routes = Routes(t, None, Reduction.configure(algorithm="auto", compressor="int8"),
                        ParameterResiduals(True), guard=False)
        outs, kinds = [], []
        for step in range(steps):
            flat = torch.from_numpy(_inputs(t.rank, step))
            routes.reduce(flat, KEYS, [1000, N - 1000], True, step)
            plan, = routes.plans.values()
            if step == VOTE_AT - 1:
                plan.gather.spent = [1.0, 0.5]        # the wire took longer than the codec
            outs.append(flat.numpy().copy())
            kinds.append(type(plan.gather).__name__)
        return outs, kinds, routes.stats["pieced"], len(plan.gather.pieces)

    got = run_ranks(2, fn, timeout=200)
    stores = [ErrorFeedback() for _ in range(2)]
    for step in range(steps):
        want = replay([_inputs(r, step) * np.float32(0.5) for r in range(2)],
                      dtype="float32", algorithm="allgather", compressor="int8",
                      residuals=stores, key=unit_key(KEYS), step=step)
        for r in range(2):
            assert got[r][0][step].tobytes() == want.tobytes(), (step, r)
    switched = VOTE_AT + 1          # the first reduction is unplanned: run i is step i + 1
    for _, kinds, pieced, pieces in got:
        assert kinds[:switched] == ["PlannedGather"] * switched, kinds
        assert kinds[switched:] == [PipelinedGather.__name__] * (steps - switched), kinds
        assert pieced == 1 and pieces == 2
