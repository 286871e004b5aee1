"""convert(): HF checkpoint -> GGUF file, streamed, atomic (temp file beside it + os.replace)."""

from __future__ import annotations

import os
import shutil
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
from gguf import GGUFWriter
from tqdm import tqdm

from pyruntime.converter import architectures, deepseek2, gpt_oss, llama4, qwen35  # noqa: F401  (register the classes)
from pyruntime.converter.base import MoeModel, model_class_for
from pyruntime.converter.hparams import HParams
from pyruntime.converter.hub import model_name, resolve_model
from pyruntime.converter.sources import SourceTensors
from pyruntime.converter.tensors import OUTTYPES, StreamedTensor, choose_qtype
from pyruntime.converter.vocab import Vocab, load_vocab, write_vocab
from pyruntime.errors import ConversionError, UsageError
from pyruntime.model.layout import LAYOUT_VERSION  # docs/gguf-layout.md
from pyruntime.output_files import atomic_output, check_writable, size_text

QUANTIZATION_VERSION = 2
ALIGNMENT = 32  # gguf-py's default tensor alignment
INPUT_SUFFIXES = (".json", ".safetensors", ".jinja")  # the checkpoint's files a conversion reads


def default_outfile(name: str, outtype: str) -> Path:
    """`<model-name>-<outtype>.gguf` in the current directory."""
    return Path.cwd() / f"{name.rstrip('/').split('/')[-1]}-{outtype}.gguf"


def convert(
    model: str | Path,
    outfile: Path | None = None,
    outtype: str = "f16",
    progress: bool = True,
    force: bool = False,
) -> Path:
    """Convert a local HF folder or Hub repo id to GGUF (docs/gguf-layout.md); returns the path.

    The destination is checked before anything is read or downloaded: an existing `outfile` is
    refused unless `force` (a symlink: its target is replaced), a file of the checkpoint always,
    and the folder must exist and be writable; before writing, its free space must hold the
    planned size. The file is written beside the destination and renamed into place only when
    the whole conversion succeeded (pyruntime.output_files: the umask's mode; SIGINT and SIGTERM
    remove the temporary file)."""
    if outtype not in OUTTYPES:
        raise UsageError(f"unknown outtype '{outtype}'; use one of {', '.join(OUTTYPES)}")
    outfile = Path(outfile) if outfile is not None else default_outfile(model_name(model), outtype)
    local = Path(model).expanduser()
    dest = _destination(outfile, force, local if local.is_dir() else None)
    model_dir, name = resolve_model(model)
    _refuse_inputs(dest, model_dir)

    # Plan: parse config + tokenizer, map every tensor (no weight data read yet).
    hp = HParams.load(model_dir)
    hf_arch, model_cls = model_class_for(hp)
    src = SourceTensors(model_dir)
    arch = model_cls(hp, src, hf_arch)
    vocab = load_vocab(model_dir, hp.config, arch.n_vocab, arch.end_of_turn_tokens)
    plan = arch.tensor_plan()
    src.check_complete()
    n_layer = 1 + max((int(t.name.split(".")[1]) for t in plan if t.name.startswith("blk.")),
                      default=-1)  # fmt: skip
    qtypes = [choose_qtype(t.kind, t.shape[-1], outtype, t.name, n_layer) for t in plan]
    streamed = [StreamedTensor(t, q) for t, q in zip(plan, qtypes, strict=True)]
    _check_space(dest, _planned_bytes(streamed, vocab))

    start = time.perf_counter()
    try:
        with atomic_output(dest) as tmp:
            _write(tmp, arch, vocab, name, outtype, hf_arch, streamed, progress)
    except OSError as exc:
        raise ConversionError(
            f"{dest}: writing the GGUF failed ({exc.strerror or exc}); nothing was written"
        ) from None
    if progress:
        counts = Counter(q.name for q in qtypes)
        size = dest.stat().st_size
        print(
            f"wrote {dest}: {len(plan)} tensors, {size / 1e6:.1f} MB, "
            f"{', '.join(f'{k} {v}' for k, v in sorted(counts.items()))}, "
            f"{time.perf_counter() - start:.1f} s",
            file=sys.stderr,
        )
    return dest


def _destination(outfile: Path, force: bool, inputs: Path | None) -> Path:
    """The file to write (a symlink's target), after the checks that need no download."""
    if outfile.is_dir():
        raise ConversionError(f"{outfile}: is a directory; give --outfile a file name")
    dest = Path(os.path.realpath(outfile))
    if inputs is not None:
        _refuse_inputs(dest, inputs)
    if os.path.lexists(outfile) and not force:
        raise ConversionError(f"{outfile} exists; pass --force to overwrite it")
    if dest.exists() and not dest.is_file():
        raise ConversionError(f"{outfile}: is not a regular file; refusing to replace it")
    if not dest.parent.is_dir():
        raise ConversionError(f"{outfile}: output folder {dest.parent} does not exist; create it")
    try:
        check_writable(dest.parent)
    except OSError as exc:
        raise ConversionError(
            f"{outfile}: cannot write in {dest.parent} ({exc.strerror or exc})"
        ) from None
    return dest


def _refuse_inputs(dest: Path, model_dir: Path) -> None:
    """Never write over a file of the checkpoint (config, weights, tokenizer), --force or not."""
    if not dest.exists():
        return
    for path in model_dir.iterdir():
        if path.suffix in INPUT_SUFFIXES and path.is_file() and os.path.samefile(path, dest):
            raise ConversionError(
                f"{dest}: is the checkpoint's own {path.name}; the converter never writes over "
                "its input (choose another --outfile)"
            )


def _planned_bytes(streamed: list[StreamedTensor], vocab: Vocab) -> int:
    """The output's size, near enough: tensor data (padded) and the large metadata."""
    data = sum(-(-s.nbytes // ALIGNMENT) * ALIGNMENT for s in streamed)
    text = sum(len(t.encode()) + 8 for t in (*vocab.tokens, *vocab.merges))
    text += len(vocab.hf_json.encode()) + len((vocab.chat_template or "").encode())
    return data + text + (1 << 20)


def _check_space(dest: Path, need: int) -> None:
    free = shutil.disk_usage(dest.parent).free
    if free < need:
        raise ConversionError(
            f"{dest}: the GGUF needs about {size_text(need)}, and {dest.parent} has "
            f"{size_text(free)} free"
        )


def _write(
    path: Path,
    arch: MoeModel,
    vocab: Vocab,
    name: str,
    outtype: str,
    hf_arch: str,
    streamed: list[StreamedTensor],
    progress: bool,
) -> None:
    writer = GGUFWriter(path, arch.gguf_arch)
    try:
        _write_metadata(writer, arch, vocab, name, outtype, hf_arch)
        for s in streamed:
            # `tensor_dtype` is ignored when raw_dtype is given and the dtype is not uint8
            writer.add_tensor_info(s.out.name, s.out.shape, np.dtype(np.float32), s.nbytes, s.qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        bar = tqdm(
            streamed, desc="converting", unit="tensor", file=sys.stderr, disable=not progress
        )
        for s in bar:
            bar.set_postfix_str(s.out.name, refresh=False)
            writer.write_tensor_data(s)  # type: ignore[arg-type]  # duck-typed streamed tensor
    finally:
        writer.close()


def _write_metadata(
    w: GGUFWriter, arch: MoeModel, vocab: Vocab, name: str, outtype: str, hf_arch: str
) -> None:
    w.add_name(name)
    w.add_file_type(int(OUTTYPES[outtype][1]))
    w.add_quantization_version(QUANTIZATION_VERSION)
    w.add_uint32("pyruntime.layout_version", LAYOUT_VERSION)
    w.add_string("pyruntime.hf_architecture", hf_arch)
    arch.set_gguf_parameters(w)
    write_vocab(w, vocab)
