"""How many threads the C core runs (pyruntime.cpu.threads): the physical cores by default; a
request above the logical CPUs capped to them, one above the physical cores allowed; each with
one warning. The offload tier's C core is resolved the same way."""

from __future__ import annotations

import types
import warnings

import pytest

from pyruntime.cpu import core as cpu_core
from pyruntime.cpu import threads
from pyruntime.errors import PyruntimeWarning


@pytest.fixture
def machine(monkeypatch):
    """A machine of 4 physical cores and 8 CPUs (SMT), whatever this one is."""
    monkeypatch.setattr(cpu_core, "physical_cores", lambda: 4)
    monkeypatch.setattr(cpu_core, "logical_cpus", lambda: 8)


def resolve(requested):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        n = threads.resolve_threads(requested)
    return n, [str(w.message) for w in caught if issubclass(w.category, PyruntimeWarning)]


def test_default_is_the_physical_cores(machine):
    assert resolve(None) == (4, [])
    assert resolve(4) == (4, []) and resolve(1) == (1, [])


def test_more_than_the_physical_cores_is_warned(machine):
    n, said = resolve(6)
    assert n == 6 and len(said) == 1
    assert "6 threads asked for, more than the 4 physical cores" in said[0]


def test_more_than_the_cpus_is_capped(machine):
    n, said = resolve(1000)
    assert n == 8 and len(said) == 1
    assert "1000 threads asked for, but this process may run on 8 CPUs: using 8" in said[0]


def test_this_machine_counts_are_sane():
    assert 1 <= cpu_core.physical_cores() <= cpu_core.logical_cpus()


def test_the_offload_tiers_core_is_capped_and_warned(machine, monkeypatch):
    """load_hybrid makes its C core from resolve_threads, as the CPU path does."""
    from pyruntime.offload import loading

    class Made(Exception):
        pass

    seen = {}

    def executor(cfg, host, device, core, **kw):
        seen["threads"] = core.threads
        core.close()
        raise Made

    monkeypatch.setattr(loading, "HybridExecutor", executor)
    monkeypatch.setattr(loading.HostWeights, "from_gguf", staticmethod(lambda f, cfg: None))
    plan = types.SimpleNamespace(slots=1, staging_buffer=0)
    with pytest.warns(PyruntimeWarning, match="1000 threads asked for, but this process may run"):
        with pytest.raises(Made):
            loading.load_hybrid(None, None, plan, "cpu", threads=1000)
    assert seen["threads"] == 8
