"""The quantized weight all-gather (``compress_fsdp(..., weights="int8")``) on real
``fully_shard`` with 2 and 3 gloo processes (``scripts/weights_checks.py``): every gather
is every rank's shard through the codec, returned as a Work and waited by FSDP2, with
``reshard_after_forward`` all, none and mixed, nested modules with uneven shards, 2
micro-batches per step, param dtype float32 and bfloat16; every forward computes with the
round trip of every rank's master shard; the asynchronous exchange (with FSDP2's implicit
and explicit prefetch, async unshards) is bitwise the synchronous one; a resume is
bitwise the unbroken run; float64 parameters are refused with advice. In-process: a
missing rank gives a DeadlineError from ``wait()``, not a hang.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from gradcomm.comm import run_ranks  # noqa: E402
from gradcomm.comm.threads import ThreadTransport  # noqa: E402
from gradcomm.errors import DeadlineError  # noqa: E402
from gradcomm.integrations.fsdp.allgather import PendingGather, QuantizedAllGather  # noqa: E402
from tests._launch import torchrun  # noqa: E402

CHECKS = Path(__file__).parent / "scripts" / "weights_checks.py"
GATHERS = {"mixed/float32": 30, "mixed/bfloat16": 30, "all/float32": 36,
           "all/bfloat16": 36, "none/float32": 18, "none/bfloat16": 18}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("p", [2, 3])
def test_weight_allgather_on_gloo_processes(p: int, tmp_path: Path) -> None:
    run = torchrun(CHECKS, p, "gathers", "overlap", "resume", "refusals", "--dir", tmp_path,
                   timeout=200)
    info = run.clean_results(p)[0]["info"]
    # 3 steps x 2 micro-batches x 3 modules; backward regathers with reshard_after_forward
    assert info["gathers"] == GATHERS, info


def test_a_missing_rank_is_a_deadline_not_a_hang() -> None:
    def fn(t: ThreadTransport) -> str:
        if t.rank == 1:
            return "absent"
        gather = QuantizedAllGather(side_group=t)
        work = gather(torch.empty(8), torch.ones(4), None, async_op=True)
        assert isinstance(work, PendingGather)
        began = time.monotonic()
        with pytest.raises(DeadlineError):
            work.wait()
        return f"{time.monotonic() - began:.1f}"

    got = run_ranks(2, fn, wait_timeout=1.0)
    assert got[1] == "absent" and float(got[0]) < 10, got
