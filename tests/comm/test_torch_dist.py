"""The torch.distributed transport on real gloo processes: the dense conformance matrix at
2 ranks (all of it) and a subset at 3, gloo's own all_reduce equal to ours, sub-groups,
isolation from the program's messages, errors, deadlines.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests._launch import require_torch, torch_call, torchrun
from tests.comm.scripts.conformance import check_conformance

SCRIPTS = Path(__file__).resolve().parent / "scripts"


def check_gloo_matrix(results: list[dict], n: int) -> None:
    assert {r["transport"] for r in results} == {"torch"}
    # gloo reduces float16/bfloat16 itself (exactly, on these inputs); only int16 (and
    # wide unsigned types) are refused
    unsupported = {c.split("/")[2] for c in results[0]["unsupported"]}
    assert unsupported <= {"int16"}
    for r in results:
        r["unsupported"] = [c for c in r["unsupported"] if "/int16/" not in c]
    check_conformance(results, n, native_16bit=True)


@pytest.mark.timeout(120)
def test_conformance_matrix_on_two_gloo_processes() -> None:
    """All of it: gloo point-to-point costs well under a millisecond here."""
    require_torch()
    run = torchrun(SCRIPTS / "conformance.py", 2, "--launcher", "torch", timeout=100)
    check_gloo_matrix(run.results(2), 2)


@pytest.mark.timeout(120)
def test_matrix_subset_groups_isolation_errors_and_deadline_on_three_gloo_processes(
        ) -> None:
    require_torch()
    results = torchrun(SCRIPTS / "torch_errors.py", 3, "--matrix", timeout=100).results(3)
    check_gloo_matrix([r["matrix"] for r in results], 3)
    from gradcomm.collectives import DENSE

    for r in results:
        where = f"rank {r['rank']}"
        assert r["transport"] == "TorchTransport" and r["backend"] == "gloo", where
        assert r["cached"], where
        for algo in DENSE:
            assert r[f"count/{algo}"] == "MismatchError", (where, algo)
        assert r["dtype"] == "MismatchError", where
        assert r["unknown_algorithm"] == "ConfigError", where
        assert r["native_int16"] == "UnsupportedError", where
        assert r["native_bf16"] and r["after_errors"], where
    assert [r.get("sub_rank") for r in results] == [None, 0, 1]
    assert results[1]["sub_ok"] and results[2]["sub_ok"]
    assert results[1]["isolated"] is True
    assert results[0]["stats"] == {"bytes_sent": 40, "messages_sent": 1,
                                   "bytes_received": 0, "messages_received": 0}
    assert results[1]["stats"]["bytes_received"] == 40
    assert results[0]["deadline"] == "DeadlineError"
    assert 0.45 <= results[0]["deadline_seconds"] < 5


@pytest.mark.timeout(60)
def test_absent_rank_on_gloo_raises_deadline() -> None:
    require_torch()
    run = torchrun(SCRIPTS / "absent_rank.py", 2, "tree", "1.0", "--launcher", "torch",
                   timeout=45, check=False, grace=1)
    assert run.returncodes[0] == 1, run.describe()
    assert "DeadlineError" in run.stderr and "within 1 s" in run.stderr, run.describe()


def exchange_dtypes() -> dict:
    """Every storage dtype (bool, bfloat16 as uint16...) travels as raw bytes; views and
    read-only buffers too; torch tensors reduce through gradcomm.allreduce."""
    import torch

    import gradcomm
    from gradcomm.comm import get_transport

    from gradcomm.bench.data import exact_values

    t = get_transport(None, timeout=20)
    peer = 1 - t.rank
    ok = {}
    for dt in ("bool", "uint16", "float16", "int8", "uint64", "float64"):
        send = exact_values(t.rank, 9, "uint8", "sum").astype(dt)     # 0..8, no period
        send.flags.writeable = False
        recv = np.zeros(9, dt)
        t.sendrecv(send, peer, recv, peer)
        ok[dt] = recv.tolist() == exact_values(peer, 9, "uint8", "sum").astype(dt).tolist()
    x = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3).t()       # non-contiguous
    y = gradcomm.allreduce(x, None, algorithm="rabenseifner")
    ok["bf16_tensor"] = (y.dtype == torch.bfloat16 and y.shape == x.shape
                         and torch.equal(y, 2 * x))
    return ok


@pytest.mark.timeout(60)
def test_raw_bytes_of_every_dtype_via_torch_call() -> None:
    require_torch()
    for res in torch_call(exchange_dtypes, 2, timeout=50):
        assert res and all(res.values()), res


def test_torch_transport_needs_initialised_dist() -> None:
    require_torch()
    import torch.distributed as dist

    from gradcomm.comm.torch_dist import TorchTransport
    from gradcomm.errors import ConfigError

    if dist.is_initialized():
        pytest.skip("a process group is initialised in this process")
    with pytest.raises(ConfigError, match="init_process_group"):
        TorchTransport(None)
