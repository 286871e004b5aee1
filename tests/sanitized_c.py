"""Build one C test program of tests/c/ with the whole C core under ASan + UBSan and run it
(LSan on): the shared body of the C-core tests that check their paths under the sanitizers."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def run_sanitized_c_test(tmp_path: Path, name: str, passed: str) -> None:
    """Compile tests/c/{name}.c with runtime/src/*.c (-fsanitize=address,undefined, -Werror),
    run it, and check it exits 0 and prints `passed`; skip without a compiler or sanitizers."""
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        pytest.skip("no C compiler")
    sources = [*sorted((REPO / "runtime" / "src").glob("*.c")), REPO / f"tests/c/{name}.c"]
    exe = tmp_path / name
    cmd = [compiler, "-std=c11", "-O1", "-g", "-fno-omit-frame-pointer"]
    cmd += ["-fsanitize=address,undefined", "-fno-sanitize-recover=all"]
    cmd += ["-Wall", "-Wextra", "-Werror", f"-I{REPO / 'runtime/include'}"]
    cmd += [f"-I{REPO / 'runtime/src'}", *map(str, sources), "-o", str(exe), "-pthread", "-lm"]
    build = subprocess.run(cmd, capture_output=True, text=True)
    if build.returncode != 0 and "sanitize" in build.stderr and "unrecognized" in build.stderr:
        pytest.skip(f"{compiler} has no ASan/UBSan")
    assert build.returncode == 0, build.stderr
    env = {**os.environ, "ASAN_OPTIONS": "detect_leaks=1"}
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120, env=env)
    assert run.returncode == 0, run.stdout + run.stderr
    assert passed in run.stdout
