"""Topologies and mixing matrices: neighbours, weights, validation, spectral factors."""

from __future__ import annotations

import numpy as np
import pytest

from gradcomm.collectives import topologies as T
from gradcomm.errors import ConfigError

SIZES = (1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16)


def fits(name: str, p: int) -> bool:
    return name != "torus" or p == 1 or any(p % r == 0 for r in range(2, int(p ** 0.5) + 1))


def cases():
    return [(n, p) for n in T.NAMES for p in SIZES if fits(n, p)]


def reference_mh(adj: np.ndarray) -> np.ndarray:
    """Metropolis–Hastings weights from an adjacency matrix, written independently."""
    p = adj.shape[0]
    deg = adj.sum(axis=1)
    w = np.zeros((p, p))
    for i in range(p):
        for j in range(p):
            if i != j and adj[i, j]:
                w[i, j] = 1.0 / (1 + max(deg[i], deg[j]))
        w[i, i] = 1.0 - w[i].sum()
    return w


@pytest.mark.parametrize("name,p", cases())
def test_default_matrix_is_doubly_stochastic_mh_on_edges(name, p):
    topo = T.get(name, p)
    for step in range(topo.period + 1):
        w = topo.matrix(step)
        adj = topo.adjacency(step)
        assert (w >= 0).all()
        np.testing.assert_allclose(w.sum(axis=1), 1.0, atol=1e-14)
        np.testing.assert_allclose(w.sum(axis=0), 1.0, atol=1e-14)
        off = (w != 0) & ~adj
        np.fill_diagonal(off, False)
        assert not off.any()
        np.testing.assert_allclose(w, reference_mh(adj), atol=1e-15)
        for i in range(p):             # send_to is the transpose of recv_from
            assert set(topo.send_to(i, step)) == {k for k in range(p) if adj[k, i]}


@pytest.mark.parametrize("p", SIZES)
def test_ring_neighbours(p):
    topo = T.get("ring", p)
    for i in range(p):
        assert set(topo.recv_from(i)) == {(i - 1) % p, (i + 1) % p} - {i}
    assert {len(topo.recv_from(i)) for i in range(p)} == {min(p - 1, 2)}


@pytest.mark.parametrize("p,shape", [(1, (1, 1)), (4, (2, 2)), (6, (2, 3)), (8, (2, 4)),
                                     (9, (3, 3)), (12, (3, 4)), (16, (4, 4)),
                                     (30, (5, 6))])
def test_torus_shape_is_squarest(p, shape):
    assert T.Torus(p).shape == shape
    assert T.get("torus", p).key == f"torus({shape[0]}x{shape[1]})"


def test_torus_neighbours_3x4():
    topo = T.Torus(12)
    # rank 5 = (1, 1): up (0, 1) = 1, down (2, 1) = 9, left (1, 0) = 4, right (1, 2) = 6
    assert topo.recv_from(5) == (1, 4, 6, 9)
    # rank 0 wraps: up (2, 0) = 8, left (0, 3) = 3
    assert topo.recv_from(0) == (1, 3, 4, 8)
    assert all(len(topo.recv_from(i)) == 4 for i in range(12))


@pytest.mark.parametrize("p", [2, 3, 5, 7, 11, 13])
def test_torus_rejects_rank_counts_that_do_not_fit(p):
    with pytest.raises(ConfigError, match=f"{p} ranks do not fit"):
        T.get("torus", p)


def test_torus_explicit_shape():
    assert T.Torus(6, shape=(3, 2)).recv_from(0) == (1, 2, 4)
    assert T.Torus(5, shape=(1, 5)).recv_from(0) == (1, 4)      # a 1 × p torus is a ring
    with pytest.raises(ConfigError, match="does not hold 6"):
        T.Torus(6, shape=(4, 2))
    with pytest.raises(ConfigError, match="rows, cols"):
        T.Torus(6, shape="3x2")


@pytest.mark.parametrize("p", [2, 3, 4, 5, 6, 8, 9, 16])
def test_exponential_rotates_through_powers_of_two(p):
    topo = T.get("exponential", p)
    dists = [1 << k for k in range(p.bit_length()) if (1 << k) < p]
    assert topo.period == len(dists)
    for step in range(2 * topo.period):
        d = dists[step % len(dists)]
        for i in range(p):
            assert topo.send_to(i, step) == ((i + d) % p,)
            assert topo.recv_from(i, step) == ((i - d) % p,)
        w = topo.matrix(step)
        ref = 0.5 * (np.eye(p) + np.roll(np.eye(p), -d, axis=1))   # W[i, i-d] = 1/2
        np.testing.assert_array_equal(w, ref)


@pytest.mark.parametrize("p", [2, 4, 8, 16])
def test_exponential_period_averages_exactly_for_powers_of_two(p):
    topo = T.get("exponential", p)
    prod = np.eye(p)
    for step in range(topo.period):
        prod = topo.matrix(step) @ prod
    np.testing.assert_array_equal(prod, np.full((p, p), 1.0 / p))


@pytest.mark.parametrize("p", [3, 5, 6, 7, 12])
def test_exponential_period_contracts_for_other_counts(p):
    topo = T.get("exponential", p)
    f = T.spectral_factor([topo.matrix(s) for s in range(topo.period)])
    assert 0 < f < 1


@pytest.mark.parametrize("p", [3, 4, 5, 8, 9])
def test_spectral_factor_matches_eigenvalues_for_symmetric_w(p):
    w = T.get("ring", p).matrix()
    lam = np.sort(np.abs(np.linalg.eigvalsh(w)))[::-1]
    assert T.spectral_factor([w]) == pytest.approx(lam[1] ** 2, abs=1e-12)
    assert T.spectral_factor([T.get("complete", p).matrix()]) == pytest.approx(0, abs=1e-24)


def test_complete_is_uniform():
    np.testing.assert_array_equal(T.get("complete", 4).matrix(), np.full((4, 4), 0.25))


def test_get_rejects_unknown_and_mismatched():
    with pytest.raises(ConfigError, match="unknown topology 'star'.*ring, torus"):
        T.get("star", 4)
    with pytest.raises(ConfigError, match="is for 4 ranks, this group has 3"):
        T.get(T.Ring(4), 3)
    with pytest.raises(ConfigError, match="rank count >= 1"):
        T.Ring(0)


def test_validate_weights_accepts_on_edge_row_stochastic():
    w = [[0.5, 0.5, 0.0], [0.0, 0.5, 0.5], [0.5, 0.0, 0.5]]      # directed, not symmetric
    np.testing.assert_array_equal(T.validate_weights(w, T.get("ring", 3)), np.array(w))


@pytest.mark.parametrize("weights,match", [
    (np.eye(3), "shape \\(4, 4\\)"),
    ([["a"] * 4] * 4, "array of numbers"),
    (np.full((4, 4), np.nan), "NaN"),
    ([[1.5, -0.5, 0, 0], [0, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]], "non-negative"),
    ([[0.5, 0.25, 0, 0.2], [0, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]], "row 0 sums to 0.95"),
    ([[0.5, 0, 0.5, 0], [0, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]], "W\\[0, 2\\] = 0.5.*no edge"),
])
def test_validate_weights_rejects(weights, match):
    with pytest.raises(ConfigError, match=match):
        T.validate_weights(weights, T.get("ring", 4))


def test_validate_weights_follows_the_step_of_a_time_varying_graph():
    topo = T.get("exponential", 4)
    w1 = 0.5 * (np.eye(4) + np.roll(np.eye(4), -1, axis=1))     # receive from i - 1
    T.validate_weights(w1, topo, step=0)
    with pytest.raises(ConfigError, match="no edge"):
        T.validate_weights(w1, topo, step=1)                   # step 1 receives from i - 2


def test_plan_uses_only_nonzero_weights():
    w = np.array([[0.5, 0.5, 0.0], [0.0, 0.5, 0.5], [0.5, 0.0, 0.5]])
    pl = T.plan(T.get("ring", 3), 0, 0, w)
    assert pl == T.Plan(recv_from=(1,), send_to=(2,), terms=((0, 0.5), (1, 0.5)))


class Path(T.Topology):
    """A user-defined, non-regular graph: a line 0 - 1 - ... - (p-1)."""

    name = "path"

    def recv_from(self, rank, step=0):
        return tuple(j for j in (rank - 1, rank + 1) if 0 <= j < self.size)


@pytest.mark.parametrize("p", [2, 3, 5])
def test_custom_non_regular_topology_gets_general_mh(p):
    topo = Path(p)
    w = topo.matrix()
    np.testing.assert_allclose(w, reference_mh(topo.adjacency()), atol=1e-15)
    np.testing.assert_allclose(w, w.T)
    np.testing.assert_allclose(w.sum(axis=0), 1.0, atol=1e-15)
    if p == 3:      # ends have degree 1, the middle 2: W[0, 1] = 1 / (1 + 2)
        assert w[0, 1] == pytest.approx(1 / 3) and w[0, 0] == pytest.approx(2 / 3)
    assert T.get(topo, p) is topo
