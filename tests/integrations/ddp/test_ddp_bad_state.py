"""A DDP comm-hook state with keys missing is a ConfigError naming them, not a KeyError
from deep inside the restore."""

from __future__ import annotations

import pytest

from gradcomm.errors import ConfigError
from gradcomm.integrations.ddp import checkpoint


@pytest.mark.parametrize("drop", ["ranks", "world_size", "iter"])
def test_state_missing_a_key(drop: str) -> None:
    state = {"format": checkpoint.STATE_FORMAT, "version": checkpoint.STATE_VERSION,
             "ranks": [], "world_size": 0, "iter": 0}
    del state[drop]
    with pytest.raises(ConfigError, match=f"lacks {drop}"):
        checkpoint.restore(state, 2, 0)
