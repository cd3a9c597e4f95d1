"""Mutation testing: plant known faults, one per scratch copy, and see which checks catch them.

Each mutant is a small textual patch (one search/replace per source line, the search text
found exactly once, else the run stops: the line moved and the mutant must be updated).
It is applied to a scratch copy of the working tree (tracked and untracked files; not
``.git`` or ``.venv``), so the tree itself is never modified; the mutant's checks (fast,
relevant tests and the benchmark, each a subprocess in the copy) run there. A check that
fails or times out caught the fault. The table lists fault -> checks; the exit status is 1
if any fault survived every check, 2 if a check fails on the unmutated copy (baseline).

    python bench/mutate.py                       # everything (~15 min on 2 cores)
    python bench/mutate.py --list                # mutants, their checks, the commands
    python bench/mutate.py --only ring-misplaced,ef-forgets --checks conformance
    python bench/mutate.py --verify              # every patch still applies (no runs)

Checks whose test file does not exist in the tree are shown as ``n/a`` and not run.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Patch:
    """Replace ``old`` (found exactly once in ``path``) with ``new``."""

    path: str
    old: str
    new: str


@dataclass(frozen=True)
class Mutant:
    """A planted fault: a name, what it does, its patches and the checks that should catch it."""

    name: str
    what: str
    patches: tuple[Patch, ...]
    checks: tuple[str, ...]


class MutantError(RuntimeError):
    """A patch does not apply to the current source (its line moved or changed)."""


def _pytest(*args: str) -> tuple[str, ...]:
    return (sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *args)


def _bench(p: int) -> tuple[str, ...]:
    return (sys.executable, "-m", "gradcomm.bench", "--transport", "threads", "--np", str(p),
            "--sizes", "12K,120K", "--algorithms", "ring,tree,recursive_doubling,rabenseifner",
            "--compressors", "none,fp16,int8,onebit,randomk:ratio=0.1,topk:ratio=0.1",
            "--iters", "3", "--warmup", "1", "--min-iters", "2", "--no-progress")


#: check name -> command (run in the scratch copy); a test file missing there: n/a
CHECKS: dict[str, tuple[str, ...]] = {
    "conformance": _pytest("tests/collectives/test_conformance.py"),
    "compressed": _pytest("tests/compressed/test_allreduce.py"),
    "replay": _pytest("tests/bench/test_replay.py"),
    "codecs": _pytest("tests/compressors/test_codecs.py", "tests/compressors/test_properties.py"),
    "error_feedback": _pytest("tests/error_feedback/test_feedback.py",
                              "tests/error_feedback/test_keyed.py"),
    "powersgd": _pytest("tests/compressed/test_powersgd.py",
                        "tests/compressors/test_powersgd_codec.py"),
    "planned": _pytest("tests/compressed/test_planned.py"),
    "planned_pipeline": _pytest("tests/compressed/test_planned_pipeline.py"),
    "ddp_cast": _pytest("tests/integrations/ddp/test_ddp_cast.py"),
    "ddp_adam": _pytest("tests/integrations/ddp/test_ddp_adam.py"),
    "ddp_exact": _pytest("tests/integrations/ddp/test_ddp_hook.py", "-k",
                         "independent_reduction"),
    "bench_p3": _bench(3),
    "bench_p4": _bench(4),
}

_DENSE = ("conformance", "compressed", "replay", "bench_p3", "bench_p4")
_CODEC = ("codecs", "compressed", "replay", "bench_p3", "bench_p4")
_EF = ("error_feedback", "compressed", "replay", "ddp_exact", "bench_p3", "bench_p4")
_SEED = ("codecs", "compressed", "replay")
_FOLD = ("conformance", "compressed", "replay", "bench_p3")
_SEGMENTS = "gradcomm/collectives/_segments.py"
_TREE = "gradcomm/collectives/tree.py"
_RD = "gradcomm/collectives/recursive_doubling.py"
_RAB = "gradcomm/collectives/rabenseifner.py"
_DDP_ROUTES = "gradcomm/integrations/ddp/routes.py"
_SEEDS = "gradcomm/compressed/seeds.py"
_CAST = "gradcomm/integrations/ddp/cast.py"
_ADAM = "gradcomm/integrations/ddp/adam.py"

MUTANTS: tuple[Mutant, ...] = (
    # -- a misplaced segment in each dense algorithm
    Mutant("ring-misplaced", "ring allgather: each arriving finished segment lands one "
           "segment too early (silent when p divides n)",
           (Patch(_SEGMENTS, "(rank - s - 1) % p if s < p - 1 else (rank - s + p - 1) % p",
                  "(rank - s - 1) % p if s < p - 1 else (rank - s + p - 2) % p"),),
           _DENSE),
    Mutant("tree-misplaced", "tree broadcast: chunks land in reverse order (silent when "
           "the chunks have equal sizes)",
           (Patch(_TREE, "jobs += [(False, lo, hi, up) for lo, hi in pieces]",
                  "jobs += [(False, lo, hi, up) for lo, hi in pieces[::-1]]"),),
           _DENSE),
    Mutant("recursive_doubling-misplaced", "recursive doubling: the partner's buffer is "
           "combined element-reversed",
           (Patch(_RD, "w.reduce(tmp, buf, peer < rank)",
                  "w.reduce(tmp[::-1], buf, peer < rank)"),),
           _DENSE),
    Mutant("rabenseifner-misplaced", "Rabenseifner halving: the partner's half is folded into "
           "the half sent away, not the one kept",
           (Patch(_RAB, "w.reduce(landing, seg, peer < rank)",
                  "w.reduce(landing, other, peer < rank)"),),
           _DENSE),
    # -- a codec that encodes or decodes zeros
    Mutant("fp16-encodes-zeros", "fp16 payload values are all zeros",
           (Patch("gradcomm/compressors/fp16.py",
                  '        return Payload(self.name, {"n": n, "dt": dtype_code(dt)}, {"v": v})',
                  '        v[...] = 0\n'
                  '        return Payload(self.name, {"n": n, "dt": dtype_code(dt)}, {"v": v})'),),
           _CODEC),
    Mutant("int8-decodes-zeros", "int8 decodes (and decode-adds) zeros",
           (Patch("gradcomm/compressors/int8.py",
                  "        return _kernels.f32_finish(tmp, out, k, add)",
                  "        tmp[...] = 0\n        return _kernels.f32_finish(tmp, out, k, add)"),),
           _CODEC),
    Mutant("planned-adds-stale", "the planned gathered route decode-adds rank 0's payload "
           "onto the input instead of writing it (the sum keeps this rank's own input)",
           (Patch("gradcomm/compressed/planned.py",
                  "self.cplan.decode(self._views(b), x, r > 0)",
                  "self.cplan.decode(self._views(b), x, True)"),),
           ("planned", "ddp_exact")),
    Mutant("pieces-sum-reversed", "the pieced planned route sums each piece's frames from "
           "rank p-1 down (the bytes change from 3 ranks on: float addition's order)",
           (Patch("gradcomm/compressed/planned_pipeline.py",
                  "blocks = [frame(done, r)[:g.size] for r in range(p)]",
                  "blocks = [frame(done, r)[:g.size] for r in reversed(range(p))]"),),
           ("planned_pipeline",)),
    Mutant("planned-flags-silent", "the planned routes send no guard flags (a NaN or "
           "runaway residual on one rank goes unseen by the others)",
           (Patch("gradcomm/compressed/planned.py",
                  "    return guard.flags(key, float(tally[0]))",
                  "    return False, False"),),
           ("planned", "planned_pipeline")),
    Mutant("pieces-vote-own", "each rank cuts into pieces on its own vote, not on every "
           "rank's (ranks may then run different routes)",
           (Patch("gradcomm/compressed/planned.py",
                  "self.pieces_pay = all(b[size + 2] for b in blocks)",
                  "self.pieces_pay = bool(blocks[t.rank][size + 2])"),),
           ("planned",)),
    Mutant("cast-flags-silent", "the DDP cast route (fp16/bf16 on gloo) sums zero guard "
           "flags (one rank's runaway residual goes unseen by the others)",
           (Patch(_CAST, "                    flags = guard.flags(key, e2)",
                  "                    flags = (False, False)"),),
           ("ddp_cast",)),
    Mutant("cast-result-unchecked", "the cast route does not check the summed result for "
           "non-finite values (an overflowing float16 sum passes as a clean step)",
           (Patch(_CAST, "                finite = _kernels.for_array(bits).finite16(bits[a:b], "
                  "name == \"bf16\")", "                finite = True"),),
           ("ddp_cast",)),
    Mutant("cast-cut-local", "each rank takes the cast route's cut from its own timings, "
           "not the summed votes (ranks may issue different numbers of library calls)",
           (Patch(_CAST, "cut.record(time.perf_counter() - began, float(counts[2]), t.size)",
                  "cut.record(time.perf_counter() - began, cut.vote() * t.size, t.size)"),),
           ("ddp_cast",)),
    Mutant("cast-input-norm-wrong", "the cast route's guard scale is the new residual's "
           "norm, not the input's (a runaway residual measured against itself)",
           (Patch(_CAST, "            g2 = float(tally[2])", "            g2 = float(tally[0])"),),
           ("ddp_cast",)),
    Mutant("adam-own-step-too", "the hook's Adam route leaves the gradients in place, so "
           "the user's Adam also steps on each rank's local gradient (ranks drift apart)",
           (Patch(_ADAM, "            p.grad = None            # the optimizer's own update "
                  "skips them", "            pass"),),
           ("ddp_adam",)),
    Mutant("adam-resume-residual-lost", "a checkpoint's momentum residuals are not given to "
           "the Adam route it resumes (the resumed run drifts from the unbroken one)",
           (Patch(_ADAM, "            self.route.load(self.saved)", "            pass"),),
           ("ddp_adam",)),
    Mutant("cast-residual-dropped", "the cast route's fused pass encodes x without the "
           "residual (error feedback silently off on the hook's 16-bit route)",
           (Patch(_CAST, "                residual=residual[a:b] if fused else None,",
                  "                residual=None,"),),
           ("ddp_cast",)),
    # -- error feedback that forgets its residual
    Mutant("ef-forgets", "ErrorFeedback.residual hands out fresh zeros every call (the "
           "residual written last step is never added back)",
           (Patch("gradcomm/error_feedback/store.py", "    dt = np.dtype(dtype)\n    e = table.get(name)\n",
                  "    dt = np.dtype(dtype)\n    e = None\n"),),
           _EF),
    # -- a 'shared' seed that differs across ranks
    Mutant("randomk-unshared", "randomk declares its seed unshared: the collectives add "
           "the rank, positions differ across ranks",
           (Patch("gradcomm/compressors/randomk.py",
                  '    name = "randomk"\n    reduction = "summable"\n    shared_seed = True',
                  '    name = "randomk"\n    reduction = "summable"\n    shared_seed = False'),),
           _SEED),
    Mutant("shared-seed-per-rank", "compressed allreduce adds the rank to shared seeds "
           "(whole buffers and partial hops: randomk's positions differ across ranks)",
           (Patch(_SEEDS, "return self.base if self.shared else (*self.base, self.rank)",
                  "return (*self.base, self.rank)"),
            Patch(_SEEDS, "        if self.shared:\n            return (*self.base, off, n)\n"
                  "        return (*self.base, self.rank, 1, hop, off, n)",
                  "        if self.shared:\n            return (*self.base, self.rank, off, n)\n"
                  "        return (*self.base, self.rank, 1, hop, off, n)")),
           _SEED),
    Mutant("powersgd-projection-per-rank", "PowerSGD's random start Q is drawn from "
           "seed + rank (not shared)",
           (Patch("gradcomm/compressed/allreduce.py",
                  "powersgd.start(codec, parts, residuals, seed, step,",
                  "powersgd.start(codec, parts, residuals, seed + t.rank, step,"),),
           ("powersgd", "replay")),
    # -- a fold that drops one rank's contribution at a non-power-of-two p
    Mutant("tree-drops-last-rank", "tree reduce skips rank p-1's partial when p is not a "
           "power of two",
           (Patch(_TREE, "            w.reduce(landing, seg, peer < rank)",
                  "            if not (p & (p - 1)) or peer != p - 1:\n"
                  "                w.reduce(landing, seg, peer < rank)"),),
           _FOLD),
    Mutant("fold-drops-rank0", "the non-power-of-two fold (recursive doubling, Rabenseifner): "
           "rank 1 ignores rank 0's buffer",
           (Patch("gradcomm/collectives/_fold.py", "                w.reduce(tmp, buf, True)",
                  "                if rank != 1:\n                    w.reduce(tmp, buf, True)"),),
           _FOLD),
    # -- the DDP hook (its own arithmetic; tests/integrations/scripts/ddp_checks.py 'exact')
    Mutant("ddp-returns-zeros", "the compressed DDP hook returns zeros and keeps the whole "
           "bucket in its residuals",
           (Patch(_DDP_ROUTES,
                  "            result = self._compressed(view, plan, keys, lengths, check, step)",
                  "            result = 0 * self._compressed(view, plan, keys, lengths, check, step)"),
            Patch("gradcomm/error_feedback/keyed.py",
                  "        lay.backend.subtract(x, decoded, lay.flat)",
                  "        lay.backend.subtract(x, 0 * decoded, lay.flat)")),
           ("ddp_exact",)),
    Mutant("ddp-forgets-residual", "the DDP hook never adds a parameter's residual back",
           (Patch("gradcomm/error_feedback/keyed.py", "            x[a:b] += lay.flat[a:b]\n",
                  "            pass\n"),
            Patch("gradcomm/error_feedback/keyed.py", "        if kept:\n            x[a:b] += e\n",
                  "        if kept:\n            pass\n")),
           ("ddp_exact", "error_feedback")),
    Mutant("ddp-device-route-unscaled", "the hook's device route (CUDA buckets; CPU ones "
           "under GRADCOMM_CODEC_PLACEMENT=array) reduces g / (2p), not g / p",
           (Patch(_DDP_ROUTES, "        work.mul_(1.0 / self.transport.size)",
                  "        work.mul_(0.5 / self.transport.size)"),),
           ("ddp_exact",)),
)


# -- applying ------------------------------------------------------------------------------
def patched(text: str, patch: Patch, mutant: str) -> str:
    """``text`` with ``patch`` applied; MutantError unless its search text occurs once."""
    count = text.count(patch.old)
    if count != 1:
        raise MutantError(f"mutant {mutant!r}: {patch.path} holds {count} copies of "
                          f"{patch.old!r} (expected exactly one): update the mutant")
    return text.replace(patch.old, patch.new)


def apply(root: Path, mutant: Mutant) -> None:
    """Apply every patch of ``mutant`` to the tree at ``root`` (all or nothing)."""
    texts: dict[str, str] = {}
    for patch in mutant.patches:
        path = root / patch.path
        if not path.is_file():
            raise MutantError(f"mutant {mutant.name!r}: no file {patch.path}")
        texts[patch.path] = patched(texts.get(patch.path, path.read_text()), patch,
                                    mutant.name)
    for rel, text in texts.items():
        compile(text, rel, "exec")                  # a mutant must still be Python
        (root / rel).write_text(text)


def verify(root: Path = ROOT) -> list[str]:
    """Problems with the mutants against the source at ``root`` (empty: all apply)."""
    problems = []
    for m in MUTANTS:
        for c in m.checks:
            if c not in CHECKS:
                problems.append(f"mutant {m.name!r}: unknown check {c!r}")
        texts: dict[str, str] = {}
        try:
            for patch in m.patches:
                text = texts.get(patch.path, (root / patch.path).read_text())
                texts[patch.path] = patched(text, patch, m.name)
            for rel, text in texts.items():
                compile(text, rel, "exec")
        except (MutantError, OSError, SyntaxError) as exc:
            problems.append(str(exc))
    return problems


def scratch_copy(dest: Path, root: Path = ROOT) -> Path:
    """Copy the working tree at ``root`` to ``dest`` (not .git, .venv; mtimes kept, so
    numba's kernel cache in __pycache__ stays valid)."""
    skip = {".git", ".venv", ".pytest_cache", "bench/out"}

    def keep(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
        rel = info.name.split("/", 1)[1] if "/" in info.name else ""
        return None if any(rel == s or rel.startswith(s + "/") for s in skip) else info

    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryFile() as f:
        with tarfile.open(fileobj=f, mode="w") as tar:
            tar.add(root, arcname="tree", filter=keep)
        f.seek(0)
        with tarfile.open(fileobj=f, mode="r") as tar:
            tar.extractall(dest, filter="tar")
    return dest / "tree"


# -- running -------------------------------------------------------------------------------
def _env(root: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"PYTHONPATH": os.pathsep.join([str(root), *filter(None, [env.get("PYTHONPATH")])]),
                "OMP_NUM_THREADS": "1", "GRADCOMM_PROFILE": "none", "PYTHONDONTWRITEBYTECODE": "1"})
    return env


def available(root: Path, check: str) -> bool:
    """Whether every test file ``check`` names exists at ``root``."""
    files = [a for a in CHECKS[check] if a.startswith("tests/")]
    return all((root / f).is_file() for f in files)


def run_check(root: Path, check: str, timeout: float) -> tuple[str, float, str]:
    """Run ``check`` in ``root``: (``"pass"``/``"fail"``/``"timeout"``, seconds, the
    output's tail)."""
    began = time.perf_counter()
    proc = subprocess.Popen(CHECKS[check], cwd=root, env=_env(root), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        status = "pass" if proc.returncode == 0 else "fail"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)          # the check and everything it started
        out, _ = proc.communicate()
        status = "timeout"
    return status, time.perf_counter() - began, out[-4000:]


def reason(tail: str) -> str:
    """The first FAILED/ERROR line of a pytest tail, else its last non-empty line."""
    for line in tail.splitlines():
        if re.match(r"(FAILED|ERROR) ", line):
            return line[:160]
    lines = [ln for ln in tail.splitlines() if ln.strip()]
    return lines[-1][:160] if lines else ""


def table(rows: list[tuple[str, dict[str, str]]], checks: list[str]) -> str:
    """Fault x check: ``caught`` (the check failed), ``missed`` (passed), ``n/a``, ``-``
    (not one of the fault's checks), then whether the fault survived; the baseline row
    ``(none)`` (the unmutated copy) shows ``ok`` or ``FAIL``."""
    w = max([len(n) for n, _ in rows] + [5])
    head = f"{'fault':<{w}}  " + "  ".join(f"{c:>{max(len(c), 7)}}" for c in checks) + "  verdict"
    lines = [head, "-" * len(head)]
    for name, cells in rows:
        marks = {"fail": "caught", "timeout": "caught*", "pass": "missed"} \
            if name != "(none)" else {"fail": "FAIL", "timeout": "TIMEOUT", "pass": "ok"}
        row = [f"{marks.get(cells.get(c, '-'), cells.get(c, '-')):>{max(len(c), 7)}}"
               for c in checks]
        ran = [v for v in cells.values() if v in ("fail", "timeout", "pass")]
        verdict = "baseline" if name == "(none)" else \
            ("KILLED" if any(v != "pass" for v in ran) else "SURVIVED")
        lines.append(f"{name:<{w}}  " + "  ".join(row) + f"  {verdict}")
    lines.append("caught* = timed out")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", help="comma-separated mutant names")
    ap.add_argument("--checks", help="comma-separated checks to run (default: each "
                    "mutant's own)")
    ap.add_argument("--timeout", type=float, default=300, help="seconds per check (300)")
    ap.add_argument("--list", action="store_true", help="list mutants and checks, run nothing")
    ap.add_argument("--verify", action="store_true", help="only check that every patch applies")
    ap.add_argument("--no-baseline", action="store_true",
                    help="skip running the checks on the unmutated copy first")
    ap.add_argument("--keep", action="store_true", help="keep the scratch copies")
    ap.add_argument("--log", type=Path, help="write each check's output tail here")
    args = ap.parse_args(argv)

    problems = verify()
    if problems:
        print("\n".join(problems), file=sys.stderr)
        return 2
    if args.verify:
        print(f"{len(MUTANTS)} mutants apply to {ROOT}")
        return 0
    if args.list:
        for m in MUTANTS:
            print(f"{m.name}: {m.what}\n    checks: {', '.join(m.checks)}")
        for c, cmd in CHECKS.items():
            print(f"{c}: {' '.join(cmd[1:] if cmd[0] == sys.executable else cmd)}")
        return 0
    chosen = [m for m in MUTANTS if not args.only or m.name in args.only.split(",")]
    if args.only and len(chosen) != len(set(args.only.split(","))):
        ap.error(f"unknown mutant in {args.only!r}; known: {', '.join(m.name for m in MUTANTS)}")
    only_checks = args.checks.split(",") if args.checks else None
    if only_checks and any(c not in CHECKS for c in only_checks):
        ap.error(f"unknown check in {args.checks!r}; known: {', '.join(CHECKS)}")

    def checks_of(m: Mutant) -> list[str]:
        return [c for c in m.checks if only_checks is None or c in only_checks]

    columns = [c for c in CHECKS if any(c in checks_of(m) for m in chosen)]
    if args.log:
        args.log.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="gradcomm-mutate-"))
    rows: list[tuple[str, dict[str, str]]] = []
    notes: list[str] = []
    began = time.perf_counter()
    try:
        pristine = scratch_copy(work / "pristine")  # one snapshot: the tree may change
        plan: list[Mutant | None] = ([] if args.no_baseline else [None]) + chosen
        for i, m in enumerate(plan):
            name = "(none)" if m is None else m.name
            root = work / f"{i:02d}" / "tree"
            shutil.copytree(pristine, root, symlinks=True)     # copy2: mtimes kept
            if m is not None:
                apply(root, m)
            cells: dict[str, str] = {}
            for c in (columns if m is None else checks_of(m)):
                if not available(root, c):
                    cells[c] = "n/a"
                    continue
                status, secs, tail = run_check(root, c, args.timeout)
                cells[c] = status
                print(f"[{time.perf_counter() - began:6.0f} s] {name}: {c} {status} "
                      f"({secs:.0f} s)", flush=True)
                if status != "pass":
                    notes.append(f"{name} / {c}: {reason(tail)}")
                if args.log:
                    (args.log / f"{name}.{c}.txt").write_text(tail)
            rows.append((name, cells))
            if not args.keep:
                shutil.rmtree(root.parent, ignore_errors=True)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print()
    print(table(rows, columns))
    if notes:
        print("\nfirst failure of each catching check:")
        print("\n".join(f"  {n}" for n in notes))
    base = dict(rows).get("(none)", {})
    if any(v != "pass" and v != "n/a" for v in base.values()):
        print("\nbaseline: a check fails on the unmutated tree; the table means nothing",
              file=sys.stderr)
        return 2
    survived = [n for n, cells in rows if n != "(none)" and
                not any(v in ("fail", "timeout") for v in cells.values())]
    print(f"\n{len(rows) - (0 if args.no_baseline else 1) - len(survived)} killed, "
          f"{len(survived)} survived{': ' + ', '.join(survived) if survived else ''} "
          f"({time.perf_counter() - began:.0f} s)")
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
