#!/usr/bin/env python3
"""Convert a Hugging Face MoE checkpoint to GGUF.

    python convert_hf_to_gguf.py MODEL [--outfile F] [--outtype f32|f16|bf16|q8_0|q4_0]

Thin wrapper; the implementation is the `pyruntime.converter` package, its command line
`pyruntime.cli.convert_hf`."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run from a checkout without install

if __name__ == "__main__":
    try:
        from pyruntime.cli.convert_hf import main
    except KeyboardInterrupt:  # Ctrl-C while Python loads the command line
        print("interrupted; no output written", file=sys.stderr)
        sys.exit(130)
    sys.exit(main())
