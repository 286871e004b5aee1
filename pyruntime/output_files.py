"""Files pyruntime writes (converted models, calibration tables, the demo model's cache): whole or
not at all, written beside their destination, with the mode the user's umask gives.

`atomic_output(dest)` yields a temporary path in dest's folder. When the block succeeds the file
gets the mode a plain open() would have given it (mkstemp makes 0o600) and replaces dest in one
rename, so a reader never sees half a file; when the block fails, or SIGINT or SIGTERM arrives,
the temporary file is removed. `check_writable` probes a folder before a long computation whose
result it will hold.
"""

from __future__ import annotations

import os
import signal
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


class Terminated(BaseException):
    """SIGTERM arrived while a file was being written: raised by the handler atomic_output
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


@contextmanager
def _sigterm_raises() -> Iterator[None]:
    """While the block runs, SIGTERM raises Terminated (in the main thread, and only when no
    one else handles SIGTERM: a host application's own handler is left alone)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGTERM)
    if previous not in (signal.SIG_DFL, None):
        yield
        return

    def handler(signum, frame):
        raise Terminated()

    signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextmanager
def atomic_output(dest: Path) -> Iterator[Path]:
    """A temporary path beside `dest` that becomes `dest` when the block succeeds (module doc).
    Creating it raises OSError when the folder cannot be written."""
    fd, name = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        with _sigterm_raises():
            yield tmp
            tmp.chmod(default_file_mode())
            os.replace(tmp, dest)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
