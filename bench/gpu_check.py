"""GPU readiness in one command (< 5 min on a GPU machine); ``--cpu`` rehearses it anywhere.

    python bench/gpu_check.py --json gpu.json          # on a GPU machine
    python bench/gpu_check.py --cpu                    # no GPU: torch CPU tensors (CI)

1. Environment: torch CUDA, cupy (``cupy.cuda.is_available()``, not the import), the GPU,
   array-api-compat (the device kernels need it), mpirun, whether the MPI is CUDA-aware.
2. The GPU tests: the device cases (ids naming cuda / cupy / nccl) of tests/devices/:
   test_gpu.py, test_xp_quant.py, test_xp_select.py, test_codecs_on_devices.py and
   test_device_audit.py (no host syncs in the device kernels, IEEE divisions).
3. Every codec on ``--size`` float32 elements of each array kind (torch CUDA, cupy; with
   ``--cpu`` torch CPU), next to a device-to-device copy of the same array in the same
   run (ms and x that copy; best of ``--repeat``, streams synchronised around each):
   ``device``: compress(x) then decompress(payload, out=y), all on the device;
   ``wire``: the payload written to host bytes, parsed and decoded into a device out=;
   ``staged``: the old path: copy to host, host (numpy/numba) codec, copy back.
   The device payload's wire bytes must equal the host codec's on the same values.
4. ``gradcomm.allreduce(x, compressor=c)`` on 2 in-process ranks for each codec, with a
   gather and a per-hop algorithm: the device result must have the host path's bytes.
5. ``examples/ddp_train.py --device cuda --compressor int8`` in one process (an NCCL
   group; the hook's codec on the GPU): it must train (test accuracy >= 0.8).

``--cpu`` does 3-5 on torch CPU tensors through the device kernels
(``GRADCOMM_CODEC_PLACEMENT=array``), on a small size. Exit status 1 if a test, a
byte check or a codec fails. Without a GPU and without ``--cpu`` it reports step 1 only.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
#: the whole script must finish well within five minutes
BUDGET_S = 270.0
TESTS = ["tests/devices/test_gpu.py", "tests/devices/test_xp_quant.py",
         "tests/devices/test_xp_select.py", "tests/devices/test_codecs_on_devices.py",
         "tests/devices/test_device_audit.py"]
#: codecs without a device encoder (compressed_allreduce stages them through the host)
HOST_ONLY = {"powersgd"}
OPTIONS = {"topk": {"ratio": 0.01}, "randomk": {"ratio": 0.01}}
ALGORITHMS = ("allgather", "ring")             # a gather route and a per-hop one


def environment() -> dict:
    """What is usable on this machine."""
    from gradcomm import arrays

    env: dict = {"python": sys.version.split()[0]}
    for lib in ("torch", "cupy", "array_api_compat", "numba"):
        try:
            env[lib] = __import__(lib).__version__
        except Exception as exc:          # not installed, or a broken CUDA install
            env[lib] = f"unavailable ({type(exc).__name__})"
    env["torch_cuda"], env["cupy_cuda"] = arrays.cuda_usable("torch"), arrays.cuda_usable("cupy")
    if env["torch_cuda"]:
        import torch

        env["gpu"] = torch.cuda.get_device_name(0)
    env["mpirun"] = shutil.which("mpirun", path=str(Path(sys.executable).parent)) or \
        shutil.which("mpirun")
    try:
        from gradcomm.comm.mpi import cuda_aware

        env["mpi_cuda_aware"] = cuda_aware()
    except Exception as exc:
        env["mpi_cuda_aware"] = f"unknown ({type(exc).__name__}: {exc})"
    # wrap(comm).Allreduce of a device array: dense sums in place only on a CUDA-aware MPI
    # with cupy, else staged; compressed sums run their codecs on the device
    env["wrap_device_route"] = "direct" if env["mpi_cuda_aware"] is True and \
        env["cupy_cuda"] else "staged"
    return env


def run_tests(timeout: float) -> dict:
    """pytest of the device cases of :data:`TESTS`; its summary line and exit status."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
           "--timeout", "120", "-k", "cuda or cupy or nccl", *TESTS]
    began = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        out, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:
        raw = exc.stdout or ""
        out, rc = (raw.decode(errors="replace") if isinstance(raw, bytes) else raw), "timeout"
    lines = [ln for ln in out.strip().splitlines() if ln.strip()]
    return {"rc": rc, "summary": lines[-1] if lines else "", "command": " ".join(cmd[1:]),
            "seconds": round(time.perf_counter() - began, 1),
            "output_tail": "\n".join(lines[-40:])}


# -- arrays of each kind ---------------------------------------------------------------------
def reference(kind: str) -> tuple[Any, Callable[[], None]]:
    """(a one-element array of ``kind`` that others are made like, its stream sync)."""
    import torch

    if kind == "torch-cpu":
        return torch.zeros(1), lambda: None
    if kind == "torch-cuda":
        return torch.zeros(1, device="cuda"), torch.cuda.synchronize
    import cupy

    return cupy.zeros(1, cupy.float32), cupy.cuda.get_current_stream().synchronize


def best_of(fn: Callable[[], Any], sync: Callable[[], None], repeat: int) -> float:
    """Best wall time of ``fn`` in seconds, the device idle before and done after."""
    fn()                                   # warm-up: allocations, kernel compilation
    sync()
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


def time_codecs(kind: str, n: int, repeat: int, deadline: float) -> list[dict]:
    """Rows for array ``kind``: the copies, then every codec's three paths."""
    from gradcomm import arrays, compressors
    from gradcomm.compressors.base import Payload

    ref, sync = reference(kind)
    h = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    x, y = arrays.like(h, ref), arrays.like(np.empty_like(h), ref)
    copy_s = best_of(lambda: arrays.assign(y, x), sync, repeat)
    rows = [{"kind": kind, "codec": "d2d copy", "path": "copy", "ms": copy_s * 1e3,
             "x_copy": 1.0}]

    def staged_copies() -> None:           # what wrap() does around a host reduction
        arrays.copy_from_host(y, arrays.copy_to_host(x))

    s = best_of(staged_copies, sync, repeat)
    rows.append({"kind": kind, "codec": "wrap staging", "path": "d2h+h2d", "ms": s * 1e3,
                 "x_copy": s / copy_s})
    for name in compressors.names():
        row = {"kind": kind, "codec": name}
        if name in HOST_ONLY:
            rows.append({**row, "skipped": "host codec (staged by the allreduce)"})
            continue
        if time.perf_counter() > deadline:
            rows.append({**row, "skipped": "time budget"})
            continue
        try:
            c = compressors.get(name, **OPTIONS.get(name, {}))
            p = c.compress(x, seed=(0, 1))
            kinds = {arrays.kind(b) for b in p.buffers.values()}

            def device(c=c) -> Any:
                return c.decompress(c.compress(x, seed=(0, 1)), out=y)

            def wire(c=c, p=p) -> Any:
                return c.decompress(Payload.from_bytes(p.to_bytes()), out=y)

            def staged(c=c) -> None:
                host = arrays.copy_to_host(x).view(np.float32)
                arrays.copy_from_host(y, c.decompress(c.compress(host, seed=(0, 1))))

            equal = p.to_bytes().tobytes() == c.compress(h, seed=(0, 1)).to_bytes().tobytes()
            for path, fn in (("device", device), ("wire", wire), ("staged", staged)):
                s = best_of(fn, sync, repeat)
                rows.append({**row, "path": path, "ms": s * 1e3, "x_copy": s / copy_s,
                             **({"payload_kinds": sorted(kinds), "payload_bytes": p.nbytes,
                                 "equal_host": equal} if path == "device" else {})})
        except Exception as exc:
            rows.append({**row, "error": f"{type(exc).__name__}: {str(exc)[:120]}"})
    return rows


def check_allreduce(kind: str, n: int) -> list[dict]:
    """gradcomm.allreduce on 2 in-process ranks, arrays of ``kind`` against numpy arrays
    of the same values (separate runs: each starts at step 0); bytes must be equal."""
    import gradcomm
    from gradcomm import arrays, compressors
    from gradcomm.comm import run_ranks

    ref, _ = reference(kind)
    rows = []
    for name in compressors.names():
        for algorithm in ALGORITHMS:
            def fn(t: Any, on_device: bool) -> tuple[bytes, str]:
                h = np.random.default_rng(t.rank).standard_normal(n).astype(np.float32)
                x = arrays.like(h, ref) if on_device else h
                y = gradcomm.allreduce(x, t, compressor=name, algorithm=algorithm,
                                       **OPTIONS.get(name, {}))
                meta = arrays.meta_of(y)
                return arrays.copy_to_host(y).tobytes(), \
                    f"{meta.kind} {meta.device} {arrays.placement(meta, codecs=True)}"

            row: dict = {"kind": kind, "codec": name, "algorithm": algorithm}
            try:
                t0 = time.perf_counter()
                dev = run_ranks(2, lambda t: fn(t, True), timeout=60)
                row["seconds"] = round(time.perf_counter() - t0, 2)
                host = run_ranks(2, lambda t: fn(t, False), timeout=60)
                row["where"] = dev[0][1]
                row["equal_host"] = [d[0] for d in dev] == [hh[0] for hh in host]
            except Exception as exc:
                row["error"] = f"{type(exc).__name__}: {str(exc)[:120]}"
            rows.append(row)
    return rows


# -- report ----------------------------------------------------------------------------------
def print_codecs(rows: list[dict], n: int, repeat: int) -> None:
    print(f"\ncodecs on {n} float32 (best of {repeat}; ms and x a d2d copy of the array):")
    print(f"{'kind':>10} {'codec':>12} {'device':>17} {'wire':>17} {'staged':>17}  "
          "payload B  =host  note")
    cells: dict[tuple[str, str], dict] = {}
    for r in rows:
        cells.setdefault((r["kind"], r["codec"]), {})[r.get("path", "")] = r
    for (kind, codec), paths in cells.items():
        d = paths.get("device") or paths.get("copy") or paths.get("d2h+h2d") or {}
        cols = [f"{r['ms']:9.3f} {r['x_copy']:6.1f}x" if "ms" in r else f"{'-':>17}"
                for r in (d, paths.get("wire", {}), paths.get("staged", {}))]
        note = next((str(r[k]) for r in paths.values() for k in ("error", "skipped")
                     if k in r), "")
        print(f"{kind:>10} {codec:>12} {' '.join(cols)}  {d.get('payload_bytes', '-'):>9}  "
              f"{str(d.get('equal_host', '-')):>5}  {note}")


def run_example(device: str, timeout: float) -> dict:
    """``examples/ddp_train.py`` in one process on ``device`` (cuda: an NCCL group, the
    int8 codec on the GPU, its payloads over the gloo group the hook makes)."""
    cmd = [sys.executable, str(ROOT / "examples" / "ddp_train.py"), "--device", device,
           "--compressor", "int8", "--epochs", "2"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"command": " ".join(cmd[1:]), "rc": None, "error": f"timed out ({timeout} s)"}
    found = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    res = json.loads(found[-1][len("RESULT "):]) if found else {}
    row = {"command": " ".join(cmd[1:]), "rc": proc.returncode,
           "accuracy": res.get("accuracy"), "seconds": res.get("seconds")}
    if proc.returncode != 0 or (res.get("accuracy") or 0) < 0.8:
        row["error"] = (proc.stdout + proc.stderr)[-2000:]
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpu", action="store_true",
                    help="no GPU: steps 3-4 on torch CPU tensors through the device kernels")
    ap.add_argument("--size", type=int, help="float32 elements (default 16M; --cpu 64K)")
    ap.add_argument("--repeat", type=int, default=5, help="timed repetitions (best kept)")
    ap.add_argument("--skip-tests", action="store_true", help="skip step 2")
    ap.add_argument("--json", help="also write the results to this file ('-': stdout)")
    args = ap.parse_args(argv)
    n = args.size or (1 << 16 if args.cpu else 1 << 24)
    began = time.perf_counter()
    deadline = began + BUDGET_S
    env = environment()
    print("environment:", ", ".join(f"{k}={v}" for k, v in env.items()))
    gpu = bool(env["torch_cuda"] or env["cupy_cuda"])
    result: dict = {"environment": env, "gpu": gpu, "cpu_mode": args.cpu, "size": n}
    kinds = ["torch-cpu"] if args.cpu else \
        [k for k, ok in (("torch-cuda", env["torch_cuda"]), ("cupy", env["cupy_cuda"])) if ok]
    failed = []
    kernels = importlib.util.find_spec("array_api_compat") is not None
    if not kinds:
        print("no GPU: torch.cuda.is_available() is False and cupy is not usable; nothing to "
              "test or time here. Run this on a GPU machine, or with --cpu.")
    elif not kernels:
        failed.append("array_api_compat missing: the device kernels cannot run "
                      "(pip install array-api-compat)")
    if kinds and gpu and not args.cpu and not args.skip_tests:
        tests = run_tests(timeout=max(30.0, min(180.0, deadline - time.perf_counter() - 90)))
        result["tests"] = tests
        print(f"\nGPU tests (pytest {tests['command']}):\n  rc={tests['rc']} "
              f"{tests['summary']} [{tests['seconds']} s]")
        if tests["rc"] != 0 or " passed" not in tests["summary"]:
            print(tests["output_tail"])        # (all skipped: the GPU was not used)
            failed.append(f"GPU tests: rc={tests['rc']}, {tests['summary']}")
    placement = os.environ.get("GRADCOMM_CODEC_PLACEMENT")
    if args.cpu:
        os.environ["GRADCOMM_CODEC_PLACEMENT"] = "array"
    try:
        if kinds and kernels:
            checks = [r for k in kinds for r in check_allreduce(k, min(n, 1 << 22))]
            rows = [r for k in kinds for r in time_codecs(k, n, args.repeat, deadline)]
            result["codecs"], result["allreduce"] = rows, checks
            print_codecs(rows, n, args.repeat)
            print(f"\ngradcomm.allreduce on 2 in-process ranks, {min(n, 1 << 22)} float32: "
                  "device result bytes == host path's")
            for r in checks:
                print(f"{r['kind']:>10} {r['codec']:>9} {r['algorithm']:>9}: "
                      f"{r.get('equal_host', r.get('error'))}  [{r.get('where', '')}]")
            failed += [f"{r['kind']} {r['codec']} {r.get('path', r.get('algorithm'))}: "
                       f"{r.get('error', 'bytes differ from the host path')}"
                       for r in rows + checks if "error" in r or r.get("equal_host") is False]
        if kernels and (args.cpu or env["torch_cuda"]):
            ex = run_example("cpu" if args.cpu else "cuda",
                             max(20.0, min(120.0, deadline - time.perf_counter())))
            result["example"] = ex
            print(f"\nexample: {ex['command']}: rc={ex['rc']} accuracy={ex.get('accuracy')} "
                  f"[{ex.get('seconds')} s]")
            if "error" in ex:
                failed.append(f"example: {ex['error']}")
    finally:
        if placement is None:
            os.environ.pop("GRADCOMM_CODEC_PLACEMENT", None)
        else:
            os.environ["GRADCOMM_CODEC_PLACEMENT"] = placement
    result["failed"] = failed
    result["seconds"] = round(time.perf_counter() - began, 1)
    print("\n" + ("FAILED:\n  " + "\n  ".join(failed) if failed else "all checks passed") +
          f"\ndone in {result['seconds']} s")
    if args.json:
        text = json.dumps(result, indent=2, default=str)
        print(text) if args.json == "-" else Path(args.json).write_text(text)
    return 1 if failed else 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "4")
    sys.exit(main())
