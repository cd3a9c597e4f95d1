"""FSDP2 compressed reduce-scatter: real ``fully_shard`` on 2 and 3 gloo processes.

The multi-process checks live in ``scripts/fsdp_checks.py``, many per launch: parity of
``compress_fsdp(None)`` with FSDP2's own reduce-scatter (bitwise), every codec's shards
equal to the exact replay of every rank's recorded inputs (error feedback on), bfloat16
reduce dtype, the ring route, the gradient divide factor, accumulation without sync,
unsupported set-ups refused with advice, resume from ``state_dict`` (torch.save and DCP)
bitwise equal to the unbroken run, a state saved at 2 ranks loaded at 3 keeping the error
mass, convergence close to uncompressed, HSDP through the replicate hook (on a real 2 x 2
mesh at 4 ranks: bitwise equal to FSDP2's own HSDP for None, the replay's for int8), and the
divergence guard resetting residuals a NaN step poisoned (without it, the planted fault,
the run stays non-finite). The quantized weight all-gather: test_fsdp_weights.py. In-process:
the layout's mapping between FSDP2's flat buffer and each parameter.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from gradcomm.errors import ConfigError  # noqa: E402
from gradcomm.integrations.fsdp import make_reduce_scatter  # noqa: E402
from gradcomm.integrations.fsdp.layout import Layout, Param  # noqa: E402
from tests._launch import torchrun  # noqa: E402

CHECKS = Path(__file__).parent / "scripts" / "fsdp_checks.py"


@pytest.mark.timeout(200)
def test_fsdp_on_two_then_three_gloo_processes(tmp_path: Path) -> None:
    run = torchrun(CHECKS, 2, "parity", "codecs", "options", "errors", "resume", "save",
                   "converge", "hsdp", "guard", "--dir", tmp_path, timeout=150)
    info = run.clean_results(2)[0]["info"]
    assert len(info["codecs"]) == 9 and all(n == 9 for n in info["codecs"].values()), info
    assert info["saved_world"] == 2
    run = torchrun(CHECKS, 3, "parity", "codecs", "options", "resume", "resize", "hsdp",
                   "--dir", tmp_path, timeout=150)
    info = run.clean_results(3)[0]["info"]
    assert info["resized_from"] == 2 and all(n == 9 for n in info["codecs"].values()), info


@pytest.mark.timeout(200)
def test_hsdp_on_a_two_by_two_mesh(tmp_path: Path) -> None:
    """4 gloo processes (oversubscribed on small machines): FSDP on mesh["shard"] plus
    gradcomm on the replicate dimension equals FSDP2's own HSDP bitwise for None, and
    with int8 every reduce-scatter and replicate average equals its replay."""
    run = torchrun(CHECKS, 4, "hsdp22", "hsdp", "--dir", tmp_path, timeout=150)
    info = run.clean_results(4)[0]["info"]
    assert info["hsdp22"] == [9, 9], info          # 3 modules x 3 steps, both stages


def test_layout_round_trips_and_moves_between_rank_counts() -> None:
    # a (5, 3) weight and a (5,) bias: 2 rows per chunk at p = 3 (one padding row)
    lay = Layout("m", [Param("w", (5, 3), 2), Param("b", (5,), 2)], 3)
    assert (lay.n, lay.shard) == (24, 8)
    flat = np.arange(24, dtype=np.float32)
    split = lay.split(flat)
    assert split["w"].tolist() == [0, 1, 2, 3, 4, 5, 8, 9, 10, 11, 12, 13, 16, 17, 18, 19,
                                   20, 21]
    assert split["b"].tolist() == [6, 7, 14, 15, 22, 23]
    assert lay.join(split).tobytes() == flat.tobytes()
    # unpadded arrays are re-padded with zeros, so a residual moves to another p
    lay2 = Layout("m", [Param("w", (5, 3), 3), Param("b", (5,), 3)], 2)
    moved = lay2.join({k: lay.unpad(k, v) for k, v in split.items()})
    assert lay2.split(moved)["w"][:15].tolist() == split["w"][:15].tolist()
    assert lay2.split(moved)["w"][15:].tolist() == [0.0] * 3
    shard = lay.shard_to_param(np.ones(8, np.float32), 1)
    assert shard["b"].tolist() == [0, 0, 1, 1, 0, 0]
    with pytest.raises(ConfigError):
        lay.join({"w": np.ones(7, np.float32)})


def test_make_reduce_scatter_checks_its_codec() -> None:
    rs = make_reduce_scatter("topk", ratio=0.01)
    assert rs.codec.name == "topk" and rs.ef.enabled
    assert not make_reduce_scatter("qsgd", levels=2).ef.enabled      # not a contraction
    with pytest.raises(ConfigError, match="powersgd"):
        make_reduce_scatter("powersgd")
    with pytest.raises(ConfigError):
        make_reduce_scatter(None, ratio=0.1)
    out = rs.allocate((4,), dtype=torch.bfloat16, device=torch.device("cpu"))
    assert out.shape == (4,) and out.dtype == torch.bfloat16


@pytest.mark.timeout(120)
def test_example_trains_and_exits_cleanly(tmp_path: Path) -> None:
    """examples/fsdp_train.py under 2 gloo ranks: exit status 0, learns, resumes."""
    pytest.importorskip("sklearn")
    example = Path(__file__).resolve().parents[3] / "examples" / "fsdp_train.py"
    run = torchrun(example, 2, "--epochs", "2", "--compressor", "int8", "--reduce-dtype",
                   "bfloat16", "--checkpoint", tmp_path / "ef.pt", timeout=100)
    result = run.results(1)[0]
    assert result["accuracy"] > 0.85 and result["bytes_sent"] > 0, result


def _ends_after_compress_fsdp(weights: bool) -> dict:
    """A ``compress_fsdp`` model (its side groups made: reduce-scatter and, with
    ``weights``, the quantized weight all-gather) takes two steps, then the run ends
    (``end_process_group``) while the model is still alive."""
    import gc

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from gradcomm.integrations import fsdp
    from gradcomm.integrations.ddp.lifecycle import end_process_group
    from tests._launch import gloo_threads

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    fsdp.compress_fsdp(model, "int8", seed=0, weights="int8" if weights else None)
    for _ in range(2):
        model(torch.ones(3, 4)).sum().backward()
    sides = len(fsdp._SIDES) + len(fsdp._GATHER_SIDES)
    end_process_group()
    left = len(fsdp._SIDES) + len(fsdp._GATHER_SIDES)
    del model, mesh
    gc.collect()                    # as gradcomm's exit handler does (comm/torch_teardown.py)
    return {"sides": sides, "left": left, "gloo": gloo_threads()}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("weights", [False, True])
def test_side_groups_are_let_go_of_when_the_run_ends(weights: bool) -> None:
    """Destroying the default group drops compress_fsdp's side groups from their caches,
    so once the model is freed no gloo thread is left (as without compress_fsdp)."""
    from tests._launch import torch_call

    for r in torch_call(_ends_after_compress_fsdp, 2, weights, timeout=100):
        assert r["sides"] == (2 if weights else 1) and r["left"] == 0, r
        assert r["gloo"] == [], r
