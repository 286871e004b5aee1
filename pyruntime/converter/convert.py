"""convert(): HF checkpoint -> GGUF file, streamed, atomic (temp file + os.replace)."""

from __future__ import annotations

import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np
from gguf import GGUFWriter
from tqdm import tqdm

from pyruntime.converter import architectures  # noqa: F401  (registers the architectures)
from pyruntime.converter.base import MoeModel, model_class_for
from pyruntime.converter.hparams import HParams
from pyruntime.converter.hub import resolve_model
from pyruntime.converter.sources import SourceTensors
from pyruntime.converter.tensors import OUTTYPES, StreamedTensor, choose_qtype
from pyruntime.converter.vocab import Vocab, load_vocab, write_vocab
from pyruntime.errors import ConversionError, UsageError
from pyruntime.model.layout import LAYOUT_VERSION  # docs/gguf-layout.md

QUANTIZATION_VERSION = 2


def default_outfile(name: str, outtype: str) -> Path:
    """`<model-name>-<outtype>.gguf` in the current directory."""
    return Path.cwd() / f"{name.rstrip('/').split('/')[-1]}-{outtype}.gguf"


def convert(
    model: str | Path,
    outfile: Path | None = None,
    outtype: str = "f16",
    progress: bool = True,
) -> Path:
    """Convert a local HF folder or Hub repo id to GGUF (docs/gguf-layout.md); returns the path.

    Nothing is written to `outfile` unless the whole conversion succeeds."""
    if outtype not in OUTTYPES:
        raise UsageError(f"unknown outtype '{outtype}'; use one of {', '.join(OUTTYPES)}")
    model_dir, name = resolve_model(model)
    outfile = Path(outfile) if outfile is not None else default_outfile(name, outtype)
    if not outfile.parent.is_dir():
        raise ConversionError(
            f"{outfile}: output folder {outfile.parent} does not exist; create it"
        )

    # Plan: parse config + tokenizer, map every tensor (no weight data read yet).
    hp = HParams.load(model_dir)
    hf_arch, model_cls = model_class_for(hp)
    src = SourceTensors(model_dir)
    arch = model_cls(hp, src, hf_arch)
    vocab = load_vocab(model_dir, hp.config, arch.n_vocab)
    plan = arch.tensor_plan()
    src.check_complete()

    fd, tmp_name = tempfile.mkstemp(prefix=f".{outfile.name}.", suffix=".tmp", dir=outfile.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    start = time.perf_counter()
    writer = GGUFWriter(tmp, arch.gguf_arch)
    try:
        _write_metadata(writer, arch, vocab, name, outtype, hf_arch)
        qtypes = [choose_qtype(t.kind, t.shape[-1], outtype) for t in plan]
        streamed = [StreamedTensor(t, q) for t, q in zip(plan, qtypes, strict=True)]
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
        writer.close()
        os.replace(tmp, outfile)
    except BaseException:
        writer.close()
        tmp.unlink(missing_ok=True)
        raise
    if progress:
        counts = Counter(q.name for q in qtypes)
        size = outfile.stat().st_size
        print(
            f"wrote {outfile}: {len(plan)} tensors, {size / 1e6:.1f} MB, "
            f"{', '.join(f'{k} {v}' for k, v in sorted(counts.items()))}, "
            f"{time.perf_counter() - start:.1f} s",
            file=sys.stderr,
        )
    return outfile


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
