"""``TransportState``: one per transport, made once, holding what the collectives keep
between calls (signatures, auto's profile and choices, step counters, the arena)."""

from __future__ import annotations

import gc
import weakref

import numpy as np

from gradcomm.collectives import auto, dense_allreduce
from gradcomm.collectives._check import agree
from gradcomm.comm import Transport, TransportState, run_ranks


def test_every_transport_has_its_own_state_made_once() -> None:
    def fn(t: Transport) -> tuple[int, bool, bool]:
        st = t.state
        dense_allreduce(t, np.ones(3), "sum", "float64", "ring")
        return id(st), t.state is st, isinstance(st, TransportState)

    out = run_ranks(3, fn)
    assert len({i for i, _, _ in out}) == 3
    assert all(same and typed for _, same, typed in out)


def test_the_argument_check_keeps_its_signatures_in_the_state() -> None:
    def fn(t: Transport) -> tuple[int, bool, frozenset[str] | None]:
        agree(t, "demo", count=4)
        sig = next(iter(t.state.signatures.values()))
        return len(t.state.signatures), sig.verified, agree(t, "demo", once=True, count=4)

    assert run_ranks(2, fn) == [(1, True, None)] * 2


def test_auto_keeps_the_agreed_profile_and_its_choices_in_the_state() -> None:
    def fn(t: Transport) -> tuple[bool, bool, str, bool, int]:
        before = t.state.profile_agreed
        dense_allreduce(t, np.ones(8, np.float32), "sum", "float32", "auto")
        name = auto.select(t, 32, "float32", "sum", native=True)
        st = t.state
        return before, st.profile_agreed, name, st.local_profile_set, len(st.choices)

    before, agreed, name, local_set, choices = run_ranks(2, fn)[0]
    assert (before, agreed, local_set) == (False, True, True)
    assert name == "recursive_doubling" and choices >= 1      # threads: not fast_native
    assert run_ranks(2, lambda t: auto.describe(t))[0] == {"agreed": False, "profile": None}


def test_step_counters_count_per_name_and_per_transport() -> None:
    def fn(t: Transport) -> tuple[list[int], int, int]:
        steps = [t.state.next_step("a") for _ in range(t.rank + 2)]
        return steps, t.state.step("a"), t.state.step("b")

    assert run_ranks(2, fn) == [([0, 1], 2, 0), ([0, 1, 2], 3, 0)]


def test_the_state_keeps_no_transport_alive() -> None:
    def fn(t: Transport) -> tuple[weakref.ref[Transport], TransportState]:
        dense_allreduce(t, np.ones(2), "sum", "float64", "auto")
        return weakref.ref(t), t.state

    ref, state = run_ranks(1, fn)[0]
    gc.collect()
    assert ref() is None and isinstance(state, TransportState)
