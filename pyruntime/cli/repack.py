"""`pyruntime repack`: a llama.cpp GGUF rewritten in pyruntime's layout, ahead of first use."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from pyruntime.cli.common import check_output, no_output_written
from pyruntime.errors import UsageError
from pyruntime.output_files import Terminated, signals_raise

# --outtype of `repack` and of convert_hf_to_gguf.py (the converter's;
# pyruntime.converter.tensors.OUTTYPES, kept in sync by a test: importing it here would load numpy,
# gguf and torch for `--help`)
OUTTYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "mxfp4", "q4_k_m", "q5_k_m", "q6_k")


def add_parser(sub: Any) -> None:
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
        "rows, which must be transposed, are quantized again in it: f32 keeps them exact); "
        "needs -o: the cached copy keeps the file's own types, as opening MODEL runs it",
    )  # fmt: skip
    p.add_argument(
        "--force", action="store_true",
        help="overwrite an existing FILE (without -o: write the cached copy again)",
    )  # fmt: skip
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
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
        if args.outtype is not None:  # the cached copy is what opening the file runs
            raise UsageError(
                f"--outtype {args.outtype} needs -o FILE: the cached copy of {f.path} keeps the "
                "file's own types (it is what opening the file runs)"
            )
        dest = cached_copy_path(f.path)
        if not args.force and is_copy_of(dest, f):
            print(f"repack: {dest} is already a current copy of {f.path}", file=sys.stderr)
            print(dest)
            return 0
    else:
        dest = Path(os.path.realpath(args.outfile))
        if os.path.lexists(args.outfile) and not args.force:
            raise UsageError(f"{args.outfile} exists; pass --force to overwrite it")
        if dest.exists() and os.path.samefile(dest, f.path):
            raise UsageError(f"{args.outfile}: is the input file; choose another -o")
        check_output(dest)
    start = time.perf_counter()
    try:
        with signals_raise():  # an error a C extension turned the Ctrl-C into is the interrupt too
            repack(f, dest, args.outtype, progress=True)
    except (KeyboardInterrupt, Terminated) as exc:
        return no_output_written(exc, "repack: ")
    ModelConfig.from_gguf(open_gguf(dest))  # the copy passes every rule of our layout
    print(
        f"repack: wrote {dest} ({dest.stat().st_size / 1e6:.1f} MB) in "
        f"{time.perf_counter() - start:.1f} s",
        file=sys.stderr,
    )
    print(dest)
    return 0
