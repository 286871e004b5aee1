"""The `pyruntime` command: chat, generate, perplexity, bench, calibrate, repack, serve, info.

Output discipline: stdout carries only the product (answers, generated text, `ppl = X`, info),
stderr the diagnostics (timings, progress, banners), so every command can be piped.
Errors a user can cause (PyruntimeError) print `error: <message>` and exit 1 without a traceback;
Ctrl-C exits 130, except during a chat answer, where it stops only that answer.
Heavy imports (torch) happen inside the commands so `--help` and `--version` stay instant.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pyruntime import __version__, options
from pyruntime.errors import PyruntimeError, PyruntimeWarning, UsageError
from pyruntime.output_files import Terminated, check_writable

# --outtype of `repack` (the converter's; pyruntime.converter.tensors.OUTTYPES, kept in sync by a
# test: importing it here would load numpy and gguf for `--help`)
OUTTYPES = ("f32", "f16", "bf16", "q8_0", "q4_0")

# The pyruntime.Model keywords the CLI passes from its options (pyruntime.options).
RUNTIME = ("threads", "device", "sparsity", "sparsity_table", "kernel_tuning", "gpu_mem", "staging",
           "pin_experts", "cache_policy", "misses", "lookahead")  # fmt: skip
DECODING = (
    "experts_per_token", "little_experts", "big_little", "fallback_threshold", "fallback", "draft"
)  # fmt: skip

# llama.cpp's defaults (kept in sync with pyruntime.decoding.sampling.SamplingParams by a test).
_TEMP, _TOP_K, _TOP_P, _MIN_P, _REPEAT_PENALTY, _REPEAT_LAST_N = 0.8, 40, 0.95, 0.05, 1.0, 64


# ---------------------------------------------------------------------------------------------
# Argument parsing


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pyruntime",
        description="Run Mixture-of-Experts language models from GGUF files.",
    )
    parser.add_argument("--version", action="version", version=f"pyruntime {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser(
        "chat",
        help="interactive chat (the built-in demo model without MODEL)",
        description="Chat with a model. Commands: /reset clears the history, /exit quits "
        "(or Ctrl-D). Ctrl-C stops the current answer. When stdin is not a terminal, each "
        "input line is one user message and only the answers are printed.",
    )
    p.add_argument("model", nargs="?", help="GGUF file (default: the built-in demo model)")
    p.add_argument("--system", default=None, help="system prompt")
    _stats_flag(p)
    options.add_arguments(p, "chat")
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser(
        "generate",
        help="continue a prompt; the text alone goes to stdout",
        description="Continue a prompt. The generated text alone goes to stdout (streamed), "
        "timings to stderr.",
    )
    p.add_argument("model", help="GGUF file")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("-p", "--prompt", help="prompt text")
    src.add_argument("-f", "--file", type=Path, help="read the prompt from this file")
    p.add_argument(
        "--ignore-eos", action="store_true", help="do not stop on the model's end tokens"
    )
    _stats_flag(p)
    options.add_arguments(p, "generate")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser(
        "perplexity",
        help="perplexity of a text file",
        description="Tokenize the whole file (BOS only if the model adds one), cut it into "
        "consecutive non-overlapping windows of -c/--ctx-size tokens, evaluate each window with "
        "a fresh cache and score every token after the first of each window. The tail after the "
        "last full window is scored as a shorter window when it has at least 2 tokens, and "
        "dropped otherwise. Prints `ppl = X` as the last line of stdout.",
    )
    p.add_argument("model", help="GGUF file")
    p.add_argument("-f", "--file", type=Path, required=True, help="text file (UTF-8)")
    _window_flag(p)
    p.add_argument(
        "--json",
        action="store_true",
        help='print {"ppl", "nll", "tokens_scored", "windows", "ctx", "sparsity_target", '
        '"sparsity_achieved"} as JSON instead',
    )
    options.add_arguments(p, "perplexity")
    p.set_defaults(func=cmd_perplexity)

    p = sub.add_parser(
        "bench",
        help="prompt and generation speed (llama-bench style)",
        description="Time pp N (prefill of N random tokens) and tg N (N single-token decode "
        "steps), each from an empty cache, repeated -r times after a warm-up run; prints "
        "tokens/s mean ± std as a markdown table (or JSON with -o json).",
    )
    p.add_argument("model", nargs="?", help="GGUF file (default: the built-in demo model)")
    p.add_argument("-p", "--n-prompt", type=int, default=512, help="prompt tokens, 0 = skip (512)")
    p.add_argument("-n", "--n-gen", type=int, default=128, help="generated tokens, 0 = skip (128)")
    p.add_argument("-r", "--repetitions", type=int, default=5, help="repetitions (5)")
    p.add_argument("-o", "--output", choices=("md", "json"), default="md", help="md or json")
    _stats_flag(p)
    options.add_arguments(p, "bench")
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser(
        "calibrate",
        help="measure activation sparsity thresholds for --sparsity",
        description="Run the model over a text, record |act(gate)| of every routed expert "
        "neuron per layer, and store the thresholds that skip 5%, 10%, ... 95% of them in "
        "MODEL.sparsity.json beside the model, or in --out FILE (the model file is not "
        "changed).",
    )
    p.add_argument("model", help="GGUF file")
    p.add_argument("-f", "--file", type=Path, required=True, help="calibration text (UTF-8)")
    _window_flag(p)
    p.add_argument(
        "--max-tokens", type=int, default=32768, help="use at most this many tokens (32768)"
    )
    p.add_argument(
        "-o", "--out", type=Path, default=None, metavar="FILE",
        help="write the table here (default: MODEL.sparsity.json beside the model; use a table "
        "written elsewhere with --sparsity-table FILE)",
    )  # fmt: skip
    options.add_arguments(p, "calibrate")
    p.set_defaults(func=cmd_calibrate)

    p = sub.add_parser(
        "repack",
        help="rewrite a llama.cpp GGUF in pyruntime's layout (otherwise done on first use)",
        description="Read a GGUF in llama.cpp's layout (routed experts as ffn_gate_exps, "
        "ffn_up_exps, ffn_down_exps) and write it in pyruntime's (docs/gguf-layout.md): every "
        "neuron's gate, up and down rows side by side. Without -o the copy goes where "
        "pyruntime looks for it when MODEL is opened (the cache folder, $PYRUNTIME_CACHE); "
        "pyruntime does this by itself the first time a llama.cpp file is opened. The path "
        "written is printed on stdout.",
    )
    p.add_argument("model", help="GGUF file in llama.cpp's layout")
    p.add_argument(
        "-o", "--outfile", type=Path, default=None, metavar="FILE",
        help="write the copy here instead (open it directly afterwards)",
    )  # fmt: skip
    p.add_argument(
        "--outtype", choices=sorted(OUTTYPES), default=None,
        help="store every weight in this format (default: each tensor's own; the experts' down "
        "rows, which must be transposed, are quantized again in it: f32 keeps them exact)",
    )  # fmt: skip
    p.add_argument("--force", action="store_true", help="overwrite an existing FILE")
    p.set_defaults(func=cmd_repack)

    p = sub.add_parser(
        "serve",
        help="serve a model over OpenAI's HTTP API (chat and text completions)",
        description="Serve one model over HTTP as OpenAI's API does: POST /v1/chat/completions "
        'and /v1/completions (streamed with "stream": true), GET /v1/models and /health. '
        "Sampling parameters are those of the request, with llama.cpp's names and defaults "
        "(temperature, top_p, top_k, min_p, repeat_penalty, seed, stop, max_tokens). Requests "
        "are answered one at a time, in arrival order; a client that disconnects cancels its "
        'request. Needs the server extra: pip install "pyruntime[server]".',
    )
    p.add_argument("model", nargs="?", help="GGUF file (default: the built-in demo model)")
    options.add_arguments(p, "serve")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser(
        "info",
        help="describe a GGUF model file",
        description="Describe a GGUF model file, and where it would run on the GPU: the whole "
        "model, or hybrid (dense weights and KV cache on the GPU, routed experts in host "
        "memory, the rest of the budget as expert slots) under --gpu-mem (default: this "
        "machine's GPU, if any) at a context of -c/--ctx-size tokens.",
    )
    p.add_argument("model", help="GGUF file")
    options.add_arguments(p, "info")
    p.set_defaults(func=cmd_info)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    warnings.showwarning = _show_warning
    try:
        options.check_args(args)
        return args.func(args)
    except PyruntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except MemoryError:
        print("error: out of memory (a smaller context, model or input may fit)", file=sys.stderr)
        return 1
    except RuntimeError as exc:
        if not _gpu_out_of_memory(exc):
            raise
        print(f"error: the GPU ran out of memory ({str(exc).splitlines()[0]}): lower --gpu-mem "
              "or --ctx-size, or use --device cpu", file=sys.stderr)  # fmt: skip
        return 1
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except Terminated:
        return 143
    except BrokenPipeError:
        # The reader went away (`| head`): stop quietly, and keep Python's exit-time flush quiet.
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def _gpu_out_of_memory(exc: BaseException) -> bool:
    """A CUDA out-of-memory error from torch (imported by then, if it was raised)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(exc, torch.OutOfMemoryError)


# ---------------------------------------------------------------------------------------------
# Commands


def _load_model(path: str | Path, args: argparse.Namespace, n_ctx: int) -> Any:
    from pyruntime.api import Model

    runtime = options.from_args(args, RUNTIME + DECODING)
    if args.command == "calibrate":
        runtime["device"] = "cpu"  # the gate observer runs on the CPU path
    model = Model(path, n_ctx=n_ctx, seed=getattr(args, "seed", None), **runtime)
    if getattr(args, "stats", False):
        model.time_parts()
    return model


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """Warnings as one `warning: ` line on stderr (no file, line or source)."""
    print(f"warning: {message}", file=sys.stderr)


def _window_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "-c", "--ctx-size", "--ctx", dest="ctx", type=int, default=512, metavar="N",
        help="window size in tokens (512)",
    )  # fmt: skip


def _stats_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--stats", action="store_true",
        help="print what the model did (sparsity, big/little fallbacks, ...) as JSON on stderr",
    )  # fmt: skip


def _print_stats(model: Any, args: argparse.Namespace) -> None:
    if args.stats:
        print("stats: " + json.dumps(model.stats()), file=sys.stderr)


def _sparsity_report(model: Any) -> str:
    """'' when dense; else the target and the measured fraction of skipped expert neurons."""
    if not model.sparsity:
        return ""
    return (
        f" | expert sparsity: target {model.sparsity:.2f}, achieved {model.achieved_sparsity:.3f}"
    )


def _sampling_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    kwargs = options.from_args(
        args, ("max_tokens", "top_k", "top_p", "min_p", "repeat_penalty", "stop")
    )
    kwargs["stop"] = [_valid_text(s, "--stop") for s in kwargs["stop"] or ()]
    return kwargs


def cmd_generate(args: argparse.Namespace) -> int:
    if args.prompt is not None:
        prompt = _valid_text(args.prompt, "the prompt")
    else:
        prompt = _read_text(args.file)
    model = _load_model(args.model, args, n_ctx=args.n_ctx)
    kwargs = _sampling_kwargs(args)
    stream = model.generate(
        prompt,
        temp=args.temp,
        repeat_last_n=args.repeat_last_n,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
        **kwargs,
    )
    finish, code = None, 0
    try:
        for piece in stream:
            sys.stdout.write(piece)
            sys.stdout.flush()
    except KeyboardInterrupt:  # stop, and still say how far it got
        stream.close()
        finish, code = "interrupted", 130
    if sys.stdout.isatty() or code:
        sys.stdout.write("\n")
    sys.stdout.flush()
    print(
        f"finish: {finish or stream.finish_reason} | {stream.stats.summary()}"
        f"{_sparsity_report(model)}",
        file=sys.stderr,
    )
    _print_stats(model, args)
    return code


def cmd_chat(args: argparse.Namespace) -> int:
    if args.model is None:
        from pyruntime.tools.demo import demo_model_path

        path = demo_model_path()
    else:
        path = args.model
    model = _load_model(path, args, n_ctx=args.n_ctx)
    interactive = sys.stdin.isatty()
    if hasattr(sys.stdin, "reconfigure"):  # undecodable bytes reach _valid_text, not a crash
        sys.stdin.reconfigure(errors="surrogateescape")
    system_prompt = _valid_text(args.system, "--system") if args.system else None
    system = [{"role": "system", "content": system_prompt}] if system_prompt else []
    history: list[dict[str, str]] = list(system)
    if interactive:
        with contextlib.suppress(ImportError):
            import readline  # noqa: F401  (line editing and history for input())
        print(
            f"pyruntime chat with {Path(path).name}: /reset clears the history, /exit quits, "
            "Ctrl-C stops an answer.",
            file=sys.stderr,
        )
    kwargs = _sampling_kwargs(args)
    while True:
        line = _read_user_line(interactive)
        if line is None:
            if model.sparsity:
                print(_sparsity_report(model).lstrip(" |"), file=sys.stderr)
            _print_stats(model, args)
            return 0
        line = _valid_text(line, "the input").strip()
        if not line:
            continue
        if line == "/exit":
            return 0
        if line == "/reset":
            history = list(system)
            model.reset()
            if interactive:
                print("(history cleared)", file=sys.stderr)
            continue
        history.append({"role": "user", "content": line})
        try:
            answer = _stream_answer(model, history, args, kwargs)
        except UsageError as exc:
            if not interactive:
                raise
            # e.g. the history outgrew the context: keep the session, let the user /reset.
            history.pop()
            print(f"error: {exc} (type /reset to start over)", file=sys.stderr)
            continue
        history.append({"role": "assistant", "content": answer})


def _read_user_line(interactive: bool) -> str | None:
    """The next user line, or None at end of input."""
    if not interactive:
        line = sys.stdin.readline()
        return line if line else None
    try:
        return input("> ")
    except EOFError:
        print(file=sys.stderr)
        return None


def _stream_answer(
    model: Any, history: list[dict[str, str]], args: argparse.Namespace, kwargs: dict[str, Any]
) -> str:
    """Print the answer as it streams; Ctrl-C ends it early. Returns the text printed."""
    pieces: list[str] = []
    stream = model.create_chat_completion(
        history, stream=True, temperature=args.temp, seed=None, **kwargs
    )
    try:
        for chunk in stream:
            piece = chunk["choices"][0]["delta"].get("content", "")
            if piece:
                pieces.append(piece)
                sys.stdout.write(piece)
                sys.stdout.flush()
    except KeyboardInterrupt:
        stream.close()
        print("\n(answer interrupted)", file=sys.stderr, end="")
    sys.stdout.write("\n")
    sys.stdout.flush()
    return "".join(pieces)


def cmd_perplexity(args: argparse.Namespace) -> int:
    from pyruntime.tools.perplexity import perplexity

    text = _read_text(args.file)
    if not 2 <= args.ctx < options.C_INT:
        raise UsageError(f"-c/--ctx-size must be >= 2 tokens, got {args.ctx}")
    model = _load_model(args.model, args, n_ctx=args.ctx)
    ids = model.tokenize(text, add_special=True)
    print(f"perplexity: {len(ids)} tokens, windows of {args.ctx}", file=sys.stderr)

    def progress(i: int, n: int, ppl: float) -> None:
        print(f"[{i + 1}/{n}] running ppl = {ppl:.4f}", file=sys.stderr, flush=True)

    result = perplexity(model, ids, args.ctx, progress=progress)
    if model.sparsity:
        print(_sparsity_report(model).lstrip(" |"), file=sys.stderr)
    if args.json:
        out = result.as_dict()
        out["sparsity_target"] = model.sparsity
        out["sparsity_achieved"] = model.achieved_sparsity
        print(json.dumps(out))
    else:
        print(f"tokens scored = {result.tokens_scored}, windows = {result.windows}")
        print(f"ppl = {result.ppl:.4f}")
    return 0


def _cpu_threads(model) -> int:
    """CPU threads the model computes with: the C core's pool when it runs the experts (torch
    is then held to one thread so the two do not contend), else torch's."""
    import torch

    core = getattr(getattr(model.net, "expert_backend", None), "core", None)
    return core.threads if core is not None else torch.get_num_threads()


def cmd_bench(args: argparse.Namespace) -> int:
    from pyruntime.tools.bench import markdown_table, result_rows, run_bench

    if args.model is None:
        from pyruntime.tools.demo import demo_model_path

        path = demo_model_path()
    else:
        path = args.model
    counts = (args.n_prompt, args.n_gen)
    if min(counts) < 0 or max(counts) >= options.C_INT or sum(counts) == 0:
        raise UsageError("bench needs -p N and/or -n N in [1, 2^31) (0 skips that test)")
    if not 1 <= args.repetitions < options.C_INT:
        raise UsageError(f"-r/--repetitions must be in [1, 2^31), got {args.repetitions}")
    model = _load_model(path, args, n_ctx=max(args.n_prompt, args.n_gen))
    print(
        f"bench: {Path(path).name} on {model.device}, {model.decoding.describe()}",
        file=sys.stderr,
    )

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    results = run_bench(
        model.net, args.n_prompt, args.n_gen, args.repetitions, progress=progress,
        mode=model.decoding, stats=model.big_little_stats,
    )  # fmt: skip
    rows = result_rows(model, results, _cpu_threads(model))
    if args.output == "json":
        print(json.dumps(rows, indent=1))
    else:
        print(markdown_table(rows))
    if model.sparsity:
        print(_sparsity_report(model).lstrip(" |"), file=sys.stderr)
    _print_stats(model, args)
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    from pyruntime.experts.sparsity import calibrate, sidecar_path

    text = _read_text(args.file)
    if not 2 <= args.ctx < options.C_INT or not 1 <= args.max_tokens < options.C_INT:
        raise UsageError("-c/--ctx-size must be >= 2 and --max-tokens >= 1")
    out = args.out if args.out is not None else sidecar_path(Path(args.model))
    if args.out is not None or Path(args.model).is_file():  # (a missing model: its own error)
        _check_output(out)  # before the run, not after it
    model = _load_model(args.model, args, n_ctx=args.ctx)
    ids = model.tokenize(text, add_special=False)[: args.max_tokens]
    print(f"calibrate: {len(ids)} tokens of {args.file}, windows of {args.ctx}", file=sys.stderr)

    def progress(i: int, n: int) -> None:
        print(f"[{i}/{n}]", file=sys.stderr, flush=True)

    size = model.path.stat().st_size  # the user's file (a llama.cpp one runs from a copy)
    table = calibrate(model.net, ids, args.ctx, str(args.file), size, progress=progress)
    try:
        table.save(out)
    except OSError as exc:
        raise UsageError(f"{out}: cannot write the table ({exc.strerror or exc})") from None
    shown = [0.5, 0.7, 0.9]
    print("layer  " + "  ".join(f"t@{s:.2f}" for s in shown))
    for layer, row in enumerate(table.thresholds):
        vals = [row[table.targets.index(s)] for s in shown]
        print(f"{layer:>5}  " + "  ".join(f"{v:8.5f}" for v in vals))
    hint = "" if args.out is None else f" (use it with --sparsity-table {out})"
    print(f"wrote {out}{hint}", file=sys.stderr)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from pyruntime.serve import run_server

    if args.model is None:
        from pyruntime.tools.demo import demo_model_path

        path = demo_model_path()
    else:
        path = args.model
    host, port = options.value("host", args.host), options.value("port", args.port)
    options.check("port", port, flag=True)
    model = _load_model(path, args, n_ctx=args.n_ctx)
    print(
        f"pyruntime serve: {Path(path).name} on {model.device}, context {model.n_ctx} tokens, "
        f"OpenAI API at http://{host}:{port}/v1 (Ctrl-C stops)",
        file=sys.stderr,
        flush=True,
    )
    run_server(model, Path(path).name, host, port)
    return 0


def cmd_repack(args: argparse.Namespace) -> int:
    import time

    from pyruntime.converter.repack import repack
    from pyruntime.converter.repack_cache import cached_copy_path, is_copy_of
    from pyruntime.gguf.file import open_gguf
    from pyruntime.model.config import ModelConfig
    from pyruntime.model.llamacpp_layout import detect_layout

    f = open_gguf(args.model)
    layout = detect_layout(f)
    if layout != "llama.cpp":
        why = "is already in pyruntime's layout" if layout == "pyruntime" else (
            "holds no routed experts (ffn_*_exps): not a Mixture-of-Experts model"
        )  # fmt: skip
        raise UsageError(f"{f.path}: {why}; nothing to repack")
    if args.outfile is None:
        dest = cached_copy_path(f.path)
        if args.outtype is None and is_copy_of(dest, f):
            print(f"repack: {dest} is already a current copy of {f.path}", file=sys.stderr)
            print(dest)
            return 0
    else:
        dest = Path(os.path.realpath(args.outfile))
        if os.path.lexists(args.outfile) and not args.force:
            raise UsageError(f"{args.outfile} exists; pass --force to overwrite it")
        if dest.exists() and os.path.samefile(dest, f.path):
            raise UsageError(f"{args.outfile}: is the input file; choose another -o")
        _check_output(dest)
    start = time.perf_counter()
    repack(f, dest, args.outtype, progress=True)
    ModelConfig.from_gguf(open_gguf(dest))  # the copy passes every rule of our layout
    print(
        f"repack: wrote {dest} ({dest.stat().st_size / 1e6:.1f} MB) in "
        f"{time.perf_counter() - start:.1f} s",
        file=sys.stderr,
    )
    print(dest)
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    from pyruntime.gguf.file import open_gguf
    from pyruntime.model.llamacpp_layout import detect_layout

    f = open_gguf(args.model)
    kind = detect_layout(f)
    layout = {
        "pyruntime": "pyruntime",
        "llama.cpp": "llama.cpp (repacked into pyruntime's on first use; `pyruntime repack`)",
        "unknown": "unknown (no routed experts)",
    }[kind]
    quant: dict[str, int] = {}
    for t in f.tensors.values():
        quant[t.qtype.name] = quant.get(t.qtype.name, 0) + 1
    n_params = sum(t.n_elements for t in f.tensors.values())
    tokens = f.get("tokenizer.ggml.tokens", [])
    rows = [
        ("file", str(f.path)),
        ("file size", f"{f.file_size:,} bytes ({_human_bytes(f.file_size)})"),
        ("architecture", f.arch),
        ("layout", layout),
        ("hf architecture", f.get("pyruntime.hf_architecture", _family_class(f))),
        ("name", f.get("general.name", "?")),
        ("parameters", f"{n_params:,} ({_human_count(n_params)})"),
        ("tensors", str(len(f.tensors))),
        ("quant types", ", ".join(f"{k}: {v}" for k, v in sorted(quant.items()))),
        ("layers", str(f.arch_get("block_count", "?"))),
        (
            "experts",
            f"{f.arch_get('expert_count', '?')} (used per token: "
            f"{f.arch_get('expert_used_count', '?')})",
        ),
        ("expert ffn", str(f.arch_get("expert_feed_forward_length", "?"))),
        ("context length", str(f.arch_get("context_length", "?"))),
        ("embedding size", str(f.arch_get("embedding_length", "?"))),
        (
            "heads (kv)",
            f"{f.arch_get('attention.head_count', '?')} "
            f"({f.arch_get('attention.head_count_kv', '?')})",
        ),
        ("vocab", str(f.arch_get("vocab_size", len(tokens)))),
        ("chat template", "yes" if f.get("tokenizer.chat_template", None) else "no"),
    ]
    if kind == "llama.cpp":
        rows += _repacked_plan_rows(f, args)
    else:
        rows += _gpu_plan_rows(f, args)
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}} : {value}")
    return 0


def _family_class(f: Any) -> str:
    """The Hugging Face class llama.cpp's converter reads for the file's architecture, or '?'."""
    from pyruntime.model.llamacpp_layout import FAMILIES

    family = FAMILIES.get(f.arch)
    return family.hf_architecture if family is not None else "?"


def _repacked_plan_rows(f: Any, args: argparse.Namespace) -> list[tuple[str, str]]:
    """The GPU plan of a llama.cpp file's repacked copy (what would run), once there is a
    current one; info does not repack."""
    from pyruntime.converter.repack_cache import cached_copy_path, is_copy_of
    from pyruntime.gguf.file import open_gguf

    copy = cached_copy_path(f.path)
    if not is_copy_of(copy, f):
        return [("gpu plan", "once repacked (on first use, or `pyruntime repack MODEL`)")]
    return _gpu_plan_rows(open_gguf(copy), args)


def _gpu_plan_rows(f: Any, args: argparse.Namespace) -> list[tuple[str, str]]:
    """Where the model would run under --gpu-mem (default: this machine's GPU's budget) at
    -c/--ctx-size tokens; a line saying so without a budget or a GPU."""
    from pyruntime.model.config import ModelConfig
    from pyruntime.offload.plan import device_bytes, plan_budget

    cfg = ModelConfig.from_gguf(f)
    n_ctx = options.value("n_ctx", args.n_ctx) or cfg.context_length
    budget = options.value("gpu_mem", args.gpu_mem)
    if budget is None:
        import torch

        if not torch.cuda.is_available():
            return [("gpu plan", "no GPU here: give --gpu-mem SIZE for the plan on one")]
        from pyruntime.placement import gpu_budget

        budget, _ = gpu_budget(torch.device("cuda"), None)
    return plan_budget(device_bytes(f, cfg, n_ctx), budget, n_ctx).rows()


# ---------------------------------------------------------------------------------------------
# Helpers


_WARNED_UNDECODABLE: set[str] = set()


def _valid_text(text: str, what: str) -> str:
    """`text` with bytes that were not UTF-8 (read as lone surrogates: argv, a reconfigured
    stdin) replaced by U+FFFD, with one warning saying so; the tokenizer cannot take them."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        pass
    try:
        fixed = text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
    except UnicodeEncodeError:  # surrogates that were not bytes: replace them too
        fixed = text.encode("utf-8", "replace").decode("utf-8")
    if what not in _WARNED_UNDECODABLE:  # once per source, not per line of a session
        _WARNED_UNDECODABLE.add(what)
        warnings.warn(
            f"{what} had bytes that are not UTF-8; they were replaced by U+FFFD",
            PyruntimeWarning,
            stacklevel=2,
        )
    return fixed


def _check_output(path: Path) -> None:
    """UsageError unless a file can be written at `path` (its folder exists and is writable)."""
    if path.is_dir():
        raise UsageError(f"{path}: is a directory; give -o a file name")
    if not path.parent.is_dir():
        raise UsageError(f"{path}: folder {path.parent} does not exist; choose another -o FILE")
    try:
        check_writable(path.parent)
    except OSError as exc:
        raise UsageError(
            f"{path}: cannot write in {path.parent} ({exc.strerror or exc}); choose another "
            "place with -o FILE"
        ) from None


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UsageError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise UsageError(f"{path}: is a directory, expected a text file") from None
    except UnicodeDecodeError as exc:
        raise UsageError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except OSError as exc:
        raise UsageError(f"{path}: cannot read ({exc.strerror})") from None


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def _human_count(n: float) -> str:
    for unit in ("", "K", "M", "B"):
        if n < 1000 or unit == "B":
            return f"{n:.2f}{unit}" if unit else str(int(n))
        n /= 1000
    return f"{n:.2f}T"
