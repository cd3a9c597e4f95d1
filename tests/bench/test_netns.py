"""The emulated-network harness (bench/netns.py): namespaces, tbf cap, launchers, cleanup.

Needs Linux, root and iproute2; skipped (with the reason) elsewhere. ~15 s.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "bench" / "netns.py"
_spec = importlib.util.spec_from_file_location("gradcomm_bench_netns", _PATH)
assert _spec and _spec.loader
netns = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = netns          # dataclasses need the module registered
_spec.loader.exec_module(netns)

_WHY = netns.available()
pytestmark = pytest.mark.skipif(_WHY is not None, reason=str(_WHY))

RATE = 100 * 10**6     # 100 Mbit/s: a transfer of a few MB takes well under a second
NBYTES = 8 * 10**6     # 64 full tbf buckets: the initial burst skews the rate by ~3 %


def _leftovers(net) -> list[str]:
    return netns.list_namespaces(net.prefix)


@pytest.mark.timeout(60)
def test_cap_holds_for_socket_and_mpi_and_cleans_up():
    net = netns.Network(2, "100mbit")
    try:
        net.up()
        assert sorted(_leftovers(net)) == [net.ns(0), net.ns(1)]
        qd = net.qdiscs()
        assert qd.count("tbf") == 2 and "100Mbit" in qd, qd
        rows = netns.check(net, NBYTES, vias=("socket", "mpi"), repeat=3, verbose=False)
        assert [(r["via"], r["src"], r["dst"]) for r in rows] == [
            ("socket", 0, 1), ("socket", 1, 0), ("mpi", 0, 1), ("mpi", 1, 0)]
        for r in rows:
            # the cap holds on every run (the burst allows ~3 %), and the link carries it:
            # the best of three runs above half the rate: a wrong rate unit is off by 10x or
            # more, while a loaded 2-core machine has given 87 % (load 30) where a quiet one
            # gives 95 %; the link's speed itself is the benchmarks' business, not a test's
            assert max(r["all_bps"]) / RATE <= 1.10, r
            assert r["measured_bps"] == max(r["all_bps"]) and len(r["all_bps"]) == 3, r
            assert r["measured_bps"] / RATE >= 0.50, r
    finally:
        net.down()
    assert _leftovers(net) == []


@pytest.mark.timeout(60)
def test_failing_rank_is_reported_and_everything_removed():
    with netns.Network(2, "1gbit") as net:
        with pytest.raises(RuntimeError, match="rank 1 exited with 3"):
            net.run([sys.executable, "-c", "import os, sys; "
                     "sys.exit(3 if os.environ['RANK'] == '1' else 0)"],
                    launcher="gloo", timeout=30, capture=True)
        # rank namespaces see only loopback and their veth, with our private address
        out = subprocess.run(net.exec_prefix(1) + ["ip", "-o", "-4", "addr"],
                             capture_output=True, text=True, check=True).stdout
        assert "10.213.0.2/24" in out and "127.0.0.1" in out and len(out.splitlines()) == 2
    assert _leftovers(net) == []


@pytest.mark.timeout(60)
def test_cleanup_removes_leftovers_and_processes_inside():
    net = netns.Network(3, "1gbit", tag="t" + netns.secrets.token_hex(3))
    net.up()
    assert net.topology == "switch" and len(_leftovers(net)) == 4
    p = subprocess.Popen(net.exec_prefix(2) + ["sleep", "60"], start_new_session=True)
    deadline = netns.time.monotonic() + 10     # wait until it is inside the namespace
    while not netns._run(netns.IP, "netns", "pids", net.ns(2)).stdout.split():
        assert netns.time.monotonic() < deadline
        netns.time.sleep(0.02)
    try:
        removed = netns.cleanup(net.prefix)       # as `--cleanup` would, after a crash
        assert sorted(removed) == sorted(net.created)
        assert p.wait(timeout=10) == -15          # the process inside was stopped
        assert _leftovers(net) == []
    finally:
        if p.poll() is None:
            p.kill()
        net.down()


def test_rate_parsing_and_tbf_sizing():
    assert netns.parse_rate("10gbit") == 10**10 and netns.fmt_rate(10**10) == "10gbit"
    with pytest.raises(ValueError, match="rate must look like"):
        netns.parse_rate("fast")
    for rate in (10**8, 10**9, 10**10):
        burst, limit = netns.tbf_params(rate)
        assert burst >= 2 * 65536 and burst >= rate / 8 * 0.002   # >= GSO packet, >= 2 ms
        assert limit >= 2 * 4 * 2**20                             # two TSQ budgets
    with pytest.raises(ValueError, match="exactly 2 ranks"):
        netns.Network(3, "1gbit", topology="direct")


def test_the_pmix_port_is_free_and_outside_the_ephemeral_range():
    """PMIx binds the port after the harness picked it: an ephemeral one could be taken
    meanwhile by any outgoing connection (the launch then fails)."""
    import socket

    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for _ in range(20):
        port = netns.free_loopback_port()
        assert 10000 <= port < low
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


@pytest.mark.timeout(90)
def test_train_over_the_emulated_link_counts_nic_bytes(tmp_path):
    """bench/train.py end to end: mpirun + gloo in namespaces; dense DDP moves the gradient
    once per step per rank (ring at p=2), PyTorch's fp16 hook half of it; gradcomm's
    uncompressed hook trains bitwise like DDP."""
    pytest.importorskip("torch")
    pytest.importorskip("sklearn")
    out = tmp_path / "train.json"
    width = 512
    params = 64 * width + width + width * width + width + width * 10 + 10
    p = subprocess.run([sys.executable, str(_PATH.parent / "train.py"), "--rate", "1gbit",
                        "--steps", "6", "--warmup", "2", "--width", str(width),
                        "--variants", "ddp,torch-fp16,gc-none", "--ablation", "none",
                        "--json", str(out)],
                       capture_output=True, text=True, timeout=85)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    (main,) = netns.json.loads(out.read_text())["sections"]
    rows = {r["variant"]: r for r in main["rows"]}
    grad = 4 * params
    assert all(r["replicas_identical"] for r in rows.values())
    assert 1.0 <= rows["ddp"]["tx_bytes_per_step"] / grad < 1.15, rows["ddp"]
    assert 0.5 <= rows["torch-fp16"]["tx_bytes_per_step"] / grad < 0.6, rows["torch-fp16"]
    assert rows["gc-none"]["train_loss"] == rows["ddp"]["train_loss"]
