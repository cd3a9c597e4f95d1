"""Bucket-layout replay: buckets regrouped into a saved layout of units."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from gradcomm.integrations.ddp.replay import Replay  # noqa: E402


def test_replay_regroups_buckets_into_the_saved_layout_in_order():
    layout = [["a", "b"], ["c"], ["gone"]]
    rep = Replay(layout)
    f1, f2 = torch.futures.Future(), torch.futures.Future()
    rep.add(torch.arange(3.0), ["c", "a"], [1, 2], f1)      # c waits for unit [a, b]
    assert list(rep.ready()) == []
    rep.add(torch.arange(4.0), ["b", "d"], [3, 1], f2)      # last bucket; d is new
    units = [u for u, _ in rep.ready()] + [u for u, _ in rep.finish()]
    assert units == [["a", "b"], ["c"], ["d"]]            # "gone" never came: dropped
    done = []
    for u in units:
        done += rep.done(u)
    assert [f for f, _ in done] == [f1, f2] and rep.left() == []
