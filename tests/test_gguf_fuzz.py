"""The loader under fuzzing (issue 20): a few hundred seeded mutants of the demo model's Q8_0
GGUF, each run by the CLI (`info`, then `chat`) in its own process with a time and memory limit:
no traceback, no signal, no hang, no memory blow-up, every structural fault refused with one
`error:` line, only well-formed changes (values, tensor data) may load. The 10,000-mutant run is
`python -m pyruntime.tools.fuzz_gguf --mutants 10000 --seed N` (see its docstring).

Also (issue 20): a second corpus with the C core built with AddressSanitizer + UBSan, every read
it makes of a mutant's bytes checked; a report aborts the run (SIGABRT), judged a crash."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from pyruntime.tools.fuzz_gguf import _judge
from pyruntime.tools.gguf_mutants import CLASSES, Mutant

ROOT = Path(__file__).resolve().parents[1]
MUTANTS = 400  # about 40 s with 2 jobs on 2 cores
MUTANTS_ASAN = 150  # about 100 s with 2 jobs on 2 cores (a sanitized run is ~2x slower)


def test_mutants_are_refused_in_one_line_or_run_cleanly():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "pyruntime.tools.fuzz_gguf", "--mutants", str(MUTANTS),
           "--seed", "0", "--jobs", "2", "--json"]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)
    summary = json.loads(r.stdout)
    assert summary["failures"] == [], json.dumps(summary["failures"][:10], indent=1)
    assert r.returncode == 0
    classes = summary["classes"]
    assert set(classes) == {*CLASSES, "control"}  # every class drawn
    assert classes["control"] == {"mutants": 1, "info ran": 1, "chat ran": 1}
    assert classes["data-bitflip"].get("chat ran", 0) >= 10  # the runs really generate
    for cls in ("truncate", "duplicate-key", "nested", "offset", "tensor-type", "drop-tensor"):
        assert classes[cls]["chat refused"] == classes[cls]["mutants"], (cls, classes[cls])


def test_the_judge_sees_crashes_hangs_tracebacks_and_two_line_errors():
    m = Mutant(1, "truncate", "cut", "refuse", b"")
    one_line = "error: m.gguf: truncated file\n"
    assert _judge(m, "chat", 1 << 8, False, one_line)[0] == "ok"
    assert _judge(m, "chat", signal.SIGSEGV, False, "")[:2] == ("signal", "SIGSEGV")
    assert _judge(m, "chat", signal.SIGXCPU, False, "")[0] == "hang"
    assert _judge(m, "chat", signal.SIGKILL, True, "")[0] == "hang"
    tb = "Traceback (most recent call last):\n  ...\nValueError: x\n"
    assert _judge(m, "chat", 1 << 8, False, tb)[0] == "traceback"
    assert _judge(m, "chat", 1 << 8, False, tb.replace("ValueError", "MemoryError"))[0] == "memory"
    assert _judge(m, "chat", 1 << 8, False, "warning: x\n" + one_line)[0] == "not-one-line"
    assert _judge(m, "chat", 0, False, "")[0] == "accepted"  # a structural fault that ran
    assert _judge(m, "info", 0, False, "")[0] == "ok"  # info reads any well-formed GGUF
    assert _judge(m, "chat", 2 << 8, False, "usage: ...")[0] == "exit 2"
    control = Mutant(0, "control", "the original file", "load", b"")
    assert _judge(control, "chat", 1 << 8, False, one_line)[0] == "accepted"


def _sanitized_core(tmp_path: Path) -> dict[str, str]:
    """The environment that runs pyruntime on a C core built with ASan + UBSan: the library,
    the sanitizer runtimes preloaded (Python is not instrumented), a report aborting the run."""
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        pytest.skip("no C compiler")
    runtimes = []
    for name in ("libasan.so", "libubsan.so"):
        found = subprocess.run([compiler, f"-print-file-name={name}"], capture_output=True,
                               text=True).stdout.strip()  # fmt: skip
        if not os.path.isabs(found):
            pytest.skip(f"{compiler} has no {name}")
        runtimes.append(found)
    lib = tmp_path / "libpyrt.so"
    cmd = [compiler, "-shared", "-fPIC", "-std=c11", "-O1", "-g", "-fno-omit-frame-pointer",
           "-fsanitize=address,undefined", "-fno-sanitize-recover=all",
           f"-I{ROOT / 'runtime/include'}", f"-I{ROOT / 'runtime/src'}",
           *map(str, sorted((ROOT / "runtime/src").glob("*.c"))), "-o", str(lib), "-pthread",
           "-lm"]  # fmt: skip
    build = subprocess.run(cmd, capture_output=True, text=True)
    assert build.returncode == 0, build.stderr
    return dict(
        os.environ,
        PYTHONPATH=str(ROOT),
        PYRUNTIME_CORE_LIB=str(lib),
        LD_PRELOAD=":".join(runtimes),
        # Python and torch are not instrumented: their allocations are not leaks of ours
        ASAN_OPTIONS="detect_leaks=0:abort_on_error=1",
        UBSAN_OPTIONS="halt_on_error=1:abort_on_error=1:print_stacktrace=1",
    )


def test_mutants_under_asan_and_ubsan(tmp_path):
    env = _sanitized_core(tmp_path)
    # the sanitizers are live in that environment: a read past a buffer aborts
    overflow = ("import numpy as np; from pyruntime.cpu.core import CpuCore, _ffi; c = CpuCore(1); "
                "b = np.zeros(64, np.uint8); "
                "c._lib.pyrt_mem_read(c._pool, _ffi.from_buffer(b), 4096, _ffi.NULL)")  # fmt: skip
    r = subprocess.run([sys.executable, "-c", overflow], capture_output=True, text=True, env=env,
                       cwd=ROOT, timeout=300)  # fmt: skip
    assert r.returncode == -signal.SIGABRT and "heap-buffer-overflow" in r.stderr, r.stderr[-2000:]
    cmd = [sys.executable, "-m", "pyruntime.tools.fuzz_gguf", "--mutants", str(MUTANTS_ASAN),
           "--seed", "1", "--jobs", "2", "--json"]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=1200)
    summary = json.loads(r.stdout)
    assert summary["failures"] == [], json.dumps(summary["failures"][:10], indent=1)
    assert r.returncode == 0
    assert summary["classes"]["control"]["chat ran"] == 1
    ran = sum(c.get("chat ran", 0) for name, c in summary["classes"].items() if name != "control")
    assert ran >= 10  # mutants that load really run the sanitized core
