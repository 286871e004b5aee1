"""One call at a time on a shared object (a Model): the lock, and its one rule for a thread
that still holds it."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from pyruntime.errors import UsageError


class CallLock:
    """One call at a time on a Model (pyruntime.api's doc). A thread whose own generation is
    still open (iterated part way, neither finished nor closed) gets a UsageError instead of
    waiting for itself forever; a generation finished in another thread releases the lock
    there (a threading.Lock, which any thread may release, not an RLock)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holder: int | None = None  # thread id of the call in progress

    @contextmanager
    def __call__(self) -> Iterator[None]:
        me = threading.get_ident()
        if self._holder == me:
            raise UsageError(
                "this thread's previous generation on this Model is still open: iterate it to "
                "the end or close() it before the next call"
            )
        with self._lock:
            self._holder = me
            try:
                yield
            finally:
                self._holder = None
