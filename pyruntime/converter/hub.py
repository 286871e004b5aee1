"""Resolve MODEL (a local HF folder or a Hub repo id) to a local folder."""

from __future__ import annotations

import re
from pathlib import Path

from pyruntime.errors import ConversionError

# What a conversion reads: configs, weights, tokenizer files, chat templates.
HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.jinja"]
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def model_name(model: str | Path) -> str:
    """The display name of MODEL without fetching it: a folder's name, or the repo id."""
    path = Path(model).expanduser()
    return path.resolve().name if path.is_dir() else str(model)


def resolve_model(model: str | Path) -> tuple[Path, str]:
    """(local folder, display name). A Hub id is fetched with snapshot_download, which honours
    HF_HUB_OFFLINE, HF_HOME/HF_HUB_CACHE and reuses its cache."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path, model_name(model)
    if path.exists():
        raise ConversionError(f"{path} is a file; pass the model folder (with config.json)")
    repo_id = str(model)
    if not _REPO_ID.match(repo_id):
        raise ConversionError(
            f"{model}: no such folder; pass a local Hugging Face model folder or a Hub repo id "
            "(org/name)"
        )
    from huggingface_hub import snapshot_download  # imported late: reads HF_* env at import

    try:
        folder = snapshot_download(repo_id=repo_id, allow_patterns=HUB_PATTERNS)
    except Exception as exc:  # hub errors: offline cache miss, unknown repo, network, auth
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConversionError(
            f"{model}: not a local folder, and fetching it from the Hugging Face Hub failed "
            f"({type(exc).__name__}: {first_line})"
        ) from None
    return Path(folder), repo_id
