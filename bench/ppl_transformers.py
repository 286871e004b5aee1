"""Reference perplexity with Hugging Face transformers (float32), windowed exactly like
`pyruntime perplexity`: consecutive non-overlapping windows of --ctx tokens (the last one may be
shorter), each scored from scratch, every token after the first of a window counted.

    python bench/ppl_transformers.py ../shared/models/tiny-olmoe \
        -f ../shared/data/eval-jargon.txt --ctx 256
"""

from __future__ import annotations

import argparse
import math

import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("model", help="Hugging Face model folder")
    ap.add_argument("-f", "--file", required=True)
    ap.add_argument("--ctx", type=int, default=512)
    args = ap.parse_args()
    tok = Tokenizer.from_file(f"{args.model}/tokenizer.json")
    ids = tok.encode(open(args.file, encoding="utf-8").read()).ids
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    nll, n = 0.0, 0
    for start in range(0, len(ids), args.ctx):
        window = torch.tensor(ids[start : start + args.ctx])
        if len(window) < 2:
            continue
        with torch.no_grad():
            logp = torch.log_softmax(model(window[None]).logits[0].float(), dim=-1)
        nll -= logp[:-1].gather(1, window[1:, None]).sum().item()
        n += len(window) - 1
    print(f"tokens scored {n}")
    print(f"ppl = {math.exp(nll / n):.4f}")


if __name__ == "__main__":
    main()
