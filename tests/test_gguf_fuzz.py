"""The loader under fuzzing (issue 20): a few hundred seeded mutants of the demo model's Q8_0
GGUF, each run by the CLI (`info`, then `chat`) in its own process with a time and memory limit:
no traceback, no signal, no hang, no memory blow-up, every structural fault refused with one
`error:` line, only well-formed changes (values, tensor data) may load. The 10,000-mutant run is
`python -m pyruntime.tools.fuzz_gguf --mutants 10000 --seed N` (see its docstring)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from pyruntime.tools.fuzz_gguf import _judge
from pyruntime.tools.gguf_mutants import CLASSES, Mutant

ROOT = Path(__file__).resolve().parents[1]
MUTANTS = 400  # about 40 s with 2 jobs on 2 cores


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
