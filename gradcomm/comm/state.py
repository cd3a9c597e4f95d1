"""What gradcomm keeps per transport from call to call: one :class:`TransportState` each.

Every :class:`~gradcomm.comm.Transport` creates its state once, as ``t.state``. The layers
above keep their per-transport memory there (the argument check's packed signatures,
``auto``'s profile and choices, step counters, the compressed allreduce's byte arena), so
it lives and dies with the transport and one object shows all of it.

Example:
    >>> from gradcomm.comm import run_ranks
    >>> run_ranks(1, lambda t: [t.state.next_step("demo") for _ in range(3)])
    [[0, 1, 2]]
"""

from __future__ import annotations

import threading
from typing import Any


#: :attr:`~gradcomm.comm.Transport.native_below` unless a transport says otherwise
NATIVE_BELOW = 64 << 10

class TransportState:
    """Per-transport memory of the collectives (one per transport, made by its
    ``__init__``). Holds no reference to the transport itself.

    Attributes:
        signatures: the argument check's packed signature per argument tuple, and
            whether it was verified (:mod:`gradcomm.collectives._check`).
        profile: the profile every rank agreed on for ``auto`` (a
            :class:`~gradcomm.collectives.costmodel.Profile`, or None), valid once
            ``profile_agreed`` (:func:`gradcomm.collectives.auto.agree_profile`).
        local_profile: this rank's candidate profile, valid once ``local_profile_set``
            (:func:`gradcomm.collectives.auto.use_profile` / ``local_profile``).
        choices: ``auto``'s algorithm per (bytes, dtype, op, native), for the agreed
            profile (cleared when it changes).
        native_below: the agreed :attr:`~gradcomm.comm.Transport.native_below`, valid
            once ``profile_agreed``.
        small: the resolved small calls by (count, numpy dtype, op, algorithm), for the
            agreed profile (:mod:`gradcomm.collectives.small`; cleared when it changes).
        steps: call counters by name (:meth:`next_step`), for calls without a residual
            store: their step seeds the stochastic codecs.
        arena: the compressed allreduce's reusable buffers (set by that layer).
        plans: the compressed allreduce's gathered routes planned per layout (codec,
            count, key, seed, feedback), most recent last (:mod:`gradcomm.compressed.
            routes`).
        scratch: the dense collectives' reusable receive buffers, by slot
            (:class:`~gradcomm.collectives._wire.DenseWire`).
        lock: guards ``arena`` (and what else a layer shares between threads).
    """

    __slots__ = ("signatures", "profile", "profile_agreed", "local_profile",
                 "local_profile_set", "choices", "small", "native_below", "steps", "arena",
                 "plans", "scratch", "lock")

    def __init__(self) -> None:
        self.signatures: dict[Any, Any] = {}
        self.profile: Any = None
        self.profile_agreed = False
        self.local_profile: Any = None
        self.local_profile_set = False
        self.choices: dict[tuple[Any, ...], str] = {}
        self.small: dict[tuple[Any, ...], Any] = {}
        self.native_below = NATIVE_BELOW
        self.steps: dict[str, int] = {}
        self.arena: Any = None
        self.plans: dict[tuple[Any, ...], Any] = {}
        self.scratch: dict[Any, Any] = {}
        self.lock = threading.Lock()

    def step(self, counter: str) -> int:
        """How many times :meth:`next_step` was called for ``counter``.

        Example:
            >>> TransportState().step("compressed")
            0
        """
        return self.steps.get(counter, 0)

    def next_step(self, counter: str) -> int:
        """This call's step for ``counter`` (the count of earlier calls), then advance it.

        Example:
            >>> s = TransportState(); s.next_step("a"), s.next_step("a"), s.step("a")
            (0, 1, 2)
        """
        step = self.steps.get(counter, 0)
        self.steps[counter] = step + 1
        return step
