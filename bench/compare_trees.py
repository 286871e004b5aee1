"""Is the new tree as fast as the old one? Two revisions (or folders) of the repository, each
built on its own, benchmarked on the same random GGUF, interleaved, with the new/old ratio.

    python bench/compare_trees.py 103f4c5 main
    python bench/compare_trees.py /tmp/old /tmp/new --case cpu-decode --rounds 5 --threads 16

OLD and NEW are each a folder holding a tree (one with a pyruntime/ folder, used in place) or a
revision of the repository this script is in (checked out with `git worktree add --detach` under
WORKDIR/trees, removed at the end). On a machine without the repository's git history, make
folders elsewhere and pass those: `git archive REV | tar -x -C /tmp/old`.

Each tree's C core is built with CMake into WORKDIR/build-LABEL-* (both before anything runs: a
tree whose build fails ends the comparison with its log's last lines). The random GGUF is
made once (bench/make_random_gguf.py of this script's tree; reused when the file exists). Every
command then runs in a subprocess of its tree: the tree's root as working directory and first on
PYTHONPATH, import finders that would resolve `pyruntime` to another folder (an editable install)
removed, PYRUNTIME_CORE_LIB = its own libpyrt, PYRUNTIME_CACHE = its own folder (so each tree
profiles its GPU switch itself). The two trees never share a process, so their package layouts
may differ. Cases with --sparsity first calibrate the GGUF per tree (a symlink in the tree's
folder holds the tree's own .sparsity.json). Another run with the same --workdir reuses the
GGUF, the builds (rebuilt incrementally) and the calibrations, so long comparisons can be split
into several calls (say the GPU cases, then cpu-decode).

Rounds run old then new for each case (A B A B ...). Each figure is in tokens/s, higher is
faster; the table gives each tree's median (min-max over rounds) and new/old, the median
(min-max) of the per-round ratios, which pair runs made close in time. Exit status 1 when a build
or a run failed (a case that fails in a tree is dropped from the rounds after it).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]  # this script's tree (its GGUF maker is used)

# Runs a module (-m) or a script of the tree in sys.argv[1], after dropping meta-path finders
# that resolve `pyruntime` or `kernels` outside that tree (an editable install elsewhere puts one
# before sys.path, which PYTHONPATH alone does not override).
LAUNCHER = r"""
import importlib.machinery as m, importlib.util, os, runpy, sys
root, kind, target, *args = sys.argv[1:]
sys.path.insert(0, root)
def places(finder, name):
    try:
        spec = finder.find_spec(name, None)
    except Exception:
        return []
    if spec is None:
        return []
    return [p for p in [spec.origin, *(spec.submodule_search_locations or [])] if p]
def outside(finder):
    if finder in (m.BuiltinImporter, m.FrozenImporter, m.PathFinder):
        return False
    paths = places(finder, "pyruntime") + places(finder, "kernels")
    return any(not os.path.abspath(p).startswith(root + os.sep) for p in paths)
sys.meta_path[:] = [f for f in sys.meta_path if not outside(f)]
found = importlib.util.find_spec("pyruntime")
if found is None or not (found.origin or "").startswith(root + os.sep):
    sys.exit(f"pyruntime resolves to {found and found.origin}, not inside {root}")
sys.argv = [target, *args]
if kind == "-m":
    runpy.run_module(target, run_name="__main__", alter_sys=True)
else:
    runpy.run_path(target, run_name="__main__")
"""


def bench_json(stdout: str) -> dict[str, float]:
    """`pyruntime bench -o json`: {test name: mean tokens/s}."""
    rows = json.loads(stdout[stdout.index("[") :])
    return {row["test"]: float(row["avg_ts"]) for row in rows}


def cpu_decode_text(stdout: str) -> dict[str, float]:
    """bench/cpu_decode.py: its median step as tokens/s."""
    m = re.search(r"^decode: median ([\d.]+) ms/token", stdout, re.M)
    if m is None:
        raise ValueError("no 'decode: median ... ms/token' line in its output")
    return {"decode": 1e3 / float(m.group(1))}


@dataclass(frozen=True)
class Case:
    """One benchmark command, run alike in both trees. argv: after the launcher, "-m MODULE ..."
    or "SCRIPT ..." (relative to the tree); {model}, {shape} are filled in, and `-t N` /
    `--threads N` added when --threads is given."""

    argv: tuple[str, ...]
    parse: object  # stdout -> {figure: tokens/s}
    threads_flag: str
    calibrate: bool = False


BENCH = ("-m", "pyruntime", "bench", "{model}", "-o", "json")
CASES = {
    "gpu": Case((*BENCH, "-p", "512", "-n", "128", "-r", "3", "--device", "cuda"), bench_json,
                "-t"),
    "gpu-sparse": Case((*BENCH, "-p", "512", "-n", "128", "-r", "3", "--device", "cuda",
                        "--sparsity", "0.85"), bench_json, "-t", calibrate=True),
    **{f"gpu-pp{n}": Case((*BENCH, "-p", str(n), "-n", "0", "-r", "5", "--device", "cuda"),
                          bench_json, "-t") for n in (128, 512, 2048)},
    "cpu": Case((*BENCH, "-p", "0", "-n", "32", "-r", "3", "--device", "cpu"), bench_json, "-t"),
    "cpu-prefill": Case((*BENCH, "-p", "512", "-n", "0", "-r", "3", "--device", "cpu"), bench_json,
                        "-t"),
    "cpu-decode": Case(("bench/cpu_decode.py", "{shape}", "--gguf", "{model}", "--tokens", "64"),
                       cpu_decode_text, "--threads"),
}  # fmt: skip
CASE_HELP = {
    "gpu": "pyruntime bench -p 512 -n 128 -r 3 --device cuda: pp512, tg128",
    "gpu-sparse": "the same with --sparsity 0.85, after pyruntime calibrate",
    **{
        f"gpu-pp{n}": f"pyruntime bench -p {n} -n 0 -r 5 --device cuda: pp{n} (prefill only)"
        for n in (128, 512, 2048)
    },
    "cpu": "pyruntime bench -p 0 -n 32 -r 3 --device cpu: tg32",
    "cpu-prefill": "pyruntime bench -p 512 -n 0 -r 3 --device cpu: pp512",
    "cpu-decode": "bench/cpu_decode.py SHAPE --gguf MODEL --tokens 64: median step",
}


class CompareError(Exception):
    """A step that ends the comparison; its message is one line (or a log tail)."""


@dataclass
class Tree:
    label: str  # "old" or "new"
    spec: str  # as given on the command line
    root: Path
    rev: str | None = None  # commit checked out as a worktree by this tool, else None
    lib: Path | None = None
    failed: dict[str, str] = field(default_factory=dict)  # case -> why

    @property
    def build_name(self) -> str:
        """Its build folder's name: one per source folder (CMake keeps one source per build)."""
        tag = hashlib.sha1(str(self.root).encode()).hexdigest()[:10]
        return f"build-{self.label}-{tag}"

    def env(self, work: Path) -> dict[str, str]:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(self.root), env.get("PYTHONPATH")]))
        if self.lib is not None:
            env["PYRUNTIME_CORE_LIB"] = str(self.lib)
        env["PYRUNTIME_CACHE"] = str(work / self.label / "cache")
        env["PYTHONUNBUFFERED"] = "1"
        return env

    def describe(self) -> str:
        where = f"{self.spec} at {self.root}" if self.rev else str(self.root)
        head = ""
        if git(self.root, "rev-parse", "--show-toplevel", check=False) == str(self.root):
            head = git(self.root, "log", "-1", "--format=%h %s", check=False)[:90]
        if head and git(self.root, "status", "--porcelain", "--untracked-files=no", check=False):
            head += ", with uncommitted changes"
        return f"{self.label.upper()} = {where}" + (f" ({head})" if head else "")


def git(repo: Path, *args: str, check: bool = True) -> str:
    """git's stdout ("" on failure when not `check`, also without git installed)."""
    try:
        r = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True)
    except OSError as exc:
        if check:
            raise CompareError(f"git {' '.join(args)}: {exc}") from None
        return ""
    if r.returncode and check:
        raise CompareError(f"git {' '.join(args)}: {last_line(r.stderr)}")
    return r.stdout.strip() if r.returncode == 0 else ""


def resolve_tree(spec: str, label: str, repo: Path, work: Path) -> Tree:
    """A folder holding a tree (a pyruntime/ inside) as is, else a revision of `repo` checked
    out (detached) under work/trees."""
    path = Path(spec)
    if (path / "pyruntime").is_dir():
        return Tree(label, spec, path.resolve())
    sha = git(repo, "rev-parse", "--verify", "--quiet", f"{spec}^{{commit}}", check=False)
    if not sha:
        raise CompareError(
            f"{label.upper()} {spec!r}: neither a folder holding a tree (with pyruntime/) nor a "
            f"revision of {repo}"
        )
    dest = work / "trees" / f"{label}-{sha[:10]}"
    if not (dest.is_dir() and git(dest, "rev-parse", "HEAD", check=False) == sha):
        git(repo, "worktree", "remove", "--force", str(dest), check=False)
        shutil.rmtree(dest, ignore_errors=True)
        git(repo, "worktree", "prune")
        git(repo, "worktree", "add", "--detach", "--force", str(dest), sha)
    return Tree(label, spec, dest, rev=sha)


def build_all(trees: list[Tree], work: Path) -> None:
    """Both C cores at once, each into work/build-LABEL; CompareError with the failing one's
    log tail."""
    procs = []
    for t in trees:
        out = work / t.build_name
        out.mkdir(parents=True, exist_ok=True)
        fresh = not (out / "CMakeCache.txt").exists()
        gen = ["-G", "Ninja"] if shutil.which("ninja") and fresh else []
        configure = ["cmake", "-S", str(t.root), "-B", str(out), *gen, "-DCMAKE_BUILD_TYPE=Release"]
        build = ["cmake", "--build", str(out), "-j", str(os.cpu_count() or 2)]
        log = work / f"{t.build_name}.log"
        script = f"{_shell(configure)} && {_shell(build)}"
        with open(log, "w") as fh:
            procs.append((t, out, log, subprocess.Popen(["sh", "-c", script], stdout=fh,
                                                       stderr=subprocess.STDOUT)))  # fmt: skip
    errors = []
    for t, out, log, proc in procs:
        rc = proc.wait()
        lib = next(iter(sorted(out.glob("libpyrt.*")) + sorted(out.glob("pyrt.dll"))), None)
        if rc != 0 or lib is None:
            tail = "".join(log.read_text(errors="replace").splitlines(True)[-12:])
            errors.append(f"{t.label.upper()} ({t.spec}): the C core build failed; {log}:\n{tail}")
        t.lib = lib
    if errors:
        raise CompareError("\n".join(errors).rstrip())


def _shell(argv: list[str]) -> str:
    return " ".join("'" + a.replace("'", "'\\''") + "'" for a in argv)


def run_in(tree: Tree, work: Path, argv: list[str], timeout: float) -> subprocess.CompletedProcess:
    kind, target, *rest = argv if argv[0] == "-m" else ["script", *argv]
    cmd = [sys.executable, "-c", LAUNCHER, str(tree.root), kind, target, *rest]
    return subprocess.run(cmd, cwd=tree.root, env=tree.env(work), capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip


def last_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1][:200] if lines else "(no output)"


def make_gguf(path: Path, shape: str, outtype: str, timeout: float) -> None:
    t0 = time.perf_counter()
    tool = Tree("maker", str(HERE), HERE)
    script = ["bench/make_random_gguf.py", shape, "--outtype", outtype, "-o", str(path)]
    r = run_in(tool, path.parent, script, timeout)
    if r.returncode:
        raise CompareError(f"making {path} failed: {last_line(r.stderr)}")
    size = path.stat().st_size / 1e9
    print(f"wrote {path} ({size:.2f} GB) in {time.perf_counter() - t0:.0f} s", flush=True)


def calibrate(tree: Tree, work: Path, gguf: Path, text: Path, args) -> Path:
    """The tree's own calibration of the GGUF, through a symlink in its folder; returns it. A
    calibration newer than the GGUF, from an earlier run in the same workdir, is kept."""
    link = work / tree.label / gguf.name
    link.parent.mkdir(parents=True, exist_ok=True)
    if not link.is_symlink() or link.resolve() != gguf:
        link.unlink(missing_ok=True)
        link.symlink_to(gguf)
    done = link.with_name(link.name + ".sparsity.json")
    if done.exists() and done.stat().st_mtime > gguf.stat().st_mtime:
        return link
    argv = ["-m", "pyruntime", "calibrate", str(link), "-f", str(text), "--ctx", "256",
            "--max-tokens", "256", *threads_args("-t", args.threads)]  # fmt: skip
    r = run_in(tree, work, argv, args.timeout)
    if r.returncode:
        raise CompareError(
            f"{tree.label.upper()}: pyruntime calibrate failed: {last_line(r.stderr)}"
        )
    return link


def threads_args(flag: str, threads: int | None) -> list[str]:
    return [] if threads is None else [flag, str(threads)]


def measure(tree: Tree, work: Path, case: Case, model: Path, args) -> dict[str, float]:
    argv = [a.format(model=model, shape=args.shape) for a in case.argv]
    argv += threads_args(case.threads_flag, args.threads)
    try:
        r = run_in(tree, work, argv, args.timeout)
    except subprocess.TimeoutExpired:
        raise CompareError(f"timed out after {args.timeout:.0f} s") from None
    if r.returncode:
        raise CompareError(f"exit {r.returncode}: {last_line(r.stderr or r.stdout)}")
    try:
        return case.parse(r.stdout)
    except (ValueError, KeyError, TypeError) as exc:
        raise CompareError(f"unreadable output ({exc}): {last_line(r.stdout)}") from None


def has_gpu() -> bool:
    try:
        r = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return r.returncode == 0 and "GPU" in r.stdout


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    text = f"{cpu}, {os.cpu_count()} logical cores, load {os.getloadavg()[0]:.2f}"
    if shutil.which("nvidia-smi"):
        r = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                           capture_output=True, text=True)  # fmt: skip
        if r.returncode == 0 and r.stdout.strip():
            text += "; GPU " + ", ".join(r.stdout.split("\n")[:-1])
    return text


def spread(values: list[float], digits: int) -> str:
    if not values:
        return "-"
    f = f"{{:.{digits}f}}"
    return (
        f"{f.format(statistics.median(values))} ({f.format(min(values))}-{f.format(max(values))})"
    )


def report(samples: dict, trees: list[Tree]) -> None:
    """The summary table: per (case, figure), each tree's median (min-max) and new/old."""
    print("\n| case | figure (tokens/s) | old median (min-max) | new median (min-max) "
          "| new/old median (min-max) |\n|---|---|---|---|---|")  # fmt: skip
    for (case, fig), by_round in samples.items():
        old = [r["old"] for r in by_round if "old" in r]
        new = [r["new"] for r in by_round if "new" in r]
        ratios = [r["new"] / r["old"] for r in by_round if "old" in r and "new" in r]
        print(f"| {case} | {fig} | {spread(old, 2)} | {spread(new, 2)} | {spread(ratios, 3)} |")
    for t in trees:
        for case, why in t.failed.items():
            print(f"{t.label.upper()} failed {case}: {why}")


def default_calibration_text() -> Path:
    env = os.environ.get("PYRUNTIME_SHARED")
    shared = Path(env) if env else HERE.parent / "shared"
    text = shared / "data" / "calib-debref.txt"
    return text if text.is_file() else HERE / "README.md"


def parse_args(argv):
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="cases: " + "; ".join(f"{k}: {v}" for k, v in CASE_HELP.items())
        + ". Default: gpu and gpu-sparse where nvidia-smi finds a GPU, and cpu-decode.",
    )  # fmt: skip
    p.add_argument("old", help="folder or git revision of the old tree")
    p.add_argument("new", help="folder or git revision of the new tree")
    p.add_argument("--case", nargs="+", choices=list(CASES), help="what to run (see below)")
    p.add_argument("--rounds", type=int, default=3, help="old/new pairs per case (3)")
    p.add_argument("--shape", default="olmoe-1b-7b", help="bench/make_random_gguf.py shape")
    p.add_argument("--outtype", default="q8_0", help="GGUF weight type (q8_0)")
    p.add_argument("--gguf", type=Path, help="the model (default WORKDIR/SHAPE-OUTTYPE.gguf, "
                   "made when missing)")  # fmt: skip
    p.add_argument("--threads", type=int, help="CPU threads of every run (default: each tree's)")
    p.add_argument("--calibration-text", type=Path, default=None,
                   help="text for pyruntime calibrate (default: shared/data/calib-debref.txt "
                   "beside the repository, else its README.md)")  # fmt: skip
    p.add_argument("--workdir", type=Path, default=Path("/tmp/pyruntime-compare"))
    p.add_argument("--timeout", type=float, default=600, help="seconds per command (600)")
    p.add_argument("--keep-trees", action="store_true", help="keep the git worktrees made")
    p.add_argument("--json", type=Path, help="also write every sample here")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    args.case = args.case or ([*(["gpu", "gpu-sparse"] if has_gpu() else []), "cpu-decode"])
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    work = args.workdir.resolve()
    work.mkdir(parents=True, exist_ok=True)
    repo = Path(git(HERE, "rev-parse", "--show-toplevel", check=False) or HERE)
    trees: list[Tree] = []
    try:
        for spec, label in ((args.old, "old"), (args.new, "new")):
            trees.append(resolve_tree(spec, label, repo, work))
        return compare(trees, work, args)
    except CompareError as exc:
        print(f"compare_trees: {exc}", file=sys.stderr)
        return 1
    finally:
        for t in trees:
            if t.rev and not args.keep_trees:
                git(repo, "worktree", "remove", "--force", str(t.root), check=False)


def compare(trees: list[Tree], work: Path, args) -> int:
    t0 = time.perf_counter()
    print(f"machine: {machine()}")
    for t in trees:
        print(t.describe())
    knobs = sorted(k for k in os.environ if k.startswith(("PYRT_", "PYRUNTIME_")))
    if knobs:
        print(f"environment (passed to both trees, may act on one only): {' '.join(knobs)}")
    build_all(trees, work)
    print(f"built both C cores in {time.perf_counter() - t0:.0f} s", flush=True)
    gguf = (args.gguf or work / f"{args.shape}-{args.outtype}.gguf").resolve()
    if not gguf.exists():
        make_gguf(gguf, args.shape, args.outtype, args.timeout)
    models = {t.label: gguf for t in trees}
    if any(CASES[c].calibrate for c in args.case):
        text = args.calibration_text or default_calibration_text()
        for t in trees:
            models[t.label] = calibrate(t, work, gguf, text, args)
        print(f"calibrated both trees on {text}", flush=True)
    print(f"model: {gguf}; cases: {' '.join(args.case)}; {args.rounds} rounds", flush=True)
    samples: dict[tuple[str, str], list[dict[str, float]]] = {}
    for rnd in range(args.rounds):
        for name in args.case:
            if any(name in t.failed for t in trees):
                continue
            line = []
            for t in trees:
                try:
                    figs = measure(t, work, CASES[name], models[t.label], args)
                except CompareError as exc:
                    t.failed[name] = f"round {rnd + 1}: {exc}"
                    line.append(f"{t.label} failed ({exc})")
                    break
                for fig, value in figs.items():
                    per_round = samples.setdefault((name, fig), [])
                    per_round.extend({} for _ in range(rnd + 1 - len(per_round)))
                    per_round[rnd][t.label] = value
                line.append(f"{t.label} " + " ".join(f"{k} {v:.2f}" for k, v in figs.items()))
            print(f"round {rnd + 1}/{args.rounds} {name}: {'; '.join(line)}", flush=True)
    report(samples, trees)
    print(f"load {os.getloadavg()[0]:.2f}; {time.perf_counter() - t0:.0f} s in all")
    if args.json:
        rows = [dict(case=c, figure=f, rounds=r) for (c, f), r in samples.items()]
        failed = {t.label: t.failed for t in trees}
        args.json.write_text(json.dumps(dict(rows=rows, failed=failed), indent=1))
    return 1 if any(t.failed for t in trees) else 0


if __name__ == "__main__":
    sys.exit(main())
