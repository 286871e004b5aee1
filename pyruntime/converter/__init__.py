"""Hugging Face checkpoint -> pyruntime GGUF converter (layout: docs/gguf-layout.md).

`convert(model, outfile, outtype)` is the API; `convert_hf_to_gguf.py` is the CLI. Architectures
live in `architectures.py`, one `@register(...)` class each.
"""

from pyruntime.converter.base import register, supported_architectures
from pyruntime.converter.convert import convert

__all__ = ["convert", "register", "supported_architectures"]
