"""Open a model file in whichever layout it is: ours as it is, llama.cpp's through a repacked copy.

A llama.cpp GGUF (a Hub download, say) is repacked into our layout once (repack.py) and the copy
kept in the cache folder (`pyruntime.options.cache_dir()`, i.e. $PYRUNTIME_CACHE or
~/.cache/pyruntime, under repacked/), named after the source's path. The copy records the source's
size, modification time and header hash; it is used while all three match and made again when
one differs (the source was replaced, re-quantized or edited) or the repack itself changed
(REPACK_VERSION). The copy goes to the cache folder rather than beside the model: a Hub file
lives in the Hugging Face cache (a link into its blobs), model folders are often read-only or
shared, and `pyruntime repack IN -o OUT` puts a copy wherever a user wants one.
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

from pyruntime import options
from pyruntime.converter.repack import SourceIdentity, plan, repack
from pyruntime.errors import ModelFileError
from pyruntime.gguf.file import GGUFFile, open_gguf
from pyruntime.model.llamacpp_layout import check_types, detect_layout


def cached_copy_path(source: Path) -> Path:
    """Where the repacked copy of `source` lives: repacked/<stem>-<hash of its real path>.gguf
    in the cache folder (created; a private temporary folder when it cannot be written)."""
    real = os.path.realpath(source)
    key = hashlib.sha256(real.encode("utf-8", "surrogateescape")).hexdigest()[:16]
    folder = options.writable_cache_dir() / "repacked"
    folder.mkdir(parents=True, exist_ok=True)
    return folder / f"{Path(real).stem}-{key}.gguf"


def is_copy_of(copy: Path, source: GGUFFile) -> bool:
    """Whether `copy` is a complete repack, by this version, of `source` as it is now."""
    if not copy.is_file():
        return False
    try:
        recorded = SourceIdentity.recorded_in(open_gguf(copy))
    except ModelFileError:
        return False
    return recorded == SourceIdentity.of(source)


def open_model_file(path: str | Path, progress: bool = True, in_ram: bool = False) -> GGUFFile:
    """The GGUF to run for `path`: the file itself in our layout, else (llama.cpp's layout) its
    repacked copy, made now when there is no current one. One ModelFileError line for a file
    that is neither, or that llama.cpp's layout rules refuse. in_ram: the one returned is read
    into RAM on huge pages (open_gguf)."""
    f = open_gguf(path)
    if detect_layout(f) != "llama.cpp":  # ours, or neither: ModelConfig says which key or
        return open_gguf(path, in_ram) if in_ram else f  # tensor is missing
    check_types(f)  # a format we do not read (IQ2_XS, Q3_K, ...) is refused before any work
    dest = cached_copy_path(f.path)
    if is_copy_of(dest, f):
        return open_gguf(dest, in_ram)
    plan(f)  # every layout check, before the note and the disk space are spent
    if progress:
        print(
            f"pyruntime: {f.path.name} is in llama.cpp's layout; repacking its experts once "
            f"into {dest}",
            file=sys.stderr,
        )
    repack(f, dest, progress=progress)
    return open_gguf(dest, in_ram)
