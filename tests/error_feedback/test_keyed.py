"""KeyedResiduals (gradcomm.error_feedback.keyed): a unit's residual as one flat buffer
whose views are its pieces' residuals; clear, reset and take reach every piece."""

from __future__ import annotations

import numpy as np

from gradcomm.error_feedback import KeyedResiduals


def _keyed() -> KeyedResiduals:
    """A store with unit ``u`` of parts ``w`` (3) and ``b`` (2), a hop residual and codec
    state of each part, and an unrelated parameter ``v``; every residual non-zero."""
    store = KeyedResiduals()
    store.clock = 7
    store.set_parts("u", [("w", 3, None), ("b", 2, None)])
    store.set_parts("v", [("v", 1, None)])
    x = np.float32([1.5, -2, 3, 4, 0.25])
    store.update("u", x, np.zeros(5, np.float32))
    store.update("v", np.float32([5]), np.zeros(1, np.float32))
    store.hop_residual("u#e0", 2, 2, np.float32)[:] = 9
    for name in ("w#q", "b#q", "v#q"):
        store.set_extra(name, np.ones(2, np.float32))
    return store


def test_keyed_residuals_clear_reaches_the_pieces_of_a_unit() -> None:
    store = _keyed()
    assert len(store.residuals_of("u")) == 3          # w, b and the hop
    store.clear("u")
    for name, n in (("w", 3), ("b", 2), ("u#e0", 2)):
        assert not store.residual(name, n, np.float32).any(), name
    assert store.residual("v", 1, np.float32).tolist() == [5.0]
    assert list(store.extra_names()) == ["v#q"] and store.step("u") == 7
    x = np.float32([1, 1, 1, 1, 1])                  # nothing owed any more
    store.take("u", x)
    assert x.tolist() == [1.0] * 5


def test_keyed_residuals_reset_forgets_the_pieces_of_a_unit() -> None:
    store = _keyed()
    store.reset("u")
    assert list(store.names()) == ["v"] and list(store.extra_names()) == ["v#q"]


def test_keyed_residuals_take_adds_and_zeroes_the_pieces_in_one_buffer() -> None:
    store = _keyed()
    x = np.zeros(5, np.float32)
    store.take("u", x)
    assert x.tolist() == [1.5, -2, 3, 4, 0.25]
    assert not store.residual("w", 3, np.float32).any()
    store.update("u", np.float32([1, 2, 3, 4, 5]), np.float32([1, 1, 1, 1, 1]))
    assert store.residual("b", 2, np.float32).tolist() == [3.0, 4.0]
    store.set_parts("u", [("b", 2, None), ("w", 3, None)])     # another layout: moved
    x = np.zeros(5, np.float32)
    store.take("u", x)
    assert x.tolist() == [3.0, 4.0, 0.0, 1.0, 2.0]


def test_keyed_residuals_take_makes_no_residual_a_piece_does_not_hold() -> None:
    """A piece without a residual (a per-hop route's unit: only the hops folded into
    some parameters) owes nothing and is left alone, -0.0 included, until an update."""
    store = KeyedResiduals()
    store.set_parts("u", [("w", 2, None), ("b", 2, None)])
    store.residual("w", 2, np.float32)[:] = [1, 2]
    for _ in range(2):                                 # laid out, then the steady state
        x = np.float32([0, 0, -0.0, 5])
        store.take("u", x)
        assert list(store.names()) == ["w"]
        assert np.signbit(x[2]) and x[1:].tolist() == [0 if _ else 2, -0.0, 5]
    store.update("u", np.float32([1, 1, 1, 1]), np.float32([0, 0, 0, 1]))
    assert list(store.names()) == ["b", "w"]
    assert store.residual("b", 2, np.float32).tolist() == [1.0, 0.0]


def test_update_tallies_the_residual_it_keeps_when_asked() -> None:
    """With :attr:`tally` set, ``update`` adds ``(e · e, e.size)`` of the residual it keeps
    (what the planned route's guard flags read), for the keyed store and the plain one;
    without, nothing is counted."""
    from gradcomm.error_feedback import ErrorFeedback

    x, d = np.float32([1.5, -2, 3, 4, 0.25]), np.float32([1, 1, 1, 1, 1])
    want = float(np.sum((x.astype(np.float64) - d) ** 2))
    for store in (KeyedResiduals(), ErrorFeedback()):
        if isinstance(store, KeyedResiduals):
            store.set_parts("u", [("w", 3, None), ("b", 2, None)])
        store.update("u", x, d)                         # no tally: nothing counted
        store.tally = tally = np.zeros(2)
        store.update("u", x, d)
        store.update("u", x, d)
        assert tally.tolist() == [2 * want, 10.0], type(store)
