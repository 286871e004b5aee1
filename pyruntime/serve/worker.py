"""One thread runs every generation on the one loaded Model, first come, first served.

Requests wait in a FIFO queue (a client's request is not passed by later ones, and one client
cannot hold the model between its requests), each generation runs alone on the Model (which
serializes its calls anyway, pyruntime.call_lock) and its pieces go back to the request's event
loop as they come. A request whose client went away is cancelled: still queued, it is skipped;
running, its generation is closed before the next piece is computed.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pyruntime.errors import PyruntimeError
from pyruntime.serve.protocol import Completion


@dataclass
class Counts:
    queued: int = 0
    running: int = 0
    completed: int = 0
    cancelled: int = 0
    failed: int = 0


@dataclass
class Job:
    """One generation: `start()` (run in the worker thread) returns the TextStream."""

    start: Callable[[], Any]
    prompt_tokens: int
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)  # ("piece"|"done"|"error", x)
    cancelled: threading.Event = field(default_factory=threading.Event)

    def _put(self, kind: str, value: Any) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))

    def cancel(self) -> None:
        self.cancelled.set()


class Worker:
    def __init__(self) -> None:
        self.counts = Counts()
        self._queue: queue.Queue[Job | None] = queue.Queue()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="pyruntime-generation", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        with self._lock:
            self.counts.queued += 1
        self._queue.put(job)

    def stop(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while (job := self._queue.get()) is not None:
            with self._lock:
                self.counts.queued -= 1
                self.counts.running += 1
            outcome = self._generate(job)
            with self._lock:
                self.counts.running -= 1
                setattr(self.counts, outcome, getattr(self.counts, outcome) + 1)

    def _generate(self, job: Job) -> str:
        """Run `job`; the name of the count it ends in."""
        if job.cancelled.is_set():
            return "cancelled"
        stream = None
        try:
            stream = job.start()
            for piece in stream:
                if job.cancelled.is_set():
                    break
                job._put("piece", piece)
        except PyruntimeError as exc:  # e.g. the context filled up mid-way
            job._put("error", exc)
            return "failed"
        except Exception as exc:  # a bug: the request fails, the server goes on
            job._put("error", exc)
            return "failed"
        finally:
            if stream is not None:
                stream.close()  # a cancelled generation stops here, before its next token
        if job.cancelled.is_set():
            return "cancelled"
        done = Completion(stream.text, stream.finish_reason, job.prompt_tokens,
                          len(stream.token_ids))  # fmt: skip
        job._put("done", done)
        return "completed"
