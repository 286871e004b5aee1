"""Does pyruntime read a llama.cpp GGUF as llama.cpp does: the same token ids as llama-tokenize,
and a perplexity within 0.5% of llama-perplexity's, scored the same way?

For each GGUF given (llama.cpp's layout, or ours: llama.cpp reads only the tokenizer of ours):
runs `llama-tokenize --ids --no-escape` on the text and compares with pyruntime's ids; for a
llama.cpp-layout file also runs `llama-perplexity -c CTX` and scores pyruntime's logits as it does
(consecutive windows of CTX tokens, BOS first when the model adds one, only the second half of
each window scored: tools/perplexity of llama.cpp). Exits 1 when an id differs or a ratio is
off by more than 0.5%. The llama.cpp tools: `bench/peers_build.sh` (llama-bench), then
`cmake --build /tmp/peers/llama.cpp/build-cpu --target llama-tokenize llama-perplexity`; a
llama.cpp-layout file from a checkpoint: llama.cpp's `convert_hf_to_gguf.py` (with
PYTHONPATH=/tmp/peers/llama.cpp/gguf-py), Q4_0 from it by `llama-quantize`.

    python bench/llamacpp_parity.py M-q8_0.gguf M-f16.gguf -f ../shared/data/eval-jargon.txt \
        --bin /tmp/peers/llama.cpp/build-cpu/bin --ctx 256
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's pyruntime
from pyruntime.api import Model  # noqa: E402
from pyruntime.gguf.file import open_gguf  # noqa: E402
from pyruntime.model.llamacpp_layout import detect_layout  # noqa: E402


def llama_ids(bin_dir: Path, model: Path, text_file: Path) -> list[int]:
    out = subprocess.run(
        [str(bin_dir / "llama-tokenize"), "-m", str(model), "-f", str(text_file), "--ids",
         "--no-escape", "--log-disable"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    return ast.literal_eval(out.strip().splitlines()[-1])


def llama_ppl(bin_dir: Path, model: Path, text_file: Path, ctx: int, threads: int
              ) -> tuple[float, int]:  # fmt: skip
    """llama-perplexity's perplexity and the windows it covers. Its log is written by a thread
    that is not waited for at exit, so the last lines (the final estimate among them) can be
    lost on a busy machine: then the running value of the last window printed, `[i]ppl`, is
    taken with i windows."""
    out = subprocess.run(
        [str(bin_dir / "llama-perplexity"), "-m", str(model), "-f", str(text_file), "-c",
         str(ctx), "-b", str(ctx), "-t", str(threads)],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    log = out.stdout + out.stderr
    final = re.search(r"Final estimate: PPL = ([0-9.]+)", log)
    chunks = re.search(r"calculating perplexity over (\d+) chunks", log)
    if final is not None and chunks is not None:
        return float(final.group(1)), int(chunks.group(1))
    running = re.findall(r"\[(\d+)\]([0-9.]+),", log)
    if not running:
        raise SystemExit(f"llama-perplexity printed no estimate: {out.stderr[-500:]}")
    return float(running[-1][1]), int(running[-1][0])


def our_ppl(model: Model, ids: list[int], ctx: int, windows: int) -> float:
    """llama-perplexity's scoring of our logits over the first `windows` windows."""
    tok = model.tokenizer
    nll, count = 0.0, 0
    for c in range(min(windows, len(ids) // ctx)):
        window = ids[c * ctx : (c + 1) * ctx]
        if tok.add_bos:
            window = [tok.bos_id, *window[1:]]
        logits = model.logits(window).astype(np.float64)
        top = logits.max(axis=1, keepdims=True)
        lse = np.log(np.exp(logits - top).sum(axis=1)) + top[:, 0]
        for i in range(ctx // 2, ctx - 1):
            nll += lse[i] - logits[i, window[i + 1]]
            count += 1
    return math.exp(nll / count)


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("models", nargs="+", type=Path)
    p.add_argument("-f", "--file", type=Path, required=True, help="text (UTF-8)")
    p.add_argument("--bin", type=Path, required=True, help="folder of llama-tokenize, -perplexity")
    p.add_argument("--ctx", type=int, default=256)
    p.add_argument("-t", "--threads", type=int, default=2)
    args = p.parse_args()
    text = args.file.read_text(encoding="utf-8")
    ok = True
    for path in args.models:
        layout = detect_layout(open_gguf(path))
        model = Model(path, n_ctx=args.ctx, device="cpu", threads=args.threads)
        ours = model.tokenize(text)
        theirs = llama_ids(args.bin, path, args.file)
        row = {"model": path.name, "layout": layout, "tokens": len(ours),
               "llama_tokens": len(theirs), "same_ids": ours == theirs}  # fmt: skip
        ok &= ours == theirs
        if layout == "llama.cpp":
            ref, windows = llama_ppl(args.bin, path, args.file, args.ctx, args.threads)
            ppl = our_ppl(model, ours, args.ctx, windows)
            row |= {"windows": windows, "ppl": round(ppl, 4), "llama_ppl": ref,
                    "ratio": round(ppl / ref, 5)}  # fmt: skip
            ok &= abs(ppl / ref - 1) <= 0.005
        print(json.dumps(row), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
