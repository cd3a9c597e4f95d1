"""The DDP hook's residual store: per-parameter pieces, hop folds, redistribution."""

from __future__ import annotations

import numpy as np

from gradcomm.error_feedback import KeyedResiduals, ResidualStore
from gradcomm.integrations.ddp.checkpoint import residuals_of
from gradcomm.integrations.ddp.residuals import ParameterResiduals, redistribute


def _res(named: dict, units=(), offsets=None) -> ParameterResiduals:
    r = ParameterResiduals(True)
    for k, v in named.items():
        r._residuals[k] = np.asarray(v, np.float32)
    for u, names, lengths in units:
        r.units[u] = (names, lengths)
    r.offsets = dict(offsets or {})
    return r


def test_a_unit_is_reduced_with_a_keyed_store_of_per_parameter_pieces():
    r = _res({"a": [1, 2], "b": [0, 0, 0]})
    r.shapes = {"a": (2,), "b": (1, 3)}
    x = np.arange(5, dtype=np.float32)
    unit = r.open(["a", "b"], [2, 3], x, 7)
    store = r.store                       # what the collective gets: not the hook's code
    assert isinstance(store, ResidualStore) and isinstance(store, KeyedResiduals)
    assert unit in r.units and type(store).__module__ == "gradcomm.error_feedback.keyed"
    assert x.tolist() == [1, 3, 2, 3, 4] and r._residuals["a"].tolist() == [0, 0]
    assert store.step(unit) == 7 and store.flat_residual(unit, 5, np.float32) is None
    assert store.compensate(unit, x) is x and x.tolist() == [1, 3, 2, 3, 4]
    store.update(unit, x, np.zeros(5, np.float32))
    assert r._residuals["a"].tolist() == [1, 3] and r._residuals["b"].tolist() == [2, 3, 4]
    store.hop_residual(unit + "#e0", 2, 3, np.float32)[...] = 1
    assert r.offsets == {unit + "#e0": 2}
    assert store.parts(unit) == [("a", 2, (2,)), ("b", 3, (1, 3))]
    assert store.parts("another") is None
    assert r.open(["a", "b"], [2, 3], x, 8) == unit and store.step(unit) == 8


def test_fold_maps_hop_residuals_to_parameters_and_divides_replicas():
    # unit "u" = a (2 elements) then b (3): hop e0 covers [1, 4), hop f1 covers [0, 5)
    r = _res({"a": [0, 0], "b": [0, 0, 0], "u#e0": [1, 2, 3], "u#f1": [4, 4, 4, 4, 4]},
             [("u", ["a", "b"], [2, 3])], {"u#e0": 1, "u#f1": 0})
    r.fold("u", {"u#f1": 2})                           # f1 held by two ranks: owed once
    assert r._residuals["a"].tolist() == [2, 3]
    assert r._residuals["b"].tolist() == [4, 5, 2]
    assert "u#e0" not in r._residuals and not r.units and not r.offsets


def test_redistribute_preserves_the_total_error_mass_at_any_rank_count():
    rng = np.random.default_rng(0)
    saved = []
    for rank in range(4):                              # hop f0 replicated on all 4 ranks
        saved.append(_res({"a": rng.standard_normal(3), "u#e0": rng.standard_normal(2),
                           "u#f0": [1.0, 2.0, 3.0]},
                          [("u", ["a"], [3])], {"u#e0": 1, "u#f0": 0}))
    total = sum(s._residuals["a"].astype(np.float64) for s in saved)
    total[1:] += sum(s._residuals["u#e0"].astype(np.float64) for s in saved)
    total += [1, 2, 3]
    for p_new in (1, 2, 3, 4, 5):
        copies = [residuals_of(
            {"residuals": dict(s._residuals), "units": {"u": {"names": ["a"], "lengths": [3]}},
             "offsets": dict(s.offsets)}, i) for i, s in enumerate(saved)]
        got = sum(redistribute(copies, p_new, r)._residuals.get(
            "a", np.zeros(3)).astype(np.float64) for r in range(p_new))
        np.testing.assert_allclose(got, total, rtol=1e-6, atol=1e-6, err_msg=f"p_new={p_new}")
