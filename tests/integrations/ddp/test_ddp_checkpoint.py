"""The DDP hook's checkpoint format: one rank's packed state is validated."""

from __future__ import annotations

import numpy as np
import pytest

from gradcomm.errors import PayloadError
from gradcomm.integrations.ddp.checkpoint import pack_local, unpack_local


def test_packed_rank_state_is_validated():
    meta = {"units": {}, "offsets": {}}
    block = pack_local({"residuals": {"a": np.arange(3, dtype=np.float32)},
                             "extra": {"a#q": np.arange(2, dtype=np.float64),
                                       "n": np.array([5], np.int32)}}, meta)
    groups, got = unpack_local(block, 0)
    assert groups["residuals"]["a"].tolist() == [0, 1, 2] and got == meta
    assert groups["extra"]["a#q"].dtype == np.float64 and groups["extra"]["n"].tolist() == [5]
    for bad in (block[:5], block[:-1], np.concatenate([block, block[:1]]),
                np.concatenate([np.array([2 ** 40], np.uint64).view(np.uint8), block[8:]])):
        with pytest.raises(PayloadError):
            unpack_local(bad, 1)
    for groups in ({"residuals": {"i": np.arange(2)}},            # integer residual
                   {"other": {"x": np.zeros(1, np.float32)}},      # unknown group
                   {"extra": {"o": np.array([b"x"])}}):            # not numeric
        with pytest.raises(PayloadError, match="entry"):
            unpack_local(pack_local(groups, meta), 2)
