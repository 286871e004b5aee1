"""The built-in demo model: a tiny trained OLMoE shipped inside the package, in HF format.

On first use it is converted to an f32 GGUF in the user cache dir and reused afterwards. The cache
file name carries a key of the packaged checkpoint and the GGUF layout version, so a new package
version with another checkpoint or layout converts again instead of reading a stale file.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import sys
from pathlib import Path

from pyruntime import options
from pyruntime.errors import ConversionError
from pyruntime.model.layout import LAYOUT_VERSION

DEMO_NAME = "tiny-olmoe"
DEMO_SOURCE = Path(__file__).resolve().parent / "demo_model" / DEMO_NAME


def _source_key(source: Path) -> str:
    """Short hash of the checkpoint's small files and the weights' size (hashing MBs is slow)."""
    h = hashlib.sha256(f"layout{LAYOUT_VERSION}".encode())
    for p in sorted(source.iterdir()):
        h.update(p.name.encode())
        h.update(p.read_bytes() if p.stat().st_size < 1 << 20 else str(p.stat().st_size).encode())
    return h.hexdigest()[:12]


def demo_model_path(cache: Path | None = None, quiet: bool = False) -> Path:
    """Path of the demo GGUF, converting it on first use (one line on stderr unless quiet).

    The conversion writes a temporary file in the cache dir and renames it into place, so an
    interrupted or concurrent first run never leaves a partial model behind.
    """
    if not (DEMO_SOURCE / "config.json").is_file():
        raise ConversionError(
            f"the demo checkpoint is missing from the package ({DEMO_SOURCE}); reinstall pyruntime"
        )
    cache = cache if cache is not None else options.writable_cache_dir()
    target = cache / f"demo-{DEMO_NAME}-f32-{_source_key(DEMO_SOURCE)}.gguf"
    if target.is_file():
        return target
    from pyruntime.converter import convert  # heavy import, only when converting

    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConversionError(
            f"cannot create the cache dir {cache} ({exc.strerror}); set PYRUNTIME_CACHE to a "
            "writable folder"
        ) from None
    if not quiet:
        print(f"pyruntime: converting the demo model to {target} (first use only)", file=sys.stderr)
    # convert() writes beside the target and renames: an interrupted or concurrent first run
    # never leaves a partial model behind (force: a concurrent run may have just finished).
    with contextlib.redirect_stdout(io.StringIO()):  # keep our stdout for the answer alone
        convert(DEMO_SOURCE, outfile=target, outtype="f32", progress=False, force=True)
    return target
