"""Tokenizer from the GGUF vs transformers.AutoTokenizer on the same (demo) checkpoint."""

import json
from pathlib import Path

import pytest
import tokenizers

from pyruntime.gguf.file import open_gguf
from pyruntime.text.tokenizer import IncrementalDetokenizer, Tokenizer
from pyruntime.tools.demo import DEMO_SOURCE, demo_model_path

TEXTS = [
    "",
    "Hello world",
    "  leading spaces and trailing   ",
    "Tabs\tand\nnewlines\r\n\n",
    "Héllo wörld, naïve café — “quotes” … 日本語のテキスト 🙂👍🏽",
    "<|im_start|>user\nTell me a fortune.<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more text<|im_end|>",
    "numbers 1234567890 3.14159 and symbols {}[]()<>!?@#$%^&*",
    "def f(x):\n    return x ** 2  # comment\n",
]


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory) -> Path:
    # One conversion per test session, shared with the other test files through the cache dir.
    return demo_model_path(tmp_path_factory.getbasetemp() / "pyruntime-cache", quiet=True)


@pytest.fixture(scope="module")
def tok(gguf_path) -> Tokenizer:
    return Tokenizer.from_gguf(open_gguf(gguf_path))


@pytest.fixture(scope="module")
def hf_tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(DEMO_SOURCE)


@pytest.fixture(scope="module")
def long_text(shared) -> str:
    return (shared / "data" / "eval-jargon.txt").read_text(encoding="utf-8")[:20000]


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_transformers(tok, hf_tok, text):
    ids = tok.encode(text)
    assert ids == hf_tok(text)["input_ids"]
    assert (
        tok.encode(text, add_special=False) == hf_tok(text, add_special_tokens=False)["input_ids"]
    )
    for skip in (True, False):
        assert tok.decode(ids, skip_special=skip) == hf_tok.decode(ids, skip_special_tokens=skip)


def test_long_text_matches_transformers(tok, hf_tok, long_text):
    ids = tok.encode(long_text)
    assert len(ids) > 3000
    assert ids == hf_tok(long_text)["input_ids"]
    assert tok.decode(ids) == hf_tok.decode(ids, skip_special_tokens=True)


def test_special_ids_and_template_from_gguf(tok):
    config = json.loads((DEMO_SOURCE / "tokenizer_config.json").read_text())
    generation = json.loads((DEMO_SOURCE / "generation_config.json").read_text())
    assert tok.bos_id is None and tok.add_bos is False
    assert tok.eos_id == 0
    assert tok.stop_ids == frozenset(generation["eos_token_id"])  # <|endoftext|>, <|im_end|>
    assert tok.chat_template == config["chat_template"]
    assert tok.token_text(2) == "<|im_end|>"
    assert tok.vocab_size == 4096


def test_bos_is_prepended_only_when_the_model_asks():
    hf = tokenizers.Tokenizer.from_file(str(DEMO_SOURCE / "tokenizer.json"))
    with_bos = Tokenizer(hf, bos_id=1, eos_id=0, stop_ids=[0], add_bos=True, chat_template=None)
    plain = hf.encode("Hi there", add_special_tokens=False).ids
    assert with_bos.encode("Hi there") == [1, *plain]
    assert with_bos.encode("Hi there", add_special=False) == plain
    # a text that already starts with the BOS token gets no second one
    assert with_bos.encode("<|im_start|>Hi there") == [1, *plain]


@pytest.mark.parametrize("text", TEXTS[1:])
def test_incremental_detokenizer_never_splits_a_character(tok, text):
    ids = tok.encode(text)
    for skip in (True, False):
        detok = IncrementalDetokenizer(tok, skip_special=skip)
        pieces = [detok.push(i) for i in ids]
        pieces.append(detok.flush())
        assert "".join(pieces) == tok.decode(ids, skip_special=skip)
        assert not any("\ufffd" in p for p in pieces)


def test_incremental_detokenizer_holds_back_partial_utf8(tok):
    ids = tok.encode("🙂")
    assert len(ids) > 1  # byte-level BPE splits the emoji's 4 bytes
    detok = IncrementalDetokenizer(tok)
    assert [detok.push(i) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.push(ids[-1]) == "🙂"


def test_incremental_detokenizer_on_long_text(tok, long_text):
    ids = tok.encode(long_text[:5000])
    detok = IncrementalDetokenizer(tok)
    assert "".join(detok.push(i) for i in ids) + detok.flush() == tok.decode(ids)
