"""One generation as a stream of text: decode loop, stop conditions, streaming, timings.

`TextStream` is one generation: iterate it for text pieces; afterwards `finish_reason`,
`token_ids` and `stats` describe what happened.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

from pyruntime.decoding.plain import DecodingStrategy, PromptStats, plain_decoding
from pyruntime.decoding.sampling import Sampler
from pyruntime.decoding.session import Session
from pyruntime.errors import UsageError
from pyruntime.options import check_kind
from pyruntime.text.tokenizer import IncrementalDetokenizer, Tokenizer


class StopStrings:
    """Cuts streamed text at the first stop string, holding back text that may start one."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self._pending = ""

    def push(self, text: str) -> tuple[str, bool]:
        """Returns (text safe to emit, whether a stop string was hit). After a hit, stop."""
        self._pending += text
        if not self.stops:
            out, self._pending = self._pending, ""
            return out, False
        hits = [i for i in (self._pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            out = self._pending[: min(hits)]
            self._pending = ""
            return out, True
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self._pending)), hold, -1):
                if self._pending.endswith(s[:k]):
                    hold = k
                    break
        cut = len(self._pending) - hold
        out, self._pending = self._pending[:cut], self._pending[cut:]
        return out, False

    def flush(self) -> str:
        out, self._pending = self._pending, ""
        return out


@dataclass
class GenerationStats:
    """Counts and wall-clock seconds of one generation (consumer time between pieces excluded)."""

    prompt_tokens: int = 0  # tokens in the prompt
    prompt_evaluated: int = 0  # of those, run through the model (the rest came from the cache)
    prompt_seconds: float = 0.0
    generated_tokens: int = 0  # sampled tokens, including a final stop token
    generation_seconds: float = 0.0  # sampling + decode forward passes

    @property
    def prompt_tokens_per_second(self) -> float:
        return self.prompt_evaluated / self.prompt_seconds if self.prompt_seconds > 0 else 0.0

    @property
    def generation_tokens_per_second(self) -> float:
        if self.generation_seconds <= 0:
            return 0.0
        return self.generated_tokens / self.generation_seconds

    def summary(self) -> str:
        return (
            f"prompt: {self.prompt_tokens} tokens ({self.prompt_evaluated} evaluated) in "
            f"{self.prompt_seconds:.3f} s, {self.prompt_tokens_per_second:.1f} tokens/s | "
            f"generation: {self.generated_tokens} tokens in {self.generation_seconds:.3f} s, "
            f"{self.generation_tokens_per_second:.1f} tokens/s"
        )


class TextStream:
    """One generation; iterate for text pieces (once). Runs lazily, as it is iterated.

    max_tokens None (or -1) generates until a stop condition or a full context. finish_reason
    becomes "stop" (stop token or stop string) or "length" (max_tokens or the context is full).
    `hold` (a Model's lock) is held from the first piece until the generation ends, is closed,
    or the stream is dropped: the running generator refers to the generation, not to this
    stream, so dropping the last reference to the stream (a `break` out of a `for` loop over it)
    ends it at once instead of at the next garbage collection.
    """

    def __init__(
        self,
        session: Session,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int],
        sampler: Sampler,
        max_tokens: int | None = 256,
        stop: Sequence[str] = (),
        ignore_eos: bool = False,
        strategy: DecodingStrategy = plain_decoding,
        hold: Callable[[], AbstractContextManager] = nullcontext,
    ) -> None:
        check_kind("max_tokens", max_tokens)
        if max_tokens == -1:  # as the CLI's -n -1 (llama.cpp's): until a stop or a full context
            max_tokens = None
        if max_tokens is not None and max_tokens < 0:
            raise UsageError(
                f"max_tokens must be >= 0, or -1 / None for no limit, got {max_tokens}"
            )
        if isinstance(stop, str):
            stop = [stop]
        self._gen = _Generation(
            session, tokenizer, list(prompt_ids), sampler, max_tokens, list(stop), ignore_eos,
            strategy,
        )  # fmt: skip
        self._iterator = self._gen.run(hold)

    @property
    def token_ids(self) -> list[int]:
        """Generated ids (a final stop token excluded)."""
        return self._gen.token_ids

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        return self._gen.text

    @property
    def finish_reason(self) -> str | None:
        return self._gen.finish_reason

    @property
    def stats(self) -> GenerationStats:
        return self._gen.stats

    def __iter__(self) -> Iterator[str]:
        return self

    def __next__(self) -> str:
        return next(self._iterator)

    def close(self) -> None:
        self._iterator.close()


class _Generation:
    """The state of one generation and its decode loop (TextStream is the handle users hold)."""

    def __init__(
        self,
        session: Session,
        tokenizer: Tokenizer,
        prompt_ids: list[int],
        sampler: Sampler,
        max_tokens: int | None,
        stop: list[str],
        ignore_eos: bool,
        strategy: DecodingStrategy,
    ) -> None:
        self.session = session
        self.tokenizer = tokenizer
        self.prompt_ids = prompt_ids
        self.sampler = sampler
        self.max_tokens = max_tokens
        self.stop = stop
        self.ignore_eos = ignore_eos
        self.strategy = strategy
        self.token_ids: list[int] = []
        self.text = ""
        self.finish_reason: str | None = None
        self.stats = GenerationStats(prompt_tokens=len(self.prompt_ids))

    def _emit(self, piece: str) -> str:
        self.text += piece
        return piece

    def run(self, hold: Callable[[], AbstractContextManager]) -> Iterator[str]:
        with hold():
            yield from self._generate()

    def _generate(self) -> Iterator[str]:
        prompt = PromptStats()
        steps = self.strategy(self.session, self.prompt_ids, self.sampler, prompt)
        detok = IncrementalDetokenizer(self.tokenizer)
        stops = StopStrings(self.stop)
        stop_ids = set() if self.ignore_eos else self.tokenizer.stop_ids
        finish = "length"
        try:
            if self.max_tokens == 0:
                next(steps)  # the prompt is evaluated (and cached) even when nothing is wanted
            while self.max_tokens is None or self.stats.generated_tokens < self.max_tokens:
                t0 = time.perf_counter()
                token = next(steps)  # the previous token fed, the next one sampled
                elapsed = time.perf_counter() - t0
                if self.stats.generated_tokens == 0:  # the first call also read the prompt
                    elapsed -= prompt.seconds
                    self.stats.prompt_evaluated = prompt.evaluated
                    self.stats.prompt_seconds = prompt.seconds
                self.stats.generated_tokens += 1
                if token in stop_ids:
                    self.stats.generation_seconds += elapsed
                    finish = "stop"
                    break
                self.token_ids.append(token)
                t0 = time.perf_counter()
                out, hit = stops.push(detok.push(token))
                self.stats.generation_seconds += elapsed + time.perf_counter() - t0
                if out:
                    yield self._emit(out)
                if hit:
                    self.finish_reason = "stop"
                    return
                if self.session.full:
                    break  # the last token is not fed: nothing would read its logits
        finally:
            self.stats.prompt_evaluated, self.stats.prompt_seconds = (
                prompt.evaluated,
                prompt.seconds,
            )
            steps.close()
        out, hit = stops.push(detok.flush())
        out += "" if hit else stops.flush()
        self.finish_reason = "stop" if hit else finish
        if out:
            yield self._emit(out)
