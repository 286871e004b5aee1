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
    with pytest.raises(ConversionError, match=r"needs about [0-9.]+ [kMG]B, and .* has 1 kB free"):
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
from pyruntime.cli.convert_hf import main
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


# Inside a C extension the KeyboardInterrupt of a Ctrl-C can come out as another error: safetensors
# and torch reading a tensor gave `ValueError: could not determine the shape of object type
# 'torch.storage.UntypedStorage'`, numpy's tofile `TypeError: expected str, bytes or os.PathLike
# object, not BufferedWriter`; or not at all (an extension that clears the error and carries on).
# These stand-ins send the signal while "inside" one, then do what the extension did.
_WHAT_EXTENSIONS_RAISED = {
    "ValueError": ValueError(
        "could not determine the shape of object type 'torch.storage.UntypedStorage'"
    ),
    "TypeError": TypeError("expected str, bytes or os.PathLike object, not BufferedWriter"),
}
_SIGNALS = [(signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "terminated")]
_SIGNAL_IDS = ["SIGINT", "SIGTERM"]


@pytest.fixture
def signals_on():
    """SIGINT raises KeyboardInterrupt, SIGTERM kills, as in a terminal (a suite run as a
    background job inherits SIGINT ignored, and Python then installs no handler)."""
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    yield
    for s, handler in previous.items():
        signal.signal(s, handler)


def _signal_inside_an_extension(sig: int, then: str, real=None):
    """A tofile(self, fout) that gets `sig` on its third call, loses the exception the handler
    raises as a C extension would, and then raises `then` (_WHAT_EXTENSIONS_RAISED) or, with
    then='', writes on as if nothing had happened."""
    calls = []

    def tofile(self, fout):
        calls.append(1)
        if len(calls) == 3:
            try:
                os.kill(os.getpid(), sig)
                time.sleep(5)  # the handler runs here and raises
            except BaseException:
                pass  # the extension clears the error...
            if then:  # ...and raises its own
                raise _WHAT_EXTENSIONS_RAISED[then]
        real(self, fout)

    return tofile


def _left(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


@pytest.mark.parametrize("then", ["ValueError", ""], ids=["raises", "carries_on"])
@pytest.mark.parametrize("sig, code, said", _SIGNALS, ids=_SIGNAL_IDS)
def test_convert_a_signal_inside_an_extension_is_the_signal(
    hf, tmp_path, monkeypatch, capsys, signals_on, sig, code, said, then
):
    """convert_hf_to_gguf.py: the signal, whatever the extension made of it, is reported in
    one line with its status; the existing output is untouched and no temporary file is left."""
    from pyruntime.cli.convert_hf import main as convert_main
    from pyruntime.converter import tensors

    out = tmp_path / "m.gguf"
    out.write_bytes(b"keep me")
    tofile = _signal_inside_an_extension(sig, then, tensors.StreamedTensor.tofile)
    monkeypatch.setattr(tensors.StreamedTensor, "tofile", tofile)
    argv = [str(hf), "--outfile", str(out), "--outtype", "f32", "--force", "--quiet"]
    assert convert_main(argv) == code
    assert capsys.readouterr().err == f"{said}; no output written\n"
    assert out.read_bytes() == b"keep me" and _left(tmp_path) == ["m.gguf"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # handlers put back
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def test_an_error_without_a_signal_stays_that_error(hf, tmp_path, monkeypatch, signals_on):
    """Only a signal makes an error an interrupt: a bug's ValueError passes unchanged (with its
    traceback), and the existing output is untouched."""
    from pyruntime.cli.convert_hf import main as convert_main
    from pyruntime.converter import tensors

    def broken(self, fout):
        raise ValueError("a bug")

    out = tmp_path / "m.gguf"
    out.write_bytes(b"keep me")
    monkeypatch.setattr(tensors.StreamedTensor, "tofile", broken)
    with pytest.raises(ValueError, match="a bug"):
        convert_main([str(hf), "--outfile", str(out), "--outtype", "f32", "--force", "--quiet"])
    assert out.read_bytes() == b"keep me" and _left(tmp_path) == ["m.gguf"]


@pytest.fixture(scope="module")
def lcpp(hf, tmp_path_factory) -> Path:
    """A llama.cpp-layout file (what `pyruntime repack` reads)."""
    from llamacpp_fixtures import to_llamacpp

    root = tmp_path_factory.mktemp("lcpp")
    ours = convert(hf, root / "m-q8_0.gguf", "q8_0", progress=False)
    return to_llamacpp(ours, root / "m-lcpp.gguf")


@pytest.mark.parametrize("then", ["TypeError", ""], ids=["raises", "carries_on"])
@pytest.mark.parametrize("sig, code, said", _SIGNALS, ids=_SIGNAL_IDS)
def test_repack_a_signal_inside_an_extension_is_the_signal(
    lcpp, tmp_path, monkeypatch, capsys, signals_on, sig, code, said, then
):
    """`pyruntime repack`: as the converter (numpy's tofile gave the TypeError)."""
    from pyruntime.converter import repack

    out = tmp_path / "out.gguf"
    out.write_bytes(b"keep me")
    tofile = _signal_inside_an_extension(sig, then, repack.OutTensor.tofile)
    monkeypatch.setattr(repack.OutTensor, "tofile", tofile)
    monkeypatch.setenv("PYRUNTIME_CACHE", str(tmp_path / "cache"))
    assert main(["repack", str(lcpp), "-o", str(out), "--force"]) == code
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == f"repack: {said}; no output written", err  # after tqdm's bar
    assert "Traceback" not in err
    assert out.read_bytes() == b"keep me" and _left(tmp_path) == ["out.gguf"]


# An exit callback registered before the command runs (as torch's are, at import) that gets a
# Ctrl-C: the interpreter's teardown after a command that is done.
AT_EXIT = """
import atexit, os, signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)
sys.path.insert(0, {repo!r})
def torch_exit_callback():
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.5)
    print("teardown went on", file=sys.stderr)
atexit.register(torch_exit_callback)
from {module} import main
sys.exit(main({argv!r}))
"""


@pytest.mark.parametrize("module, argv, said", [
    ("pyruntime.cli", ["repack", "no-such.gguf"], "error: no-such.gguf"),
    ("pyruntime.cli.convert_hf", ["no/such/folder", "--outfile", "x.gguf"], "error: "),
], ids=["pyruntime", "convert_hf_to_gguf"])  # fmt: skip
def test_a_ctrl_c_in_the_teardown_is_ignored(tmp_path, module, argv, said):
    script = AT_EXIT.format(repo=str(REPO), module=module, argv=argv)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       cwd=tmp_path, timeout=120)  # fmt: skip
    assert r.returncode == 1, r.stderr
    assert r.stderr.startswith(said) and r.stderr.endswith("teardown went on\n"), r.stderr
    assert len(r.stderr.splitlines()) == 2, r.stderr  # no `Exception ignored`, no traceback


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


def test_sizes_in_messages_read_at_their_scale():
    from pyruntime.output_files import size_text

    assert [size_text(n) for n in (0, 1_000, 12_345_678, 2_500_000_000)] == [
        "0 kB", "1 kB", "12.3 MB", "2.50 GB"
    ]  # fmt: skip
