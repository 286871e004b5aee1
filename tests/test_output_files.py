"""Files pyruntime writes (issue 20): the converter's destination checks, its temporary file
beside the destination (removed on SIGINT and SIGTERM), the umask's mode; `calibrate --out` and
`--sparsity-table`; an unwritable cache folder is a warning and a fallback."""

from __future__ import annotations

import os
import shutil
import signal
import stat
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
from hf_fixtures import make_tiny_hf_model

from pyruntime import options
from pyruntime.cli import main
from pyruntime.converter import convert
from pyruntime.errors import ConversionError, PyruntimeWarning
from pyruntime.tools.demo import demo_model_path

REPO = Path(__file__).resolve().parents[1]
AS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0  # permission bits do not stop root


@pytest.fixture(scope="module")
def hf(tmp_path_factory) -> Path:
    return make_tiny_hf_model("olmoe", tmp_path_factory.mktemp("hf") / "olmoe")


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_existing_outfile_needs_force_and_inputs_are_never_overwritten(hf, tmp_path):
    out = tmp_path / "m.gguf"
    out.write_bytes(b"keep me")
    with pytest.raises(ConversionError, match="m.gguf exists; pass --force"):
        convert(hf, out, "f32", progress=False)
    assert out.read_bytes() == b"keep me"
    convert(hf, out, "f32", progress=False, force=True)
    assert out.read_bytes()[:4] == b"GGUF"
    weights = hf / "model.safetensors"
    before = weights.read_bytes()
    for target in (weights, hf / "config.json"):
        with pytest.raises(ConversionError, match="the checkpoint's own .*never writes over"):
            convert(hf, target, "f32", progress=False, force=True)
    link = tmp_path / "link.gguf"
    link.symlink_to(weights)  # through a symlink too
    with pytest.raises(ConversionError, match="checkpoint's own model.safetensors"):
        convert(hf, link, "f32", progress=False, force=True)
    assert weights.read_bytes() == before
    assert sorted(p.name for p in hf.iterdir() if p.name.startswith(".")) == []


def test_a_symlinked_outfile_replaces_its_target(hf, tmp_path):
    target = tmp_path / "real.gguf"
    target.write_bytes(b"old")
    link = tmp_path / "link.gguf"
    link.symlink_to(target)
    convert(hf, link, "f32", progress=False, force=True)
    assert link.is_symlink() and target.read_bytes()[:4] == b"GGUF"


def test_the_destination_is_checked_before_converting(hf, tmp_path, monkeypatch):
    convert_module = sys.modules["pyruntime.converter.convert"]
    read = []
    monkeypatch.setattr(convert_module, "HParams", _Recorder(read, convert_module.HParams))
    with pytest.raises(ConversionError, match="is a directory"):
        convert(hf, tmp_path, "f32", progress=False)
    with pytest.raises(ConversionError, match="output folder .* does not exist"):
        convert(hf, tmp_path / "no" / "m.gguf", "f32", progress=False)
    dev_null = tmp_path / "null.gguf"
    dev_null.symlink_to("/dev/null")
    with pytest.raises(ConversionError, match="is not a regular file"):
        convert(hf, dev_null, "f32", progress=False, force=True)

    def no_write(folder):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(convert_module, "check_writable", no_write)
    with pytest.raises(ConversionError, match=r"cannot write in .* \(Permission denied\)"):
        convert(hf, tmp_path / "m.gguf", "f32", progress=False)
    assert read == []  # refused before the checkpoint was read
    monkeypatch.undo()
    monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10, 10, 1000))
    with pytest.raises(ConversionError, match=r"needs about .* GB, and .* has 0.00 GB free"):
        convert(hf, tmp_path / "m.gguf", "f32", progress=False)
    assert list(tmp_path.iterdir()) == [dev_null]  # nothing written, no temp file


def test_a_full_disk_is_one_line_and_leaves_nothing(hf, tmp_path, monkeypatch):
    from pyruntime.converter import tensors

    def full(self, fout):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(tensors.StreamedTensor, "tofile", full)
    with pytest.raises(ConversionError, match=r"writing the GGUF failed \(No space left"):
        convert(hf, tmp_path / "m.gguf", "f32", progress=False)
    assert list(tmp_path.iterdir()) == []


class _Recorder:
    def __init__(self, log: list, real) -> None:
        self.log, self.real = log, real

    def load(self, *args):
        self.log.append(args)
        return self.real.load(*args)


@pytest.mark.skipif(AS_ROOT, reason="permission bits do not stop root")
def test_an_unwritable_folder_is_refused_before_converting(hf, tmp_path):
    folder = tmp_path / "ro"
    folder.mkdir(mode=0o500)
    with pytest.raises(ConversionError, match="cannot write in"):
        convert(hf, folder / "m.gguf", "f32", progress=False)


def test_the_umask_decides_the_mode(hf, tmp_path):
    old = os.umask(0o027)
    try:
        out = convert(hf, tmp_path / "m.gguf", "f32", progress=False)
    finally:
        os.umask(old)
    assert _mode(out) == 0o640  # mkstemp alone would give 0o600


# The child takes SIGINT as KeyboardInterrupt whatever it inherited: a shell's background job
# (`cmd &`) ignores SIGINT, a child inherits that, and Python then installs no handler.
SLOW_CONVERT = """
import signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)
sys.path.insert(0, {repo!r})
from pyruntime.converter import tensors
from pyruntime.converter.cli import main
real = tensors.StreamedTensor.tofile
def slow(self, fout):
    real(self, fout)
    time.sleep(0.05)
tensors.StreamedTensor.tofile = slow
sys.exit(main([{hf!r}, "--outfile", {out!r}, "--outtype", "f32", "--quiet"]))
"""


@pytest.mark.parametrize("sig, code, said", [(signal.SIGTERM, 143, "terminated"),
                                             (signal.SIGINT, 130, "interrupted")])  # fmt: skip
def test_a_signal_removes_the_temporary_file(hf, tmp_path, sig, code, said):
    out = tmp_path / "m.gguf"
    script = SLOW_CONVERT.format(repo=str(REPO), hf=str(hf), out=str(out))
    proc = subprocess.Popen([sys.executable, "-c", script], stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob(".m.gguf.*.tmp")):  # the temp file sits beside the output
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
        time.sleep(0.01)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == code, err
    assert f"{said}; no output written" in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> Path:
    return demo_model_path(tmp_path_factory.mktemp("cache"), quiet=True)


def test_calibrate_out_and_sparsity_table(demo, tmp_path, capsys):
    text = REPO / "docs" / "gguf-layout.md"
    table = tmp_path / "tables" / "t.json"
    assert main(["calibrate", str(demo), "-f", str(text), "--out", str(table)]) == 1
    assert "folder" in capsys.readouterr().err and not table.parent.exists()  # checked first
    table.parent.mkdir()
    assert main(["calibrate", str(demo), "-f", str(text), "-c", "256", "--out", str(table)]) == 0
    assert f"--sparsity-table {table}" in capsys.readouterr().err
    assert table.is_file() and _mode(table) == 0o666 & ~_umask()
    assert not demo.with_name(demo.name + ".sparsity.json").exists()
    argv = ["perplexity", str(demo), "-f", str(REPO / "README.md"), "--sparsity", "0.5"]
    assert main(argv) == 1  # no table beside the model
    assert main([*argv, "--sparsity-table", str(table)]) == 0
    assert "achieved" in capsys.readouterr().err


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_an_unwritable_cache_is_a_warning_and_a_fallback(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv(
        "PYRUNTIME_CACHE", str(blocker / "cache")
    )  # cannot be a folder, even for root
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        folder = options.writable_cache_dir()
    assert [w.category for w in caught] == [PyruntimeWarning]
    assert f"the cache folder {blocker / 'cache'} is not writable" in str(caught[0].message)
    monkeypatch.setenv("PYRUNTIME_CACHE", str(blocker))  # the cache named as a file
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert options.writable_cache_dir() == folder
    assert f"{blocker} is not writable (it is a file, not a folder)" in str(caught[0].message)
    st = os.lstat(folder)
    assert stat.S_ISDIR(st.st_mode) and not st.st_mode & 0o077 and os.access(folder, os.W_OK)


def test_the_cli_prints_the_cache_warning_in_one_line(tmp_path, demo):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    env = dict(os.environ, PYRUNTIME_CACHE=str(blocker / "cache"), PYTHONPATH=str(REPO))
    r = subprocess.run([sys.executable, "-m", "pyruntime", "chat", "-n", "2", "--temp", "0"],
                       input="Hi.\n", capture_output=True, text=True, env=env, cwd=REPO,
                       timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr
    warned = [ln for ln in r.stderr.splitlines() if ln.startswith("warning: ")]
    assert len(warned) == 1 and "is not writable" in warned[0], r.stderr
    assert "Traceback" not in r.stderr
