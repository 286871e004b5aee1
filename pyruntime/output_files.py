"""Files pyruntime writes (converted models, calibration tables, the demo model's cache): whole or
not at all, written beside their destination, with the mode the user's umask gives.

`atomic_output(dest)` yields a temporary path in dest's folder. When the block succeeds the file
gets the mode a plain open() would have given it (mkstemp makes 0o600) and replaces dest in one
rename, so a reader never sees half a file; when the block fails, or SIGINT or SIGTERM arrives,
the temporary file is removed. `check_writable` probes a folder before a long computation whose
result it will hold. `signals_raise()` (which atomic_output uses) makes SIGINT and SIGTERM raise
KeyboardInterrupt and Terminated, and reports an error a C extension turned one into as the
signal it was.
"""

from __future__ import annotations

import os
import signal
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path


class Terminated(BaseException):
    """SIGTERM arrived while a file was being written: raised by the handler signals_raise
    installs, so that the cleanup runs; the process should then exit with status 143."""


def default_file_mode() -> int:
    """0o666 with the process's umask applied: what open() would create."""
    try:  # Linux >= 4.7: read without changing it (os.umask is a set-and-restore, racy)
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return 0o666 & ~int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


def check_writable(folder: Path) -> None:
    """OSError (strerror set) when no file can be created in `folder`: a probe file is created
    and removed, which also catches a read-only file system, where permission bits say yes."""
    fd, name = tempfile.mkstemp(prefix=".pyruntime-probe-", dir=folder)
    os.close(fd)
    os.unlink(name)


class _RaisingHandler:
    """The handler signals_raise installs: records each signal, raises its exception."""

    def __init__(self) -> None:
        self.arrived: list[int] = []

    def __call__(self, signum: int, frame: object) -> None:
        self.arrived.append(signum)
        raise _exception(signum)

    def check(self) -> None:
        """Raise the exception of the last signal that arrived, if one did."""
        if self.arrived:
            raise _exception(self.arrived[-1])


def _exception(signum: int) -> BaseException:
    return KeyboardInterrupt() if signum == signal.SIGINT else Terminated()


@contextmanager
def signals_raise() -> Iterator[Callable[[], None]]:
    """While the block runs, SIGINT raises KeyboardInterrupt (as Python's own handler does) and
    SIGTERM raises Terminated; an exception that ends the block after one of them arrived is
    raised as that signal's (chained to it). Inside a C extension (safetensors, torch, numpy) the
    KeyboardInterrupt can come out as another error, a ValueError or a TypeError, or be lost: it
    is the interrupt all the same. An error with no signal before it passes unchanged. The block
    gets a check: called, it raises the signal's exception if one arrived (before a step that
    cannot be undone, say).

    Only in the main thread, and only for a signal no one else handles: a host application's own
    handler, or SIGINT ignored (a shell's background job), is left alone. A block inside another
    shares the outer one's handler, and what arrived during it."""
    if threading.current_thread() is not threading.main_thread():
        yield lambda: None
        return
    current = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    outer = [h for h in current.values() if isinstance(h, _RaisingHandler)]
    handler = outer[0] if outer else _RaisingHandler()
    ours = {}  # the signals this block handles, and the handler each had before
    if not outer and current[signal.SIGINT] is signal.default_int_handler:
        ours[signal.SIGINT] = current[signal.SIGINT]
    if not outer and current[signal.SIGTERM] == signal.SIG_DFL:
        ours[signal.SIGTERM] = current[signal.SIGTERM]
    for sig in ours:
        signal.signal(sig, handler)
    try:
        yield handler.check
    except Exception as exc:
        if handler.arrived:  # the error is what the signal turned into
            raise _exception(handler.arrived[-1]) from exc
        raise
    finally:
        for sig, previous in ours.items():
            signal.signal(sig, previous)


@contextmanager
def atomic_output(dest: Path) -> Iterator[Path]:
    """A temporary path beside `dest` that becomes `dest` when the block succeeds (module doc).
    Creating it raises OSError when the folder cannot be written."""
    fd, name = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        with signals_raise() as check:
            yield tmp
            check()  # a Ctrl-C a C extension turned into nothing: no rename
            tmp.chmod(default_file_mode())
            os.replace(tmp, dest)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def size_text(n: int) -> str:
    """Bytes for a message: '1.23 GB', '45.6 MB' or '789 kB' (decimal units, as disk tools
    print free space)."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6)):
        if n >= scale:
            return f"{n / scale:.{2 if unit == 'GB' else 1}f} {unit}"
    return f"{n / 1e3:.0f} kB"
