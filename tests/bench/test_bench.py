"""The microbenchmark CLI: in-process ranks, real mpirun, bare launch, rows/JSON schema.

Tiny sweeps (a few sizes, 2 iterations): these test that the benchmark measures what it
says and checks results, not the performance figures.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from gradcomm.bench import cli, launch, plan as plan_module, report
from gradcomm.bench.cli import main
from gradcomm.bench import sweep as sweep_module
from gradcomm.bench.sweep import LARGE, Plan, Row, Variant, iterations, round_sizes, sweep
from gradcomm.collectives import DENSE
from gradcomm.comm import run_ranks
from gradcomm.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--sizes", "4,4K,96K", "--iters", "2", "--warmup", "1", "--no-progress"]
ROW_KEYS = {"size", "count", "dtype", "op", "algorithm", "compressor", "check", "label",
            "iters", "warmup", "avg_us", "min_us", "max_us", "p50_us", "p95_us", "algbw_gbs",
            "busbw_gbs", "wire_bytes", "messages", "rel_err", "wrong", "note", "extra",
            "rounds", "spread_pct", "error_feedback"}
ENV_KEYS = {"ranks", "transport", "launcher", "hostname", "date", "versions", "cpus",
            "loadavg_start", "loadavg_end"}


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", OMPI_ALLOW_RUN_AS_ROOT="1",
               OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    for k in launch.MPI_ENV + ("RANK", "WORLD_SIZE"):
        env.pop(k, None)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def _run(cmd: list[str], timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_env(),
                          cwd=ROOT)


def _mpiexec() -> str:
    path = launch.find_mpiexec()
    assert path, "mpiexec and mpi4py are part of the test environment"
    return path


def _check_doc(doc: dict, ranks: int, transport: str, n_sizes: int) -> list[dict]:
    assert doc["schema"] == 1
    assert ENV_KEYS <= set(doc["environment"])
    assert doc["environment"]["ranks"] == ranks
    assert doc["environment"]["transport"] == transport
    rows = doc["rows"]
    assert len(rows) == n_sizes * len(doc["config"]["variants"])
    for r in rows:
        assert set(r) == ROW_KEYS
        assert r["note"] == "", r
        assert r["wrong"] == 0, r
        assert r["count"] * 4 == r["size"]
        assert 0 < r["p50_us"] <= r["p95_us"]
        # the mean is the mean of the rounds' means, weighted by their calls
        per = round_sizes(r["iters"], r["rounds"])
        assert r["avg_us"] == pytest.approx(
            sum(k * u for k, u in zip(per, r["extra"]["round_us"])) / sum(per), rel=1e-9)
    return rows


@pytest.mark.timeout(60)
def test_threads_sweep_rows_json_and_summary(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert main(["--transport", "threads", "--np", "3", *TINY, "--no-check",
                 "--json", str(out)]) == 0
    text = capsys.readouterr().out
    doc = json.loads(out.read_text())
    rows = _check_doc(doc, 3, "threads", 3)
    algos = [a for a in DENSE if a in cli.available_algorithms()]
    assert {r["algorithm"] for r in rows} == {*algos, "auto"}     # auto: the summary's row
    assert {r["check"] for r in rows if r["algorithm"] != "native"} == {True, False}
    for r in rows:
        if r["algorithm"] != "native":
            assert r["wire_bytes"] >= r["size"] * 2 * 2 / 3 - 1   # >= the ring's bytes
    table = [ln for ln in text.splitlines() if ln and not ln.startswith("#")]
    assert len(table) == len(rows)
    assert text.count("# summary:") == 1 and "#wrong 0" in text
    assert doc["summary"]["wrong"] == 0 and doc["summary"]["latency"]["size"] == 4096


@pytest.mark.timeout(60)
def test_mpirun_two_ranks_with_baseline(tmp_path):
    out = tmp_path / "m.json"
    p = _run([_mpiexec(), "-n", "2", "--oversubscribe", sys.executable, "-m",
              "gradcomm.bench", *TINY, "--json", str(out)])
    assert p.returncode == 0, p.stderr
    doc = json.loads(out.read_text())
    rows = _check_doc(doc, 2, "mpi", 3)
    assert doc["environment"]["launcher"] == "mpiexec"
    assert "mpi4py" in doc["environment"]["versions"]
    base = [r for r in rows if r["algorithm"] == "MPI_Allreduce"]
    assert len(base) == 3 and all(r["check"] is None and r["wire_bytes"] is None for r in base)
    assert doc["summary"]["reference"] == "MPI_Allreduce"
    assert p.stdout.count("# gradcomm.bench") == 1          # only rank 0 prints
    assert p.stdout.count("# summary:") == 1


@pytest.mark.timeout(60)
def test_bare_command_starts_its_own_mpi_ranks(tmp_path):
    out = tmp_path / "b.json"
    p = _run([sys.executable, "-m", "gradcomm.bench", "--sizes", "4K", "--iters", "2",
              "--warmup", "0", "--algorithms", "recursive_doubling,native",
              "--dtype", "int32", "--op", "max", "--json", str(out)])
    assert p.returncode == 0, p.stderr
    doc = json.loads(out.read_text())
    assert doc["environment"]["transport"] == "mpi" and doc["environment"]["ranks"] == 2
    assert " -n 2 " in doc["environment"]["launch_command"]
    assert [r["algorithm"] for r in doc["rows"]] == ["MPI_Allreduce", "recursive_doubling",
                                                      "native", "auto"]
    assert all(r["wrong"] == 0 and r["dtype"] == "int32" for r in doc["rows"])
    assert "\r[" not in p.stderr                             # no progress when piped


@pytest.mark.timeout(30)
def test_bare_without_mpiexec_falls_back_to_threads(monkeypatch, capsys):
    monkeypatch.setattr(launch, "find_mpiexec", lambda explicit=None: None)
    for k in launch.MPI_ENV + ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    assert main(["--sizes", "64", "--iters", "1", "--warmup", "0", "--algorithms", "ring"]) == 0
    text = capsys.readouterr().out
    assert "in-process ranks (threads) instead" in text and "transport threads" in text


def _wrong_baseline_rows(p: int) -> list[Row]:
    class Unreduced:
        """A 'library' that returns the input unreduced: every element is wrong."""

        name = "broken"

        def prepare(self, x, dtype, op):
            return lambda: x

    plan = Plan(sizes=[4096], variants=[Variant("broken", baseline=True),
                                        Variant("recursive_doubling")], iters=2, warmup=0)
    return run_ranks(p, lambda t: sweep(t, plan, Unreduced()))[0]


@pytest.mark.timeout(30)
def test_wrong_results_are_counted_on_every_rank():
    broken, good = _wrong_baseline_rows(2)
    # both timed calls of both ranks, less the elements where an input equals the sum
    assert broken.wrong == 2 * (2 * 1024 - np.count_nonzero(_same_as_sum(2, 1024)))
    assert good.wrong == 0


def _same_as_sum(p: int, n: int) -> np.ndarray:
    from gradcomm.bench.data import exact_input, exact_result

    want = exact_result(p, n, "float32", "sum")
    return np.stack([exact_input(r, n, "float32", "sum") == want for r in range(p)])


def test_unsupported_variant_becomes_a_note():
    plan = Plan(sizes=[64], variants=[Variant("MPI_Allreduce", baseline=True)], iters=1,
                warmup=0)
    row = run_ranks(2, lambda t: sweep(t, plan))[0][0]
    assert row.note.startswith("unsupported") and row.p50_us is None
    assert report.format_row(row).startswith("#")


def test_iterations_shrink_above_large_sizes():
    plan = Plan(sizes=[], variants=[], iters=100, warmup=10, min_iters=10)
    assert iterations(LARGE, plan) == (100, 10)
    assert iterations(4 * LARGE, plan) == (25, 2)
    assert iterations(64 * LARGE, plan) == (10, 2)


def test_sizes_algorithms_and_compressor_parsing():
    assert cli.default_sizes(4, 64) == [4, 8, 16, 32, 64]
    assert cli.default_sizes(3, 100) == [4, 8, 16, 32, 64]
    assert len(cli.default_sizes(4, 64 << 20)) == 25
    assert cli.parse_compressor("qsgd:bits=4:x=a") == ("qsgd", (("bits", 4), ("x", "a")))
    assert cli.parse_compressor("none") == (None, ())
    assert plan_module.parse_rate("1gbit") == 10**9
    assert plan_module.parse_rate("100mbit") == 10**8
    with pytest.raises(ConfigError, match="link rate"):
        plan_module.parse_rate("fast")


def test_link_column_is_wire_bytes_over_time_and_rate(capsys, monkeypatch):
    """--link-rate (or the harness's $GRADCOMM_NET_RATE) adds link(%): the bytes a rank
    sent per call over what the link carries in the mean time; the row's own wire bytes,
    and 2(p-1)/p of the size for a row without them (3 ranks: 4/3)."""
    monkeypatch.delenv(plan_module.RATE_ENV, raising=False)
    rc = main(["--transport", "threads", "--np", "3", "--sizes", "96K", "--algorithms",
               "ring,native", "--iters", "2", "--warmup", "0", "--rounds", "1",
               "--no-progress", "--link-rate", "1gbit"])
    out = capsys.readouterr().out
    assert rc == 0, out
    head = next(ln for ln in out.splitlines() if ln.startswith("#") and "size(B)" in ln)
    assert head.split()[-1] == "link(%)"
    rows = [ln.split() for ln in out.splitlines() if ln.strip().startswith("98304")]
    cols = head[1:].split()
    for cells in rows:
        got = dict(zip(cols, cells))
        wire = float(got["wire(B/rank)"]) if got["wire(B/rank)"] != "-" else 98304 * 4 / 3
        want = wire * 8 / (float(got["avg(us)"]) * 1e-6 * 1e9) * 100
        assert float(got["link(%)"]) == pytest.approx(want, rel=0.02, abs=0.15), got
    assert len(rows) >= 2
    monkeypatch.setenv(plan_module.RATE_ENV, "10000000000")
    main(["--transport", "threads", "--np", "2", "--sizes", "4K", "--algorithms", "ring",
          "--iters", "1", "--warmup", "0", "--rounds", "1", "--no-progress"])
    assert "link(%)" in capsys.readouterr().out
    monkeypatch.delenv(plan_module.RATE_ENV)
    main(["--transport", "threads", "--np", "2", "--sizes", "4K", "--algorithms", "ring",
          "--iters", "1", "--warmup", "0", "--rounds", "1", "--no-progress"])
    assert "link(%)" not in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--algorithms", "bogus"], "unknown algorithm 'bogus'"),
    (["--compressors", "bogus"], "unknown compressor 'bogus'"),
    (["--dtype", "complex64"], "unknown dtype"),
    (["--min-bytes", "1M", "--max-bytes", "1K"], "exceeds"),
    (["--iters", "0"], "--iters"),
    (["--dtype", "int32", "--op", "mean"], "needs a floating dtype"),
    (["--link-rate", "fast"], "link rate"),
])
def test_bad_arguments_are_clear_errors(argv, message, capsys):
    assert main(["--transport", "threads", *argv]) == 2
    assert message in capsys.readouterr().err


def test_transport_that_does_not_match_the_launcher(monkeypatch, capsys):
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "1")
    assert main(["--transport", "threads"]) == 2
    assert "does not apply" in capsys.readouterr().err


def test_launch_detection_and_mpiexec_command():
    assert launch.detect_launcher({"PMI_SIZE": "4"}) == "mpi"
    assert launch.detect_launcher({"RANK": "1", "WORLD_SIZE": "2"}) == "torch"
    assert launch.detect_launcher({"RANK": "1"}) is None
    cmd, env = launch.mpiexec_command(_mpiexec(), 64, ["--iters", "1"], ["--bind-to", "none"])
    assert cmd[:3] == [_mpiexec(), "-n", "64"] and "--oversubscribe" in cmd
    assert cmd[cmd.index(sys.executable):] == [sys.executable, "-m", "gradcomm.bench",
                                               "--iters", "1"]
    assert env["OMP_NUM_THREADS"] == os.environ.get("OMP_NUM_THREADS", "1")
    if os.geteuid() == 0:
        assert env["OMPI_ALLOW_RUN_AS_ROOT"] == "1"


def _row(alg, size, rounds_us, check=True, label=None):
    """A row as the sweep leaves it: times per round, mean = their mean."""
    mean = sum(rounds_us) / len(rounds_us)
    algbw, busbw = sweep_module.bandwidths(size, mean * 1e-6, 2)
    return Row(size, size // 4, "float32", "sum", alg, None, check, label or alg, 2, 0, mean,
               mean, mean, mean, mean, algbw, busbw, None, None, None, 0,
               extra={"round_us": list(rounds_us)}, rounds=len(rounds_us))


def test_summary_reports_the_named_variant_with_its_round_spread():
    rows = [_row("MPI_Allreduce", 4096, [2.0, 2.0], None), _row("auto", 4096, [3.0, 5.0]),
            _row("recursive_doubling", 4096, [1.0, 1.0]),       # faster, but not named
            _row("MPI_Allreduce", 16 << 20, [100.0, 120.0], None),
            _row("auto", 16 << 20, [50.0, 80.0]), _row("ring", 16 << 20, [10.0, 10.0]),
            _row("MPI_Allreduce", 64 << 20, [400.0, 400.0], None),
            _row("auto", 64 << 20, [200.0, 300.0])]
    s = report.summarize(rows, "MPI_Allreduce")
    assert s["variant"] == "auto" and s["reference"] == "MPI_Allreduce"
    # latency: mean 4.0 us against 2.0 us; rounds 3/2 and 5/2
    assert s["latency"]["ratio"] == pytest.approx(2.0) and s["latency"]["met"]
    assert s["latency"]["rounds"] == {"min": 1.5, "median": 2.0, "max": 2.5}
    # 16 MiB: 110 / 65 = 1.69; 64 MiB: 400 / 250 = 1.6, rounds 400/200 and 400/300
    assert s["busbw_16_64MiB"]["min_ratio"] == pytest.approx(1.6)
    assert s["busbw_16_64MiB"]["at_size"] == 64 << 20 and s["busbw_16_64MiB"]["met"]
    assert s["largest"]["ratio"] == pytest.approx(1.6)
    assert s["largest"]["rounds"]["min"] == pytest.approx(4 / 3)
    assert s["largest"]["rounds"]["max"] == pytest.approx(2.0)
    line = report.summary_line(s)
    assert "auto busbw" in line and "1.60x MPI_Allreduce" in line and "[rounds 1.33-2.00]" in line
    # another named variant; a wrong element anywhere: no target is met
    s = report.summarize(rows, "MPI_Allreduce", variant="ring")
    assert s["busbw_16_64MiB"]["min_ratio"] == pytest.approx(11.0) and "latency" not in s
    rows[2].wrong = 1
    s = report.summarize(rows, "MPI_Allreduce")
    assert s["wrong"] == 1 and not s["busbw_16_64MiB"]["met"] and not s["latency"]["met"]


def test_columns_from_known_timings(monkeypatch):
    """Timings fed through a fake clock (rank r's call i takes (r + 1) * (i + 1) ms) give
    the columns computed by hand: OSU's avg/min/max, nccl-tests' algbw = bytes / mean time
    and busbw = algbw * 2(p-1)/p, p50/p95 of the slowest rank, the rounds' means."""
    import threading

    calls = threading.local()

    class Clock:
        @staticmethod
        def perf_counter():
            k = getattr(calls, "k", 0)
            calls.k = k + 1
            rank = int(threading.current_thread().name.removeprefix("gradcomm-rank"))
            i = k // 2                                      # (start, end) per call
            return 0.0 if k % 2 == 0 else (rank + 1) * (i + 1) * 1e-3

    monkeypatch.setattr(sweep_module, "time", Clock)
    p, size = 3, 4096
    plan = Plan(sizes=[size], variants=[Variant("ring")], iters=4, warmup=0, rounds=2)
    (row,) = run_ranks(p, lambda t: sweep(t, plan))[0]
    # rank r: calls of (r+1)*[1, 2, 3, 4] ms -> its mean 2.5*(r+1) ms; over ranks 5 ms
    assert (row.iters, row.rounds, row.count) == (4, 2, 1024)
    assert row.avg_us == pytest.approx(5000.0)
    assert (row.min_us, row.max_us) == (pytest.approx(2500.0), pytest.approx(7500.0))
    # slowest rank (rank 2) per call: 3, 6, 9, 12 ms -> median 7.5, p95 11.55 ms
    assert row.p50_us == pytest.approx(7500.0) and row.p95_us == pytest.approx(11550.0)
    assert row.algbw_gbs == pytest.approx(4096 / 5e-3 / 1e9)
    assert row.busbw_gbs == pytest.approx(4096 / 5e-3 / 1e9 * 4 / 3)
    # rounds: calls 1-2 and 3-4: means over ranks 1.5*2 = 3 ms and 3.5*2 = 7 ms
    assert row.extra["round_us"] == [pytest.approx(3000.0), pytest.approx(7000.0)]
    assert row.spread_pct == pytest.approx(80.0)
    assert row.wrong == 0


@pytest.mark.timeout(60)
def test_wire_bytes_are_the_codecs_payload():
    """onebit through allgather at p = 2 without the check: each rank sends its payload
    once (the codec's own nbytes) plus a frame header."""
    from gradcomm import compressors
    from gradcomm.bench.data import gaussian_input

    n = 4096
    payload = compressors.get("onebit").compress(gaussian_input(0, n, "float32")).nbytes
    plan = Plan(sizes=[4 * n], variants=[Variant("allgather", "onebit", check=False)],
                iters=3, warmup=1, rounds=1)
    (row,) = run_ranks(2, lambda t: sweep(t, plan))[0]
    assert row.wrong == 0 and row.note == ""
    assert payload <= row.wire_bytes <= payload + 64, (payload, row.wire_bytes)
    assert payload < 4 * n / 16                              # ~1 bit per element


def _plant(monkeypatch, fault):
    """Faults the bench must catch, planted in-process (the threads transport)."""
    if fault == "decode_zeros":                     # a codec whose decoder returns zeros
        from gradcomm.compressors.onebit import OneBitCompressor

        real = OneBitCompressor.decompress

        def zeros(self, payload, out=None, add=False):
            res = real(self, payload, out=None)
            res[...] = 0
            if add:
                return out
            if out is not None:
                out[...] = res
                return out
            return res
        monkeypatch.setattr(OneBitCompressor, "decompress", zeros)
    elif fault == "ring_segment":                   # a ring that misplaces a segment
        from gradcomm import collectives

        real = collectives.algorithm("ring")

        def ring(t, buf, red, **kw):
            real(t, buf, red, **kw)
            if buf.size >= 61:
                buf[20:40] = buf[41:61]
        monkeypatch.setitem(collectives._FUNCS, "ring", ring)
    elif fault == "hop_residual":                   # error feedback forgets its residual
        import numpy as np_

        from gradcomm.compressed.wire import CompressedWire

        monkeypatch.setattr(CompressedWire, "_hop_residual",
                            lambda self, name, off, n, dtype: np_.zeros(n, np_.float32))


@pytest.mark.timeout(90)
@pytest.mark.parametrize("fault", ["none", "decode_zeros", "ring_segment", "hop_residual"])
def test_planted_faults_are_wrong_and_exit_nonzero(fault, monkeypatch, tmp_path, capsys):
    _plant(monkeypatch, fault)
    out = tmp_path / "f.json"
    code = main(["--transport", "threads", "--np", "2", "--sizes", "4K", "--iters", "3",
                 "--warmup", "1", "--rounds", "2", "--algorithms", "ring",
                 "--compressors", "none,onebit", "--no-progress", "--json", str(out)])
    doc = json.loads(out.read_text())
    wrong = {r["label"]: r["wrong"] for r in doc["rows"]}
    text = capsys.readouterr().out
    if fault == "none":
        assert code == 0 and doc["summary"]["wrong"] == 0 and "#wrong 0" in text
        return
    assert code == 1 and doc["summary"]["wrong"] == sum(wrong.values()) > 0
    culprits = {"decode_zeros": {"ring+onebit", "ring+onebit+ef"},
                "ring_segment": {"ring", "ring+onebit", "ring+onebit+ef"},
                "hop_residual": {"ring+onebit+ef"}}[fault]
    flagged = {k for k, v in wrong.items() if v}
    assert culprits <= flagged <= culprits | {"auto+onebit", "auto+onebit+ef"}, wrong
    assert wrong["auto"] == 0             # dense auto at 4 KiB: recursive doubling, sound
    if fault == "decode_zeros":        # the round trip check: all n elements on both ranks
        assert wrong["ring+onebit"] >= 2 * 1024


@pytest.mark.timeout(60)
def test_plot_file(tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="--plot is the [bench] extra")
    png = tmp_path / "p.png"
    assert main(["--transport", "threads", "--sizes", "4,1K", "--iters", "1", "--warmup", "0",
                 "--algorithms", "ring,native", "--plot", str(png)]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_plot_without_matplotlib_fails_before_measuring(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert main(["--transport", "threads", "--plot", "x.png"]) == 2
    captured = capsys.readouterr()
    assert "gradcomm[bench]" in captured.err and "size(B)" not in captured.out


def _lossy_codecs() -> list[str]:
    from gradcomm import compressors

    if importlib.util.find_spec("gradcomm.compressed") is None:
        return []
    return [n for n in ("fp16", "int8", "topk") if n in compressors.names()]


@pytest.mark.timeout(60)
@pytest.mark.skipif(not _lossy_codecs(), reason="no lossy codec in this checkout yet")
def test_compressed_rows_report_error_and_identical_bytes(tmp_path):
    lossy = _lossy_codecs()
    out = tmp_path / "c.json"
    assert main(["--transport", "threads", "--sizes", "4K", "--iters", "2", "--warmup", "0",
                 "--algorithms", "ring", "--compressors", ",".join(["none", *lossy]),
                 "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    for r in rows:
        assert r["wrong"] == 0
        assert (r["rel_err"] is None) == (r["compressor"] is None)
        if r["compressor"] is not None and not r["error_feedback"]:
            assert r["rel_err"] < 1 and r["extra"]["compression_ratio"] > 1
    assert {r["label"] for r in rows if r["error_feedback"]} == {
        f"{a}+{c}+ef" for a in ("ring", "auto") for c in lossy}


@pytest.mark.timeout(90)
@pytest.mark.skipif(importlib.util.find_spec("torch") is None or
                    importlib.util.find_spec("gradcomm.comm.torch_dist") is None,
                    reason="torch / the torch transport not installed")
def test_bare_torch_transport_starts_gloo_processes(tmp_path):
    out = tmp_path / "t.json"
    p = _run([sys.executable, "-m", "gradcomm.bench", "--transport", "torch", "--sizes", "4K",
              "--iters", "2", "--warmup", "1", "--algorithms", "ring,native", "--json",
              str(out)], timeout=80)
    assert p.returncode == 0, p.stderr
    doc = json.loads(out.read_text())
    rows = _check_doc(doc, 2, "torch", 1)
    assert [r["algorithm"] for r in rows] == ["dist.all_reduce", "ring", "native", "auto"]
    assert p.stdout.count("# summary:") == 1


@pytest.mark.timeout(60)
def test_codecs_mode(tmp_path, capsys):
    out = tmp_path / "codecs.json"
    assert main(["--codecs", "--sizes", "16K", "--iters", "1", "--compressors",
                 "fp16,topk:ratio=0.1", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["codec"] for r in rows] == ["fp16", "topk:ratio=0.1"]
    assert all(r["n"] == 4096 and r["wire_bytes"] < 16384 for r in rows)
    assert "enc GB/s" in capsys.readouterr().out
    assert main(["--codecs", "--dtype", "int8"]) == 2


@pytest.mark.timeout(60)
def test_stochastic_and_stateful_codecs_replay_exactly_at_every_step():
    """Codecs that draw from the call's step (qsgd, randomk, stochastic int8) or keep state
    (PowerSGD's warm start, error feedback) agree bitwise with the replay at every call:
    the bench tracks each call's step and residuals (PowerSGD counts its steps apart)."""
    vs = [Variant(a, c, options=o, error_feedback=ef)
          for c, o in (("qsgd", ()), ("randomk", (("ratio", 0.1),)), ("powersgd", ()),
                       ("int8", (("rounding", "stochastic"),)))
          for a in ("ring", "auto") for ef in (False, True)]
    plan = Plan(sizes=[4096], variants=vs, iters=3, warmup=1, rounds=2)
    rows = run_ranks(3, lambda t: sweep(t, plan))[0]
    assert [(r.label, r.wrong, r.note) for r in rows] == [(v.label, 0, "") for v in vs]


@pytest.mark.timeout(120)
def test_every_codec_at_its_defaults_is_clean_in_the_bench(tmp_path):
    """Each registered codec, with and without error feedback, checks clean: a codec
    that is no contraction (TernGrad) is not held to one (``Compressor.contractive``)."""
    from gradcomm import compressors

    if importlib.util.find_spec("gradcomm.compressed") is None:
        pytest.skip("no compressed routes in this checkout yet")
    names = [n for n in compressors.names() if n != "none"]
    out = tmp_path / "every.json"
    code = main(["--transport", "threads", "--np", "3", "--sizes", "4K", "--iters", "2",
                 "--warmup", "1", "--rounds", "1", "--algorithms", "auto",
                 "--compressors", ",".join(names), "--no-baseline", "--no-progress",
                 "--json", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert {(r["label"], r["wrong"]) for r in rows} == {
        (f"auto+{n}{e}", 0) for n in names for e in ("", "+ef")}, rows
    assert code == 0


@pytest.mark.parametrize("fresh", [False, True])
def test_rows_write_into_a_kept_out_as_the_baseline_does(fresh: bool, monkeypatch):
    """By default every gradcomm allreduce row passes one ``out=`` array, kept for the row,
    to every call (as ``MPI_Allreduce`` gets its preallocated recvbuf); with
    ``--fresh-result`` none, so each call returns a new array. Either way clean."""
    import gradcomm

    seen: dict[str, list] = {}
    real_fn, real_call = gradcomm.allreduce, gradcomm.Allreduce.__call__

    def fn(x, comm=None, **kw):
        seen.setdefault(f"fn{comm.rank}", []).append(kw.get("out"))
        return real_fn(x, comm, **kw)

    def call(self, x, key="default", **kw):
        seen.setdefault(f"ef{self.transport.rank}", []).append(kw.get("out"))
        return real_call(self, x, key, **kw)

    monkeypatch.setattr(gradcomm, "allreduce", fn)
    monkeypatch.setattr(gradcomm.Allreduce, "__call__", call)
    vs = [Variant("ring", "fp16", error_feedback=ef) for ef in (False, True)]
    plan = Plan(sizes=[1 << 20], variants=vs, iters=3, warmup=1, rounds=1,
                fresh_result=fresh)
    rows = run_ranks(2, lambda t: sweep(t, plan))[0]
    assert [r.wrong for r in rows] == [0, 0]
    assert sorted(seen) == ["ef0", "ef1", "fn0", "fn1"]
    for outs in seen.values():
        assert len(outs) >= 4
        if fresh:
            assert all(o is None for o in outs)
        else:
            assert outs[0] is not None and all(o is outs[0] for o in outs)
