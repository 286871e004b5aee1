"""Shared test setup.

TRITON_INTERPRET must be set before any Triton kernel module is imported, so it is set here.
"""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")

REPO = Path(__file__).resolve().parents[1]


def _check_tested_tree() -> None:
    """The tests must import this checkout's pyruntime: an editable install of another checkout
    (its import finder runs before sys.path) would silently test that one instead."""
    import pyruntime

    found = Path(pyruntime.__file__).resolve().parents[1]
    if found != REPO:
        pytest.exit(
            f"tests of {REPO} would import pyruntime from {found}: install this checkout "
            "(pip install -e .) or run without the other editable install",
            returncode=4,
        )


_check_tested_tree()


def shared_dir() -> Path | None:
    """The workplace's shared/ folder beside the checkout (trained tiny models, texts), if any."""
    env = os.environ.get("PYRUNTIME_SHARED")
    path = Path(env) if env else Path(__file__).resolve().parents[2] / "shared"
    return path if path.is_dir() else None


@pytest.fixture(scope="session")
def shared() -> Path:
    path = shared_dir()
    if path is None:
        pytest.skip("../shared (trained checkpoints, texts) is not available")
    return path


# The C core (tests of pyruntime.cpu.core and of the C decode step)


@pytest.fixture(scope="session")
def cc() -> str:
    """The core as a module; builds libpyrt with CMake into a temp dir if no build is found."""
    from pyruntime.cpu import core as cpu_core

    try:
        cpu_core._lib()
    except cpu_core.CoreError:
        cmake = shutil.which("cmake")
        if cmake is None:
            pytest.skip("libpyrt is not built (pip install -e .) and cmake is not available")
        build = Path(os.environ.get("TMPDIR", "/tmp")) / f"pyrt-test-build-{os.getpid()}"
        subprocess.run([cmake, "-S", str(REPO), "-B", str(build)], check=True, capture_output=True)
        subprocess.run([cmake, "--build", str(build)], check=True, capture_output=True)
        os.environ["PYRUNTIME_CORE_LIB"] = str(build / "libpyrt.so")
        cpu_core._lib()
    return cpu_core


@pytest.fixture(scope="module")
def core(cc):
    """A C core of 2 threads (this machine's cores), one pool per test module."""
    from pyruntime.cpu.core import CpuCore

    with CpuCore(2) as c:
        yield c


@pytest.fixture(params=["scalar", "avx2", "avx512"])
def simd(request, cc):
    """Run the test at one SIMD level (skipped when this CPU lacks it), then restore the best."""
    level = request.param
    if cc.SIMD_LEVELS[level] > cc.SIMD_LEVELS[cc.simd_best()]:
        pytest.skip(f"this CPU has no {level}")
    cc.force_simd(level)
    yield level
    cc.force_simd(cc.simd_best())
