"""The Python API: `pyruntime.Model`.

    model = pyruntime.Model("model.gguf", n_ctx=2048)
    ids = model.tokenize("Hello")
    for piece in model.generate("Once upon a time", max_tokens=32, temp=0):
        print(piece, end="")
    reply = model.create_chat_completion([{"role": "user", "content": "Hi"}])
    print(reply["choices"][0]["message"]["content"])

One Model holds one KV cache (a `Session`): consecutive generate / chat calls reuse the longest
common token prefix with the previous call, so a chat turn only evaluates the new messages.

Threads: a Model serializes its calls. Whatever touches its session or executor (a generation,
`logits`, `reset`) runs one at a time; a generation holds the Model from its first piece until it
ends, is closed or is dropped, and other threads' calls wait for it. Tokenizing and rendering
chat templates do not wait. For generations in parallel, load one Model per thread: the weights
are the same mapped file, shared by the OS.
"""

from __future__ import annotations

import gc
import operator
import os
import secrets
import sys
import threading
import time
import uuid
import warnings
from argparse import ArgumentTypeError
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pyruntime import options
from pyruntime.call_lock import CallLock
from pyruntime.converter.repack_cache import open_model_file
from pyruntime.cpu.executor import CpuExecutor
from pyruntime.cpu.experts import EXPERT_BACKENDS
from pyruntime.decoding.big_little import BigLittleStats, resident_experts_only
from pyruntime.decoding.mode import DecodingMode
from pyruntime.decoding.sampling import Sampler, SamplingParams
from pyruntime.decoding.session import Session
from pyruntime.decoding.stream import TextStream
from pyruntime.errors import PyruntimeWarning, UsageError
from pyruntime.experts.gates import GATE_COPY_MODES
from pyruntime.experts.sparsity import SparsityTable, check_sparsity
from pyruntime.gc_freeze import freeze_imports
from pyruntime.gguf.file import GGUFFile
from pyruntime.model.config import ModelConfig
from pyruntime.model.stats import PHASES
from pyruntime.options import DEFAULTS
from pyruntime.placement import choose_device
from pyruntime.text.chat_template import render_chat
from pyruntime.text.tokenizer import Tokenizer

_DEFAULTS = SamplingParams()


def _warn_gpu_only(**given: Any) -> None:
    """A warning naming the GPU options given (not at their defaults) to a model that runs on
    the CPU, where they do nothing."""
    names = [name for name, v in given.items() if v is not None and v != getattr(DEFAULTS, name)]
    if names:
        warnings.warn(
            f"{', '.join(names)}: no effect, the model runs on the CPU", PyruntimeWarning,
            stacklevel=3,
        )  # fmt: skip


def _token_ids(ids: Any, call: str) -> list[int]:
    """ids as a list of ints; a UsageError naming `call` for text or anything else."""
    if isinstance(ids, (str, bytes, bytearray, memoryview)):
        raise UsageError(f"{call} takes token ids (model.tokenize(text) gives them)")
    try:
        return [operator.index(i) for i in ids]
    except TypeError:
        raise UsageError(f"{call} takes a sequence of int token ids") from None


class _Closed:
    """A closed Model's executor: every use says so."""

    def __getattr__(self, name: str) -> Any:
        raise UsageError("this Model is closed: create a new one")


class Model:
    """A GGUF model ready to tokenize, score and generate.

    n_ctx: context size in tokens of the generation cache (0 = the model's trained context).
    threads: CPU threads for torch and the C core (None = physical cores for the C core).
    ubatch: CPU prefill tokens per chunk (None: the C core's default).
    sparsity: target fraction of routed-expert neurons to skip, in [0, 1); needs the model's
    calibration table (`pyruntime calibrate`); 0 = dense. `achieved_sparsity` reports the result.
    sparsity_table: that table's file (None: MODEL.sparsity.json beside the model).
    gate_copy: 'auto', 'on' or 'off': the CPU's sparse decode steps read a copy of the routed
    experts' gate rows, each expert's contiguous (auto: with sparsity, where it fits in RAM).
    weights_copy: read the model file into RAM on 2 MiB pages instead of mapping it (RSS the
    file's size; the CPU decode's weight stream then overlaps its kernels).
    expert_backend: 'auto' (the C core when built), 'c', or 'torch' (the reference); CPU only.
    device: 'auto' (the GPU when there is one and the model + KV cache fit in its free memory,
    else the CPU), 'cpu', 'cuda' or 'cuda:N' (an error when there is no GPU or it does not fit).
    `device` afterwards holds the choice ('cpu' or 'cuda[:N]'), `device_note` why auto took the
    CPU although a GPU exists (None otherwise).
    seed: seeds the random stream of sampling calls that pass no seed of their own
    (None or -1 = a random seed), so a run of calls is reproducible as a whole.
    kernel_tuning: a JSON file of GPU kernel launch configs (None: $PYRUNTIME_DECODE_TUNING, else
    the built-in tables).
    gpu_mem: the GPU memory budget in bytes or as a size ('12G'; None: what torch can allocate
    now, minus a margin). A model bigger than it runs hybrid (pyruntime.offload): dense weights
    and the KV cache on the GPU, routed experts in host memory, the rest of the budget a GPU
    cache of expert slots; staging ('auto', 'register', 'bounce', 'pinned'), pin_experts,
    cache_policy ('lfru', 'lru'), misses ('auto', 'cpu', 'stage') and lookahead say how.
    experts_per_token: routed experts per token (None: the model's top-k).
    little_experts / big_little: big/little decoding with a little pass of that many experts (a
    bare big_little: half the top-k); fallback_threshold, fallback ('lossy' or 'verify'), draft,
    draft_experts ('little', or 'resident': hybrid only): how (pyruntime.decoding.big_little).
    Each can also be given per generate() call.
    Every option's default and help: pyruntime.options.

    Thread-safe by serialization (module doc): one generation, `logits` or `reset` at a time; a
    streamed generation holds the Model until it ends, is closed or is dropped.
    """

    def __init__(
        self,
        path: str | Path,
        n_ctx: int = DEFAULTS.n_ctx,
        threads: int | None = None,
        seed: int | None = None,
        ubatch: int | None = None,
        sparsity: float = DEFAULTS.sparsity,
        sparsity_table: str | Path | None = None,
        gate_copy: str = DEFAULTS.gate_copy,
        weights_copy: bool = DEFAULTS.weights_copy,
        expert_backend: str = DEFAULTS.expert_backend,
        device: str = DEFAULTS.device,
        kernel_tuning: str | None = None,
        gpu_mem: int | str | None = None,
        staging: str = DEFAULTS.staging,
        pin_experts: bool = DEFAULTS.pin_experts,
        cache_policy: str = DEFAULTS.cache_policy,
        misses: str = DEFAULTS.misses,
        lookahead: bool = DEFAULTS.lookahead,
        experts_per_token: int | None = None,
        little_experts: int = DEFAULTS.little_experts,
        big_little: bool = DEFAULTS.big_little,
        fallback_threshold: float = DEFAULTS.fallback_threshold,
        fallback: str = DEFAULTS.fallback,
        draft: int = DEFAULTS.draft,
        draft_experts: str = DEFAULTS.draft_experts,
    ) -> None:
        if not isinstance(path, (str, os.PathLike)):
            raise UsageError(f"path must be a GGUF file's path (str or Path), got {path!r}")
        options.check_kind("sparsity", sparsity)  # a number first: "0.5" is a UsageError
        check_sparsity(sparsity)
        if expert_backend not in EXPERT_BACKENDS:
            raise UsageError(f"expert_backend must be one of {', '.join(EXPERT_BACKENDS)}, "
                             f"got {expert_backend!r}")  # fmt: skip
        if gate_copy not in GATE_COPY_MODES:
            raise UsageError(f"gate_copy must be one of {', '.join(GATE_COPY_MODES)}, "
                             f"got {gate_copy!r}")  # fmt: skip
        gpu_bytes = _size(gpu_mem)
        for name, value in (("n_ctx", n_ctx), ("threads", threads), ("seed", seed),
                            ("ubatch", ubatch), ("gpu_mem", gpu_bytes)):  # fmt: skip
            options.check(name, value)
        # a llama.cpp file runs from its repacked copy (made once, in the cache folder)
        self.file: GGUFFile = open_model_file(path, in_ram=weights_copy)
        self.path = Path(path)
        table = SparsityTable.load(self.path, sparsity_table) if sparsity > 0 else None
        thresholds = None if table is None else table.for_sparsity(sparsity)
        config = ModelConfig.from_gguf(self.file)
        self.n_ctx = n_ctx or config.context_length
        self.kernel_tuning = options.value("kernel_tuning", kernel_tuning)
        choice = choose_device(device, self.file, config, self.n_ctx, gpu_bytes)
        self.device, self.device_note = choice.device, choice.note
        self.placement = choice.plan  # the hybrid's plan (None: one device holds everything)
        if choice.note:
            print(f"pyruntime: {choice.note}", file=sys.stderr)
        if self.device == "cpu":
            _warn_gpu_only(
                gpu_mem=gpu_mem, staging=staging, pin_experts=pin_experts,
                cache_policy=cache_policy, misses=misses, lookahead=lookahead,
            )  # fmt: skip
        if choice.hybrid:
            from pyruntime.offload.loading import device_memory_guard, load_hybrid

            print(f"pyruntime: {choice.plan.summary(self.device)}", file=sys.stderr)
            freeze_imports()
            with device_memory_guard("loading the model", self.device, choice.plan.budget):
                self.net = load_hybrid(
                    self.file, config, choice.plan, self.device, threads=threads,
                    staging=staging, pin_experts=pin_experts, cache_policy=cache_policy,
                    misses=misses, lookahead=lookahead, kernel_tuning=self.kernel_tuning,
                    thresholds=thresholds,
                )  # fmt: skip
        elif self.device == "cpu":
            freeze_imports()
            self.net = CpuExecutor.from_gguf(
                self.file, threads=threads, expert_backend=expert_backend, ubatch=ubatch
            )
            self.net.expert_threshold = thresholds
            self.net.use_gate_copy(gate_copy, self.file.file_size)
            if thresholds is not None:  # decode dense where sparse loses on this machine
                key = f"{self.path.name}:{self.file.file_size}:s{sparsity}"
                self.net.choose_decode_sparsity(key, options.writable_cache_dir() / "cpu_switch")
        else:
            from pyruntime.gpu.executor import GpuExecutor  # imports triton: GPU runs only

            if threads is not None:
                torch.set_num_threads(threads)  # in range: checked above
            from pyruntime.offload.loading import device_memory_guard

            freeze_imports()
            with device_memory_guard("loading the model", self.device):
                self.net = GpuExecutor.from_gguf(self.file, self.device,
                                                 kernel_tuning=self.kernel_tuning)  # fmt: skip
            key = f"{self.path.name}:{self.file.file_size}:s{sparsity}"
            # profiles are written only with thresholds; an unwritable cache then falls back
            cache = options.writable_cache_dir() if thresholds is not None else options.cache_dir()
            self.net.set_expert_threshold(thresholds, key=key, cache_dir=cache / "switch")
        self.sparsity = sparsity
        self._decoding_options = dict(
            experts_per_token=experts_per_token,
            little_experts=little_experts,
            big_little=big_little,
            fallback_threshold=fallback_threshold,
            fallback=fallback,
            draft=draft,
            draft_experts=draft_experts,
        )
        self.decoding = DecodingMode.from_options(config, **self._decoding_options)
        if self.decoding.resident_draft:
            resident_experts_only(self.net)  # a one-line error unless the model runs hybrid
        self.big_little_stats = BigLittleStats()
        self.tokenizer = Tokenizer.from_gguf(self.file, config.n_vocab)
        self._rng = torch.Generator()
        self._rng.manual_seed(secrets.randbits(63) if seed in (None, -1) else seed)
        self._session: Session | None = None  # created on first use
        self._session_lock = threading.Lock()  # guards that creation
        self._serial = CallLock()
        self._warned_context = False  # a prompt past the trained context was warned about
        self._name = str(self.file.get("general.name", self.path.stem))

    @property
    def achieved_sparsity(self) -> float:
        """Fraction of routed-expert neurons skipped so far (0.0 when dense)."""
        return self.net.stats.sparsity

    def sparsity_by_phase(self) -> dict[str, float]:
        """The fraction skipped in forward passes of several tokens ('prefill': prompts,
        verified drafts) and of one ('decode'), for each phase that ran."""
        stats = self.net.stats
        values = {phase: stats.phase_sparsity(phase) for phase in PHASES}
        return {phase: v for phase, v in values.items() if v is not None}

    @property
    def config(self) -> Any:
        return self.net.config

    @property
    def session(self) -> Session:
        """The Model's KV cache and the ids it holds (used directly, it is not serialized)."""
        with self._session_lock:
            if self._session is None:
                self._session = Session(self.net, self.n_ctx)
            return self._session

    def close(self) -> None:
        """Free the model now, not at the next garbage collection: its CPU threads, its KV
        cache, its GPU memory and its mapping of the file (idempotent; waits for a call in
        another thread to end). Any later call on it is a UsageError."""
        with self._serial():
            if isinstance(self.net, _Closed):
                return
            net, self.net, self._session = self.net, _Closed(), None
            cores = {id(c): c for c in (getattr(net, "core", None),
                                         getattr(getattr(net, "expert_backend", None), "core",
                                                 None)) if c is not None}  # fmt: skip
            for core in cores.values():
                core.close()  # the worker threads stop here
            self.file.close()
            del net
            gc.collect()  # the weights' arrays sit in reference cycles: unmap them now
            if self.device != "cpu" and torch.cuda.is_available():
                torch.cuda.empty_cache()

    def __enter__(self) -> Model:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def reset(self) -> None:
        """Forget the cached context (the next call evaluates its whole prompt)."""
        with self._serial():
            if self._session is not None:
                self._session.reset()

    # -- tokens -------------------------------------------------------------------------------

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special=add_special)

    def detokenize(self, ids: Sequence[int], skip_special: bool = True) -> str:
        """The text of token ids, each in [0, n_vocab) (a UsageError names the first that is
        not, as logits() and generate() do)."""
        ids = _token_ids(ids, "detokenize()")
        n_vocab = self.config.n_vocab
        bad = next((i for i in ids if not 0 <= i < n_vocab), None)
        if bad is not None:
            raise UsageError(f"token id {bad} is outside the vocabulary [0, {n_vocab})")
        return self.tokenizer.decode(ids, skip_special=skip_special)

    def logits(self, token_ids: Sequence[int]) -> np.ndarray:
        """Logits float32 [n_tokens, n_vocab] of `token_ids`, evaluated with a fresh cache, as
        the model's decoding mode scores them (with big/little: the big model's where the little
        one would fall back, else the little one's)."""
        ids = _token_ids(token_ids, "logits()")
        if not ids:
            raise UsageError("logits() needs at least one token id")
        self._warn_past_context(len(ids))
        with self._serial():
            return self.decoding.score(self.net, ids).float().numpy()

    def stats(self) -> dict[str, Any]:
        """What the model has done so far: achieved expert sparsity (in all, in prefill and in
        decode), big/little decoding's
        fallback ratio, pass times, prefetch hit rate and verify acceptance length, and a hybrid
        run's slot hits, bytes staged and read by the CPU, and time per token by part."""
        out: dict[str, Any] = {"decoding": self.decoding.describe()}
        if self.sparsity:
            out["sparsity_target"] = self.sparsity
            out["sparsity_achieved"] = self.achieved_sparsity
            for phase, v in self.sparsity_by_phase().items():
                out[f"sparsity_achieved_{phase}"] = v
        if self.decoding.big_little:
            out.update(self.big_little_stats.as_dict())
        offload = getattr(self.net, "offload_stats", None)
        if offload is not None:
            out["offload"] = offload()
        return out

    def time_parts(self, on: bool = True) -> None:
        """Time the hybrid's parts (attention, router, GPU experts, waits for copies) with
        CUDA events for stats() (a few event records per layer and token: off by default)."""
        timer = getattr(self.net, "timer", None)
        if timer is not None:
            timer.enabled = on or not timer.cuda

    # -- generation ---------------------------------------------------------------------------

    def _sampler(self, params: SamplingParams) -> Sampler:
        return Sampler(params, None if params.seed is not None else self._rng)

    def generate(
        self,
        prompt: str | Sequence[int],
        max_tokens: int | None = DEFAULTS.max_tokens,
        temp: float = _DEFAULTS.temp,
        top_k: int = _DEFAULTS.top_k,
        top_p: float = _DEFAULTS.top_p,
        min_p: float = _DEFAULTS.min_p,
        repeat_penalty: float = _DEFAULTS.repeat_penalty,
        repeat_last_n: int = _DEFAULTS.repeat_last_n,
        seed: int | None = None,
        stop: str | Sequence[str] = (),
        ignore_eos: bool = False,
        **decoding: Any,
    ) -> TextStream:
        """Stream the continuation of `prompt` (text, tokenized with BOS if the model wants one,
        or token ids) as text pieces. The returned TextStream carries `finish_reason`, `stats`.
        decoding: per-call decoding options (experts_per_token, little_experts, big_little,
        fallback_threshold, fallback, draft), else the model's.
        """
        params = SamplingParams(
            temp=temp,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            repeat_penalty=repeat_penalty,
            repeat_last_n=repeat_last_n,
            seed=None if seed == -1 else seed,  # -1: a random one, as llama.cpp's
        )
        ids = self._prompt_ids(prompt)
        stops = _stop_strings(stop)
        return TextStream(
            self.session,
            self.tokenizer,
            ids,
            self._sampler(params),
            max_tokens=max_tokens,
            stop=stops,
            ignore_eos=ignore_eos,
            strategy=self._strategy(decoding),
            hold=self._serial,
        )

    def _prompt_ids(self, prompt: str | Sequence[int]) -> list[int]:
        """Token ids of a prompt given as text or as ids; bytes are refused (they would read as
        ids), and a prompt past the model's trained context is warned about."""
        if isinstance(prompt, str):
            ids = self.tokenize(prompt)
        elif isinstance(prompt, (bytes, bytearray, memoryview)):
            raise UsageError("the prompt is bytes: give text (decode it first) or token ids")
        else:
            try:
                ids = [operator.index(i) for i in prompt]
            except TypeError:
                raise UsageError("the prompt must be text or a sequence of int token ids") from None
        self._warn_past_context(len(ids))
        return ids

    def _warn_past_context(self, n_tokens: int) -> None:
        """Once per Model: a perplexity run or a long chat would repeat it for every window or
        turn."""
        trained = self.config.context_length
        if n_tokens > trained and not self._warned_context:
            self._warned_context = True
            warnings.warn(
                f"the prompt has {n_tokens} tokens, more than the {trained} the model was trained "
                "on: quality may drop past that point",
                PyruntimeWarning,
                stacklevel=3,
            )

    def _strategy(self, overrides: Mapping[str, Any]):
        """The decoding strategy of one call: the model's mode, or one with these overrides."""
        unknown = set(overrides) - set(self._decoding_options)
        if unknown:
            hint = ""
            if "temperature" in unknown:  # OpenAI's / llama-cpp-python's name for it
                hint = " (generate() takes temp=; temperature= is create_chat_completion()'s)"
            raise UsageError(f"unknown generation option(s): {', '.join(sorted(unknown))}{hint}")
        mode = self.decoding
        given = {k: v for k, v in overrides.items() if v is not None}
        if given:
            mode = DecodingMode.from_options(self.config, **{**self._decoding_options, **given})
            if mode.resident_draft:
                resident_experts_only(self.net)
        return mode.strategy(self.big_little_stats, self.config.n_expert_used)

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True
    ) -> str:
        """The prompt text of `messages`, rendered with the GGUF's chat template."""
        tok = self.tokenizer
        bos = tok.token_text(tok.bos_id) if tok.bos_id is not None else None
        eos = tok.token_text(tok.eos_id) if tok.eos_id is not None else None
        return render_chat(
            tok.chat_template,
            messages,
            bos_token=bos or "",
            eos_token=eos or "",
            add_generation_prompt=add_generation_prompt,
            source=str(self.path),
        )

    def create_chat_completion(
        self,
        messages: Sequence[Mapping[str, Any]],
        stream: bool = False,
        max_tokens: int | None = None,
        temperature: float = _DEFAULTS.temp,
        top_k: int = _DEFAULTS.top_k,
        top_p: float = _DEFAULTS.top_p,
        min_p: float = _DEFAULTS.min_p,
        repeat_penalty: float = _DEFAULTS.repeat_penalty,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        **decoding: Any,
    ) -> dict[str, Any] | Iterator[dict[str, Any]]:
        """OpenAI-shaped chat completion: a `chat.completion` dict, or with stream=True an
        iterator of `chat.completion.chunk` dicts (role first, then content deltas, then the
        finish_reason). max_tokens None or -1 = until a stop or a full context. decoding: per-call
        decoding options, as generate().
        """
        if "temp" in decoding:  # generate()'s (llama.cpp's) name for it
            raise UsageError("create_chat_completion() takes temperature= (OpenAI's name), not "
                             "temp=")  # fmt: skip
        text = self.apply_chat_template(messages)
        # The template writes BOS itself when the model uses one (encode skips a duplicate).
        ids = self.tokenize(text, add_special=True)
        generation = self.generate(
            ids,
            max_tokens=max_tokens,
            temp=temperature,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            repeat_penalty=repeat_penalty,
            seed=seed,
            stop=stop or (),
            **decoding,
        )
        completion_id = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        if stream:
            return self._chunks(generation, completion_id, created)
        content = "".join(generation)
        return {
            "id": completion_id,
            "object": "chat.completion",
            "created": created,
            "model": self._name,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": content},
                    "finish_reason": generation.finish_reason,
                }
            ],
            "usage": _usage(generation),
        }

    def _chunks(
        self, generation: TextStream, completion_id: str, created: int
    ) -> Iterator[dict[str, Any]]:
        def chunk(delta: dict[str, Any], finish_reason: str | None) -> dict[str, Any]:
            return {
                "id": completion_id,
                "object": "chat.completion.chunk",
                "created": created,
                "model": self._name,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}],
            }

        yield chunk({"role": "assistant"}, None)
        try:
            for piece in generation:
                yield chunk({"content": piece}, None)
        finally:
            generation.close()  # an abandoned stream stops generating at once
        final = chunk({}, generation.finish_reason)
        final["usage"] = _usage(generation)
        yield final


def _size(gpu_mem: int | str | None) -> int | None:
    """A budget given as bytes or as a size string ('12G')."""
    if gpu_mem is None or isinstance(gpu_mem, int):
        return gpu_mem
    try:
        return options.parse_size(gpu_mem)
    except (ArgumentTypeError, TypeError):
        raise UsageError(f"gpu_mem: {gpu_mem!r} is not a size (use e.g. 12G, 8GiB, 512M)") from None


def _usage(generation: TextStream) -> dict[str, int]:
    prompt = generation.stats.prompt_tokens
    completion = len(generation.token_ids)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def _stop_strings(stop: Any) -> list[str]:
    """generate()'s `stop`: a string, or strings (None or empty: none); else a UsageError."""
    if isinstance(stop, str):
        return [stop]
    try:
        stops = list(stop or ())
    except TypeError:
        stops = [stop]
    if not all(isinstance(s, str) for s in stops):
        raise UsageError(f"stop must be a string or a sequence of strings, got {stop!r}")
    return stops
