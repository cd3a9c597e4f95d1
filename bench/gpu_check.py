"""GPU readiness in one command: the GPU tests, then codec timings on device arrays.

    python bench/gpu_check.py                 # < 5 min on a GPU machine
    python bench/gpu_check.py --json out.json --size 16777216 --repeat 5

1. Reports what is usable: torch CUDA, cupy (``cupy.cuda.is_available()``, not just the
   import), the GPU, and whether the loaded MPI is CUDA-aware.
2. Runs ``pytest tests/test_gpu.py`` (numpy / torch CPU / torch CUDA / cupy places).
3. Times every codec on torch CUDA and cupy arrays of ``--size`` float32: the way
   gradcomm handles a device array today (``to_flat_for`` on a host-only transport stages
   it through host memory, then encode + decode, then back to the device), next to a
   device-to-device copy and a device->host->device round trip of the same array, in the
   same run; and the codec called on the device array itself, where it accepts one.
   Rows: codec, array kind, path, ms per encode+decode round trip, x D2D copy. Also the
   staging copies of ``wrap(comm).Allreduce`` on an MPI that is not CUDA-aware
   (``_array.copy_to_host`` + ``copy_from_host`` into the same array), next to the D2D copy.

Without a GPU it says so and exits 0 after step 1 (nothing else can run).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
#: the whole script must finish well within five minutes
BUDGET_S = 270.0


def environment() -> dict:
    """What is usable on this machine."""
    from gradcomm import _array

    env: dict = {"python": sys.version.split()[0]}
    try:
        import torch

        env["torch"] = torch.__version__
        env["torch_cuda"] = _array.cuda_usable("torch")
        if env["torch_cuda"]:
            env["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        env["torch"], env["torch_cuda"] = None, False
    try:
        import cupy

        env["cupy"] = cupy.__version__
    except Exception as exc:  # not installed, or a broken CUDA install
        env["cupy"] = f"unavailable ({type(exc).__name__})"
    env["cupy_cuda"] = _array.cuda_usable("cupy")
    try:
        from gradcomm.comm.mpi import cuda_aware

        env["mpi_cuda_aware"] = cuda_aware()
    except Exception as exc:
        env["mpi_cuda_aware"] = f"unknown ({type(exc).__name__}: {exc})"
    # wrap(comm).Allreduce of a device array: in place on the device only on a CUDA-aware
    # MPI with cupy usable (uncompressed sums), else staged through host memory
    env["wrap_device_route"] = "direct" if env["mpi_cuda_aware"] is True and \
        env["cupy_cuda"] else "staged"
    return env


def run_tests(timeout: float) -> dict:
    """``pytest tests/test_gpu.py``; its summary line and exit status."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs",
           str(ROOT / "tests" / "test_gpu.py")]
    began = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        out, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:
        out, rc = (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) \
            else (exc.stdout or ""), "timeout"
    lines = [ln for ln in out.strip().splitlines() if ln.strip()]
    return {"rc": rc, "summary": lines[-1] if lines else "", "seconds":
            round(time.perf_counter() - began, 1), "output_tail": "\n".join(lines[-30:])}


def _timer(sync):
    def timed(fn, repeat: int) -> float:
        fn()                                   # warm-up (allocations, kernel compilation)
        sync()
        best = float("inf")
        for _ in range(repeat):
            t0 = time.perf_counter()
            fn()
            sync()
            best = min(best, time.perf_counter() - t0)
        return best
    return timed


def time_codecs(kind: str, n: int, repeat: int, deadline: float) -> list[dict]:
    """Rows for array ``kind`` ("torch" or "cupy"): copies first, then every codec."""
    from gradcomm import _array, compressors

    if kind == "torch":
        import torch

        x = torch.randn(n, device="cuda")
        y = torch.empty_like(x)
        sync = torch.cuda.synchronize
        d2d = lambda: y.copy_(x)                                  # noqa: E731
        d2h2d = lambda: y.copy_(x.cpu())                          # noqa: E731
    else:
        import cupy

        x = cupy.random.standard_normal(n, dtype=cupy.float32)
        y = cupy.empty_like(x)
        sync = cupy.cuda.get_current_stream().synchronize
        d2d = lambda: cupy.copyto(y, x)                           # noqa: E731
        d2h2d = lambda: y.set(cupy.asnumpy(x))                    # noqa: E731
    timed = _timer(sync)
    copy_s = timed(d2d, repeat)
    rows = [{"kind": kind, "codec": "d2d copy", "ms": copy_s * 1e3, "x_copy": 1.0},
            {"kind": kind, "codec": "d2h2d copy", "ms": timed(d2h2d, repeat) * 1e3}]
    rows[1]["x_copy"] = rows[1]["ms"] / rows[0]["ms"]

    def staged():                               # what wrap() does around a host reduction
        _array.copy_from_host(y, _array.copy_to_host(x))

    s = timed(staged, repeat)
    rows.append({"kind": kind, "codec": "wrap staging", "ms": s * 1e3, "x_copy": s / copy_s,
                 "path": "copy_to_host + copy_from_host"})
    host_only = frozenset({"cpu"})
    for name in compressors.names():
        if time.perf_counter() > deadline:
            rows.append({"kind": kind, "codec": name, "skipped": "time budget"})
            continue
        options = {"ratio": 0.01} if name in ("topk", "randomk") else {}
        try:
            codec = compressors.get(name, **options)
        except Exception as exc:
            rows.append({"kind": kind, "codec": name, "error": f"{type(exc).__name__}: {exc}"})
            continue

        def round_trip(codec=codec):
            buf, meta = _array.to_flat_for(x, host_only)          # staged, stream-synced
            out = codec.decompress(codec.compress(buf, seed=(0, 1)))
            return _array.from_device_flat(out, meta)

        def on_device(codec=codec):
            return codec.decompress(codec.compress(x, seed=(0, 1)))

        for path, fn in (("staged through host", round_trip), ("on the device", on_device)):
            try:
                s = timed(fn, repeat)
                rows.append({"kind": kind, "codec": name, "ms": s * 1e3, "x_copy": s / copy_s,
                             "path": path})
            except Exception as exc:
                rows.append({"kind": kind, "codec": name, "path": path,
                             "error": f"{type(exc).__name__}: {str(exc)[:80]}"})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", type=int, default=1 << 24, help="float32 elements (16M)")
    ap.add_argument("--repeat", type=int, default=5, help="timed repetitions (best kept)")
    ap.add_argument("--skip-tests", action="store_true", help="only the timings")
    ap.add_argument("--json", help="also write the results to this file")
    args = ap.parse_args(argv)
    began = time.perf_counter()
    deadline = began + BUDGET_S
    env = environment()
    print("environment:", ", ".join(f"{k}={v}" for k, v in env.items()))
    result: dict = {"environment": env}
    if not (env["torch_cuda"] or env["cupy_cuda"]):
        print("no GPU: torch.cuda.is_available() is False and cupy is not usable; the GPU "
              "tests would skip and there is nothing to time. Run this on a GPU machine.")
        result["gpu"] = False
    else:
        result["gpu"] = True
        if not args.skip_tests:
            tests = run_tests(timeout=min(150.0, deadline - time.perf_counter() - 60))
            result["tests"] = tests
            print(f"GPU tests (pytest tests/test_gpu.py): rc={tests['rc']} "
                  f"{tests['summary']} [{tests['seconds']} s]")
            if tests["rc"] != 0:
                print(tests["output_tail"])
        rows = []
        for kind, ok in (("torch", env["torch_cuda"]), ("cupy", env["cupy_cuda"])):
            if ok:
                rows += time_codecs(kind, args.size, args.repeat, deadline)
        result["codecs"] = rows
        print(f"\ncodec encode+decode of {args.size} float32 on the GPU "
              f"(best of {args.repeat}):")
        print(f"{'kind':>6} {'codec':>12} {'ms':>9} {'x d2d':>8}  note")
        for r in rows:
            note = " ".join(str(r[k]) for k in ("path", "error", "skipped") if k in r)
            ms = f"{r['ms']:9.3f}" if "ms" in r else f"{'-':>9}"
            xc = f"{r['x_copy']:8.1f}" if "x_copy" in r else f"{'-':>8}"
            print(f"{r['kind']:>6} {r['codec']:>12} {ms} {xc}  {note}")
    result["seconds"] = round(time.perf_counter() - began, 1)
    print(f"\ndone in {result['seconds']} s")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2, default=str))
    failed = result.get("tests", {}).get("rc", 0) not in (0,)
    return 1 if failed else 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "4")
    sys.exit(main())
