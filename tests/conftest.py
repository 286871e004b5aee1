"""Shared test setup.

TRITON_INTERPRET must be set before any Triton kernel module is imported, so it is set here.
"""

import os
from pathlib import Path

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")


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
