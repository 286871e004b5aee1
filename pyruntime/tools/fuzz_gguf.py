"""Fuzz the model loader: seeded mutants of a GGUF file, each run by the CLI in its own process
under a time and memory limit, every outcome judged.

    python -m pyruntime.tools.fuzz_gguf [--model M.gguf] [--mutants 10000] [--seed 1] [--jobs 2]

Without --model the demo model, converted to Q8_0. Mutant 0 is the file itself; the others are
one corruption each (pyruntime.tools.gguf_mutants: classes, and what a loader must do with each).
Every mutant is run twice: `pyruntime info FILE`, then `pyruntime chat FILE` with one piped line,
4 greedy tokens, one thread. Each run is a child forked from this driver, which has imported
pyruntime once (a fresh interpreter would spend a second on `import torch` per run), with
RLIMIT_AS (--memory-mib over the driver's own size) and RLIMIT_CPU, killed past --timeout.

Verdicts, per run: `traceback` (an exception escaped), `memory` (MemoryError: a blow-up stopped by
the limit), `signal` (killed by one: a crash), `hang` (past the time limit), `not-one-line` (exit 1
without exactly one `error: ` line on stderr), `exit N` (another status), `accepted` (chat ran a
file that must be refused, or refused the original). Anything else is `ok`. The exit status is 0
when every run is ok. --json prints the summary as JSON on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import sys
import tempfile
import time
import traceback
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

from pyruntime.tools.gguf_map import map_file
from pyruntime.tools.gguf_mutants import Mutant, mutant

RUNS = ("info", "chat")
CHAT_ARGS = ("-n", "4", "--temp", "0", "-t", "1", "--device", "cpu")


@dataclass
class Outcome:
    mutant: Mutant
    run: str
    verdict: str  # "ok" or a failure (module doc)
    exit: str  # "0", "1", "SIGSEGV", "timeout"
    detail: str  # the stderr line that matters
    peak_rss_mib: float


def _vm_size_bytes() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


def _child(argv: list[str], stdin: Path, out: Path, err: Path, mem: int, cpu_s: int) -> None:
    """In the forked child: limits, redirections, the CLI; never returns."""
    rc = 1
    try:
        resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
        for fd, path, flags in (
            (0, stdin, os.O_RDONLY),
            (1, out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
            (2, err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
        ):
            os.dup2(os.open(path, flags, 0o600), fd)
        from pyruntime.cli import main

        try:
            rc = main(argv)
        except SystemExit as exc:  # argparse
            rc = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # what the interpreter would print for an escaped exception
        traceback.print_exc()
        rc = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except BaseException:
                pass
        os._exit(rc)


def _judge(m: Mutant, run: str, status: int, timed_out: bool, err: str) -> tuple[str, str, str]:
    """(verdict, exit, detail) of one finished run."""
    lines = err.strip().splitlines()
    last = lines[-1] if lines else ""
    if timed_out:
        return "hang", "timeout", last
    if os.WIFSIGNALED(status):
        sig = signal.Signals(os.WTERMSIG(status)).name
        return ("hang" if sig == "SIGXCPU" else "signal"), sig, last
    rc = os.WEXITSTATUS(status)
    if "Traceback (most recent call last)" in err:
        return ("memory" if "MemoryError" in err else "traceback"), str(rc), last
    if rc == 0:
        refused_needed = run == "chat" and m.expect == "refuse"
        return ("accepted" if refused_needed else "ok"), "0", last
    if rc == 1:
        errors = [ln for ln in lines if ln.startswith("error: ")]
        if len(errors) != 1 or len(lines) != 1:
            return "not-one-line", "1", " / ".join(lines[:3])
        if m.expect == "load":
            return "accepted", "1", last  # the original file must load
        return "ok", "1", last
    return f"exit {rc}", str(rc), last


class Driver:
    """Runs the mutants' runs, `jobs` children at a time."""

    def __init__(self, model: Path, work: Path, jobs: int, timeout: float, memory_mib: int):
        self.model, self.work, self.jobs, self.timeout = model, work, jobs, timeout
        self.mem = _vm_size_bytes() + memory_mib * 2**20
        self.cpu_s = max(1, int(timeout))
        self.stdin = work / "stdin.txt"
        self.stdin.write_text("Hello.\n")
        self.running: dict[int, tuple[Mutant, str, Path, float]] = {}
        self.outcomes: list[Outcome] = []
        self._left: dict[int, int] = {}  # mutant index -> runs not finished

    def start(self, m: Mutant, run: str, path: Path) -> None:
        out, err = path.with_suffix(f".{run}.out"), path.with_suffix(f".{run}.err")
        argv = ["info", str(path)] if run == "info" else ["chat", str(path), *CHAT_ARGS]
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child(argv, self.stdin, out, err, self.mem, self.cpu_s)
        self.running[pid] = (m, run, path, time.monotonic())

    def reap(self, block: bool) -> None:
        """Judge finished children (with block: wait for one); kill those past the timeout."""
        while self.running:
            now = time.monotonic()
            for pid, (_m, _run, _path, t0) in list(self.running.items()):
                if now - t0 > self.timeout:
                    os.kill(pid, signal.SIGKILL)
            pid, status, usage = os.wait4(-1, os.WNOHANG)
            if pid == 0:
                if not block:
                    return
                time.sleep(0.002)
                continue
            m, run, path, t0 = self.running.pop(pid)
            timed_out = time.monotonic() - t0 > self.timeout
            err_path = path.with_suffix(f".{run}.err")
            err = err_path.read_text(errors="replace") if err_path.exists() else ""
            verdict, code, detail = _judge(m, run, status, timed_out, err)
            self.outcomes.append(Outcome(m, run, verdict, code, detail, usage.ru_maxrss / 1024))
            for suffix in (".out", ".err"):
                path.with_suffix(f".{run}{suffix}").unlink(missing_ok=True)
            self._left[m.index] -= 1
            if not self._left[m.index]:
                path.unlink(missing_ok=True)
            if block:
                return

    def run(self, mutants, progress: bool) -> None:
        done = 0
        for m in mutants:
            path = self.work / f"m{m.index}.gguf"
            path.write_bytes(m.data)
            m = replace(m, data=b"")  # the outcomes keep the label, not the model-sized bytes
            self._left[m.index] = len(RUNS)
            for run in RUNS:
                while len(self.running) >= self.jobs:
                    self.reap(block=False)
                    if len(self.running) >= self.jobs:
                        time.sleep(0.002)
                self.start(m, run, path)
            done += 1
            if progress and done % 500 == 0:
                bad = sum(o.verdict != "ok" for o in self.outcomes)
                print(f"[{done}] runs judged {len(self.outcomes)}, failures {bad}",
                      file=sys.stderr, flush=True)  # fmt: skip
        while self.running:
            self.reap(block=True)


def summarize(outcomes: list[Outcome], seed: int, n: int, elapsed: float) -> dict:
    by_class: dict[str, Counter] = {}
    for o in outcomes:
        c = by_class.setdefault(o.mutant.cls, Counter())
        c[f"{o.run} {'refused' if o.exit == '1' else 'ran' if o.exit == '0' else o.exit}"] += 1
        if o.run == "chat":
            c["mutants"] += 1
    failures = [
        {"mutant": o.mutant.index, "class": o.mutant.cls, "label": o.mutant.label,
         "expect": o.mutant.expect, "run": o.run, "verdict": o.verdict, "exit": o.exit,
         "detail": o.detail[:300]}
        for o in outcomes if o.verdict != "ok"
    ]  # fmt: skip
    return {
        "seed": seed,
        "mutants": n,
        "runs": len(outcomes),
        "seconds": round(elapsed, 1),
        "verdicts": dict(Counter(o.verdict for o in outcomes)),
        "peak_rss_mib": round(max((o.peak_rss_mib for o in outcomes), default=0.0), 1),
        "driver_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "classes": {k: dict(v) for k, v in sorted(by_class.items())},
        "failures": failures,
    }


def _demo_q8(work: Path) -> Path:
    import contextlib
    import io

    from pyruntime.converter import convert
    from pyruntime.tools.demo import DEMO_SOURCE

    with contextlib.redirect_stdout(io.StringIO()):
        return convert(DEMO_SOURCE, work / "demo-q8_0.gguf", "q8_0", progress=False)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pyruntime.tools.fuzz_gguf", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--model", type=Path, help="the GGUF to mutate (default: the demo, Q8_0)")
    p.add_argument("--mutants", type=int, default=300, help="mutants, the original included")
    p.add_argument("--seed", type=int, default=0, help="the mutant stream (0)")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="runs at a time")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds per run (30)")
    p.add_argument("--memory-mib", type=int, default=1024, help="address space over the driver's")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    args = p.parse_args(argv)
    # imported once, before the forks; nothing runs in this process (no tokenizer or torch
    # thread pool exists to be forked)
    import pyruntime.api  # noqa: F401
    import pyruntime.cli  # noqa: F401

    with tempfile.TemporaryDirectory(prefix="pyrt-fuzz-", dir=_scratch_dir()) as tmp:
        work = Path(tmp)
        model = args.model or _demo_q8(work)
        fm = map_file(model.read_bytes())
        driver = Driver(work=work, model=model, jobs=args.jobs, timeout=args.timeout,
                        memory_mib=args.memory_mib)  # fmt: skip
        t0 = time.perf_counter()
        driver.run((mutant(fm, args.seed, i) for i in range(args.mutants)), not args.json)
        summary = summarize(driver.outcomes, args.seed, args.mutants, time.perf_counter() - t0)
    if args.json:
        print(json.dumps(summary, indent=1))
    else:
        _print_report(summary)
    return 0 if not summary["failures"] else 1


def _scratch_dir() -> str | None:
    """tmpfs when there is one: each mutant is a model-sized file written and read twice."""
    shm = Path("/dev/shm")
    return str(shm) if shm.is_dir() and os.access(shm, os.W_OK) else None


def _print_report(s: dict) -> None:
    print(f"{s['mutants']} mutants (seed {s['seed']}), {s['runs']} runs in {s['seconds']} s; "
          f"verdicts {s['verdicts']}; peak RSS of a run {s['peak_rss_mib']} MiB (the driver's, "
          f"which each run starts from: {s['driver_rss_mib']} MiB)")  # fmt: skip
    print("| class | mutants | info refused / ran | chat refused / ran |")
    print("|---|---|---|---|")
    for cls, c in s["classes"].items():
        info = f"{c.get('info refused', 0)} / {c.get('info ran', 0)}"
        chat = f"{c.get('chat refused', 0)} / {c.get('chat ran', 0)}"
        print(f"| {cls} | {c.get('mutants', 0)} | {info} | {chat} |")
    for f in s["failures"]:
        print(f"FAIL mutant {f['mutant']} ({f['class']}: {f['label']}; expect {f['expect']}) "
              f"{f['run']}: {f['verdict']} (exit {f['exit']}): {f['detail']}")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
