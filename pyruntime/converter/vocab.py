"""Tokenizer metadata: ggml vocab, special ids, chat template, stop ids (docs/gguf-layout.md).

Only byte-level BPE tokenizers (tokenizer.json with a BPE model) are supported; the original
tokenizer.json is also stored verbatim, and the runtime tokenizes with it. The ggml vocabulary
and `tokenizer.ggml.pre` (llama.cpp's name of the same pre-tokenizer split) let llama.cpp, and
pyruntime without the json, tokenize the file the same way.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gguf import GGUFWriter

from pyruntime.converter.hparams import read_json
from pyruntime.errors import ConversionError
from pyruntime.text.ggml_vocab import pre_tokenizer_name

TOKEN_NORMAL, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED = 1, 3, 4, 5
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>")


@dataclass
class Vocab:
    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    hf_json: str
    pre: str | None  # llama.cpp's name of the pre-tokenizer (None: none splits the same way)
    bos_id: int | None = None
    eos_id: int | None = None
    eot_id: int | None = None
    pad_id: int | None = None
    add_bos: bool = False
    chat_template: str | None = None
    stop_ids: list[int] = field(default_factory=list)


def _token_content(value: Any) -> str | None:
    """tokenizer_config.json stores special tokens as a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _first_int(value: Any) -> int | None:
    if isinstance(value, list):
        value = value[0] if value else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _chat_template(model_dir: Path, tok_config: dict[str, Any]) -> str | None:
    jinja = model_dir / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    template = tok_config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) else None


def load_vocab(
    model_dir: Path,
    config: dict[str, Any],
    vocab_size: int,
    end_of_turn: tuple[str, ...] = END_OF_TURN_TOKENS,
) -> Vocab:
    """Read tokenizer.json (+ tokenizer_config.json, generation_config.json, chat_template.jinja
    when present). end_of_turn: the tokens that may end a turn, first present wins (the
    family's: gpt-oss's harmony format ends a message with <|end|> but a turn with <|return|>)."""
    tok_path = model_dir / "tokenizer.json"
    tok = read_json(tok_path, "tokenizer.json")
    model = tok.get("model") or {}
    if model.get("type") != "BPE" or not isinstance(model.get("vocab"), dict):
        raise ConversionError(
            f"{tok_path}: tokenizer model is {model.get('type')!r}; "
            "only byte-level BPE is supported"
        )
    by_id: dict[int, tuple[str, int]] = {i: (t, TOKEN_NORMAL) for t, i in model["vocab"].items()}
    for added in tok.get("added_tokens") or []:
        kind = TOKEN_CONTROL if added.get("special") else TOKEN_USER_DEFINED
        by_id[int(added["id"])] = (added["content"], kind)
    n_tokens = max(by_id) + 1
    if n_tokens > vocab_size:
        raise ConversionError(
            f"{tok_path}: token id {n_tokens - 1} exceeds config.json vocab_size {vocab_size}; "
            "tokenizer and model do not match"
        )
    tokens = [by_id.get(i, (f"[PAD{i}]", TOKEN_UNUSED)) for i in range(vocab_size)]
    id_of = {text: i for i, (text, _) in enumerate(tokens)}
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]

    tc_path = model_dir / "tokenizer_config.json"
    tok_config = read_json(tc_path, "tokenizer_config.json") if tc_path.is_file() else {}

    def special_id(key: str) -> int | None:
        # tokenizer_config.json names the token; config.json's *_token_id is the fallback
        if key in tok_config:
            content = _token_content(tok_config[key])
            return id_of.get(content) if content is not None else None
        return _first_int(config.get(f"{key}_id"))

    vocab = Vocab(
        tokens=[t for t, _ in tokens],
        token_types=[k for _, k in tokens],
        merges=merges,
        hf_json=tok_path.read_text(encoding="utf-8"),
        pre=pre_tokenizer_name(tok),
        bos_id=special_id("bos_token"),
        eos_id=special_id("eos_token"),
        eot_id=next((id_of[t] for t in end_of_turn if t in id_of), None),
        pad_id=special_id("pad_token"),
        chat_template=_chat_template(model_dir, tok_config),
    )
    vocab.add_bos = _adds_bos(tok, tok_config, vocab.bos_id)

    gen_path = model_dir / "generation_config.json"
    gen = read_json(gen_path, "generation_config.json") if gen_path.is_file() else {}
    gen_eos = gen.get("eos_token_id")
    candidates = [vocab.eos_id, vocab.eot_id]
    candidates += gen_eos if isinstance(gen_eos, list) else [gen_eos]
    for i in candidates:
        if isinstance(i, int) and 0 <= i < vocab_size and i not in vocab.stop_ids:
            vocab.stop_ids.append(i)
    return vocab


def _adds_bos(tok: dict[str, Any], tok_config: dict[str, Any], bos_id: int | None) -> bool:
    """tokenizer_config's add_bos_token if given, else whether the post-processor prepends BOS."""
    if isinstance(tok_config.get("add_bos_token"), bool):
        return tok_config["add_bos_token"] and bos_id is not None
    post = tok.get("post_processor") or {}
    if bos_id is None or post.get("type") != "TemplateProcessing":
        return False
    first = (post.get("single") or [{}])[0]
    special = first.get("SpecialToken") if isinstance(first, dict) else None
    if not special:
        return False
    ids = (post.get("special_tokens") or {}).get(special.get("id"), {}).get("ids") or []
    return bos_id in ids


def write_vocab(w: GGUFWriter, vocab: Vocab) -> None:
    w.add_string("tokenizer.ggml.model", "gpt2")
    if vocab.pre is not None:
        w.add_string("tokenizer.ggml.pre", vocab.pre)
    else:  # llama.cpp would split with its "default" regexes (and warn); pyruntime reads the json
        print(
            "warning: tokenizer.json's pre-tokenizer matches none that llama.cpp knows; "
            "tokenizer.ggml.pre is left out (pyruntime tokenizes with tokenizer.json)",
            file=sys.stderr,
        )
    w.add_array("tokenizer.ggml.tokens", vocab.tokens)
    w.add_array("tokenizer.ggml.token_type", vocab.token_types)
    if vocab.merges:
        w.add_array("tokenizer.ggml.merges", vocab.merges)
    for key, value in (
        ("bos_token_id", vocab.bos_id),
        ("eos_token_id", vocab.eos_id),
        ("eot_token_id", vocab.eot_id),
        ("padding_token_id", vocab.pad_id),
    ):
        if value is not None:
            w.add_uint32(f"tokenizer.ggml.{key}", value)
    w.add_bool("tokenizer.ggml.add_bos_token", vocab.add_bos)
    w.add_string("tokenizer.huggingface.json", vocab.hf_json)
    if vocab.chat_template is not None:
        w.add_string("tokenizer.chat_template", vocab.chat_template)
    if vocab.stop_ids:
        w.add_array("pyruntime.stop_token_ids", vocab.stop_ids)
