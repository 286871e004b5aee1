"""The package as a user installs it: a wheel, and a machine without Triton.

kernels/ is installed as pyruntime.kernels, never as a top-level `kernels` package: that name is
Hugging Face's `kernels`, which transformers probes for (and imports) when it finds it. And a
CPU-only install must not need Triton: the CPU path imports no Triton module.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
from hf_fixtures import make_tiny_hf_model

from pyruntime.converter import convert

REPO = Path(__file__).resolve().parents[1]

# Run in a child: Triton made unimportable, then the CPU path end to end, then transformers.
NO_TRITON_SCRIPT = r"""
import importlib.abc, importlib.util, sys

class NoTriton(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)")
        return None

sys.meta_path.insert(0, NoTriton())
import pyruntime
model = pyruntime.Model(sys.argv[1], n_ctx=64, device="auto")
text = "".join(model.generate("Hello", max_tokens=4, temp=0))
assert model.device == "cpu", model.device
leaked = sorted(m for m in sys.modules if m == "triton" or m.startswith("triton."))
assert not leaked, f"the CPU path imported {leaked}"
spec = importlib.util.find_spec("kernels")
assert spec is None or spec.origin in (None, "namespace"), f"top-level kernels: {spec.origin}"
from transformers import OlmoeConfig, OlmoeForCausalLM
OlmoeForCausalLM(OlmoeConfig(num_hidden_layers=1, hidden_size=16, intermediate_size=8,
                             num_attention_heads=2, num_experts=4, num_experts_per_tok=2,
                             vocab_size=64))
print("OK", pyruntime.__file__)
"""


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("install")
    return convert(make_tiny_hf_model("olmoe", tmp / "hf"), tmp / "m.gguf", "f32", progress=False)


def run(args: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=600, **kw)


def test_cpu_path_without_triton_in_this_checkout(tiny_gguf):
    r = run([sys.executable, "-c", NO_TRITON_SCRIPT, str(tiny_gguf)], cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.startswith("OK")


def test_wheel_installs_kernels_inside_pyruntime_and_runs_without_triton(tiny_gguf, tmp_path):
    if shutil.which("cmake") is None:
        pytest.skip("building the wheel needs cmake")
    pytest.importorskip("scikit_build_core")
    build = run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                 "-w", str(tmp_path / "dist"), str(REPO)])  # fmt: skip
    assert build.returncode == 0, build.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("pyruntime-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "pyruntime/kernels/moe_dense.py" in names
    assert not [n for n in names if n.startswith("kernels/")], "a top-level kernels package"
    target = tmp_path / "site"
    inst = run([sys.executable, "-m", "pip", "install", "--no-deps", "--target", str(target),
                str(wheel)])  # fmt: skip
    assert inst.returncode == 0, inst.stderr[-3000:]
    # -S: no site processing, so no editable install's .pth puts this checkout on the path; the
    # environment's packages (torch, transformers) come after the installed wheel.
    purelib, platlib = sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(target), purelib, platlib]))
    r = run([sys.executable, "-S", "-c", NO_TRITON_SCRIPT, str(tiny_gguf)], cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split()[1].startswith(str(target)), r.stdout
