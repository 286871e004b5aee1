"""The tokenizer from a GGUF's ggml vocabulary alone (llama.cpp's files carry no tokenizer.json):
the ids llama.cpp's llama-tokenize gives, and the converter's tokenizer.ggml.pre."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from gguf import GGUFWriter

from pyruntime.converter.vocab import load_vocab, write_vocab
from pyruntime.errors import ModelFileError
from pyruntime.gguf.file import open_gguf
from pyruntime.text.ggml_vocab import PRE_TOKENIZERS, pre_tokenizer_name
from pyruntime.text.tokenizer import Tokenizer

DATA = Path(__file__).resolve().parent / "data"
GOLDEN = json.loads((DATA / "llama_tokenize_tiny.json").read_text(encoding="utf-8"))["cases"]


def _vocab_file(path: Path, pre: str | None = "gpt-2", drop=("tokenizer.huggingface.json",),
                **keys) -> Path:  # fmt: skip
    """A GGUF holding the tiny tokenizer's vocabulary keys (as the converter writes them) and
    no tensor, without `drop`."""
    vocab = load_vocab(DATA / "tiny-tokenizer", {}, 4096)
    vocab.pre = pre
    w = GGUFWriter(path, "olmoe")
    write_vocab(w, vocab)
    for key in drop:
        w.kv_data[0].pop(key, None)
    for key, value in keys.items():
        w.kv_data[0].pop(key.replace("__", "."), None)
        if value is not None:
            w.add_string(key.replace("__", "."), value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def ggml_tok(tmp_path_factory) -> Tokenizer:
    return Tokenizer.from_gguf(open_gguf(_vocab_file(tmp_path_factory.mktemp("v") / "v.gguf")))


@pytest.fixture(scope="module")
def hf_tok(tmp_path_factory) -> Tokenizer:
    path = _vocab_file(tmp_path_factory.mktemp("h") / "h.gguf", drop=())
    return Tokenizer.from_gguf(open_gguf(path))


@pytest.mark.parametrize("case", GOLDEN, ids=lambda c: repr(c["text"][:20]))
def test_same_ids_as_llama_tokenize(ggml_tok, hf_tok, case):
    """llama-tokenize's ids (recorded, tests/data/llama_tokenize_tiny.json), from the ggml
    vocabulary alone; and the stored tokenizer.json gives the same (our files agree with
    llama.cpp once tokenizer.ggml.pre is right)."""
    assert ggml_tok.encode(case["text"]) == case["ids"]
    assert hf_tok.encode(case["text"]) == case["ids"]
    assert ggml_tok.decode(case["ids"], skip_special=False) == case["text"]


def test_whole_text_like_tokenizer_json(ggml_tok, hf_tok, shared):
    text = (shared / "data" / "eval-jargon.txt").read_text(encoding="utf-8")
    ids = ggml_tok.encode(text)
    assert ids == hf_tok.encode(text) and len(ids) == 43187  # llama-tokenize's count


def test_default_pre_tokenizer_splits_otherwise(tmp_path):
    """'default' (what our converter used to write) splits punctuation runs apart: a file that
    names it tokenizes as llama.cpp would tokenize it, not as tokenizer.json does."""
    tok = Tokenizer.from_gguf(open_gguf(_vocab_file(tmp_path / "d.gguf", pre="default")))
    case = next(c for c in GOLDEN if c["text"].startswith("12345"))
    assert tok.encode(case["text"]) != case["ids"]


def test_special_tokens_and_decoding(ggml_tok):
    ids = ggml_tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2  # control tokens split out, as llama.cpp parse_special
    assert ggml_tok.decode(ids) == "user\nhi"  # and skipped when decoding
    assert ggml_tok.stop_ids == {0, 2}  # eos and eot (<|im_end|>)


def test_missing_or_unknown_vocabulary_is_one_line(tmp_path):
    path = _vocab_file(tmp_path / "a.gguf", tokenizer__ggml__pre="klingon")
    with pytest.raises(ModelFileError, match=r"tokenizer.ggml.pre 'klingon' is a pre-tokenizer"):
        Tokenizer.from_gguf(open_gguf(path))
    path = _vocab_file(tmp_path / "b.gguf", tokenizer__ggml__model="llama")
    with pytest.raises(ModelFileError, match=r"tokenizer.ggml.model is 'llama'; without"):
        Tokenizer.from_gguf(open_gguf(path))
    path = _vocab_file(tmp_path / "c.gguf", drop=("tokenizer.huggingface.json",
                                                  "tokenizer.ggml.merges"))  # fmt: skip
    with pytest.raises(ModelFileError, match=r"'tokenizer.ggml.merges' is missing"):
        Tokenizer.from_gguf(open_gguf(path))


def _split(regex: str) -> dict:
    return {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False}


def test_pre_tokenizer_names():
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True}
    no_regex = {**byte_level, "use_regex": False}
    qwen2 = (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
        r"|\s*[\r\n]+|\s+(?!\S)|\s+"
    )
    llama3 = qwen2.replace(r"\p{N}|", r"\p{N}{1,3}|")
    seq = lambda *p: {"pre_tokenizer": {"type": "Sequence", "pretokenizers": list(p)}}  # noqa: E731
    assert pre_tokenizer_name({"pre_tokenizer": byte_level}) == "gpt-2"
    assert pre_tokenizer_name(seq(_split(qwen2), no_regex)) == "qwen2"
    assert pre_tokenizer_name(seq(_split(llama3), no_regex)) == "llama-bpe"
    assert pre_tokenizer_name({"pre_tokenizer": {**byte_level, "add_prefix_space": True}}) is None
    assert pre_tokenizer_name({"pre_tokenizer": {"type": "Metaspace"}}) is None
    assert pre_tokenizer_name({"pre_tokenizer": None}) is None
    for name in ("gpt-2", "qwen2", "llama-bpe", "olmo", "default"):
        assert name in PRE_TOKENIZERS
