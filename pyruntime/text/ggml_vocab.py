"""A tokenizer from the GGUF's ggml vocabulary alone, tokenizing as llama.cpp's llama-vocab does.

For a file without `tokenizer.huggingface.json` (every llama.cpp GGUF): `tokenizer.ggml.model`
"gpt2" (byte-level BPE) with `tokenizer.ggml.tokens`, `token_type` and `merges`, and the
pre-tokenizer named by `tokenizer.ggml.pre`. The result is a `tokenizers.Tokenizer` (Hugging
Face's Rust tokenizer) built to do what llama.cpp's llm_tokenizer_bpe does:

1. special tokens split out first: every CONTROL, USER_DEFINED and UNKNOWN token's text, matched
   literally (llama.cpp's tokenizer_st_partition with parse_special, as llama-tokenize and the
   chat path use it);
2. the rest split by the pre-tokenizer's regexes in turn (unicode_regex_split: each regex splits
   every piece further, matches and the text between them both kept; HF's Split "isolated");
3. each piece's bytes mapped to GPT-2's byte alphabet, then BPE by merge rank (a piece that is a
   whole token is taken as it is first where llama.cpp sets ignore_merges).

PRE_TOKENIZERS holds llama.cpp's regexes (src/llama-vocab.cpp, llm_tokenizer_bpe), by the names
llama.cpp accepts for them; `pre_tokenizer_name` finds the name of a tokenizer.json's split for
the converter, so llama.cpp tokenizes our files as we do.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import tokenizers

from pyruntime.errors import ModelFileError
from pyruntime.gguf.file import GGUFFile

TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED = 1, 2, 3, 4

_CONTRACTIONS = "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
_QWEN2 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
_QWEN35 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    + _CONTRACTIONS
    + r"?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    + _CONTRACTIONS
    + r"?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class PreTokenizer:
    regexes: tuple[str, ...]  # applied in turn
    ignore_merges: bool = False  # a piece that is a whole token is not merged
    add_bos: bool = False  # llama.cpp's default where tokenizer.ggml.add_bos_token is absent


_PRE = {
    "default": PreTokenizer((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", "[0-9][0-9][0-9]")),
    "gpt-2": PreTokenizer((_GPT2,)),
    "llama3": PreTokenizer((_LLAMA3,), ignore_merges=True, add_bos=True),
    "dbrx": PreTokenizer((_LLAMA3,)),
    "qwen2": PreTokenizer((_QWEN2,)),
    "qwen35": PreTokenizer((_QWEN35,)),
    "starcoder": PreTokenizer((r"\p{N}", _GPT2)),
    "falcon": PreTokenizer((r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, "[0-9][0-9][0-9]")),
    "deepseek-coder": PreTokenizer(
        ("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", "[一-龥ࠀ-一가-퟿]+", r"\p{N}")
    ),
    "chatglm4": PreTokenizer(
        (
            _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
            r"|\s*[\r\n]+|\s+(?!\S)|\s+",
        )
    ),  # fmt: skip
    "gpt-4o": PreTokenizer((_GPT4O,)),
}
# llama.cpp's names for each (src/llama-vocab.cpp, llama_vocab::impl::load); the first is the
# one the converter writes.
_NAMES = {
    "default": ("default",),
    "gpt-2": ("gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de",
              "a.x-4.0", "mellum", "modern-bert", "olmo", "mpt", "jais", "trillion",
              "granite-docling", "exaone4", "jina-v1-en", "jina-v2-code", "roberta-bpe"),
    "llama3": ("llama-bpe", "llama3", "llama-v3", "falcon3", "falcon-h1", "pixtral", "midm-2.0",
               "lfm2", "jina-v5-nano"),
    "dbrx": ("dbrx", "smaug-bpe"),
    "qwen2": ("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "stablelm2", "hunyuan",
              "solar-open", "megrez"),
    "qwen35": ("qwen35",),
    "starcoder": ("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone",
                  "minerva-7b", "mellum2"),
    "falcon": ("falcon",),
    "deepseek-coder": ("deepseek-coder",),
    "chatglm4": ("chatglm-bpe", "glm4"),
    "gpt-4o": ("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"),
}  # fmt: skip
PRE_TOKENIZERS: dict[str, PreTokenizer] = {n: _PRE[k] for k, names in _NAMES.items() for n in names}


def _strings(f: GGUFFile, key: str) -> list[str]:
    value = f.get(key, None)
    if value is None:
        raise ModelFileError(f"{f.path}: metadata key {key!r} is missing (no tokenizer)")
    return list(value)


def ggml_tokenizer(f: GGUFFile) -> tuple[tokenizers.Tokenizer, PreTokenizer]:
    """The tokenizer of `f`'s ggml vocabulary (module doc) and its pre-tokenizer; ModelFileError
    naming the key when it is missing or of a kind this reader does not know."""
    model = f.get("tokenizer.ggml.model", None)
    if model != "gpt2":
        what = "missing" if model is None else f"{model!r}"
        raise ModelFileError(
            f"{f.path}: tokenizer.ggml.model is {what}; without tokenizer.huggingface.json "
            "pyruntime tokenizes byte-level BPE ('gpt2') vocabularies only"
        )
    pre_name = f.get("tokenizer.ggml.pre", None) or "default"  # llama.cpp's fallback too
    pre = PRE_TOKENIZERS.get(pre_name)
    if pre is None:
        raise ModelFileError(
            f"{f.path}: tokenizer.ggml.pre {pre_name!r} is a pre-tokenizer pyruntime does not "
            f"know (it knows {', '.join(sorted(PRE_TOKENIZERS))})"
        )
    tokens = _strings(f, "tokenizer.ggml.tokens")
    merges = _strings(f, "tokenizer.ggml.merges")
    types = list(f.get("tokenizer.ggml.token_type", None) or [TOKEN_NORMAL] * len(tokens))
    if len(types) != len(tokens):
        raise ModelFileError(
            f"{f.path}: tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens"
        )
    spec = json.dumps(_tokenizer_json(tokens, types, merges, pre))
    return tokenizers.Tokenizer.from_str(spec), pre


def _tokenizer_json(
    tokens: Sequence[str], types: Sequence[int], merges: Sequence[str], pre: PreTokenizer
) -> dict[str, Any]:
    vocab: dict[str, int] = {}
    for i, text in enumerate(tokens):
        vocab[text or f"[EMPTY_{i}]"] = i  # llama.cpp: an empty token is renamed; the last wins
    pairs = []
    for m in merges:
        cut = m.find(" ", 1)  # llama.cpp splits at the first space after the first character
        if cut > 0:
            pairs.append([m[:cut], m[cut + 1 :]])
    added = [
        {"id": i, "content": tokens[i], "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": kind != TOKEN_USER_DEFINED}
        for i, kind in enumerate(types)
        if kind in (TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNKNOWN) and tokens[i]
    ]  # fmt: skip
    splits = [
        {"type": "Split", "pattern": {"Regex": r}, "behavior": "Isolated", "invert": False}
        for r in pre.regexes
    ]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                  "use_regex": False}  # fmt: skip
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [*splits, byte_level]},
        "post_processor": None,
        "decoder": {
            "type": "ByteLevel",
            "add_prefix_space": False,
            "trim_offsets": False,
            "use_regex": False,
        },  # fmt: skip
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": pre.ignore_merges,
            "vocab": vocab,
            "merges": pairs,
        },  # fmt: skip
    }


def _pattern(pre_tokenizer: Mapping[str, Any]) -> list[str] | None:
    """The regexes a tokenizer.json pre-tokenizer splits by, in llama.cpp's terms (None: one
    llama.cpp's regex splitting cannot express: a prefix space, a Metaspace, ...)."""
    kind = pre_tokenizer.get("type")
    if kind == "ByteLevel":
        if pre_tokenizer.get("add_prefix_space"):
            return None
        return [_GPT2] if pre_tokenizer.get("use_regex", True) else []
    if kind == "Split":
        pattern = pre_tokenizer.get("pattern") or {}
        regex = pattern.get("Regex")
        if regex is None or pre_tokenizer.get("behavior") != "Isolated":
            return None
        if pre_tokenizer.get("invert"):
            return None
        return [regex.replace("(?i:'s|'t|'re|'ve|'m|'ll|'d)", _CONTRACTIONS)]
    if kind == "Digits":
        return [r"\p{N}"] if pre_tokenizer.get("individual_digits") else [r"\p{N}+"]
    if kind == "Sequence":
        out: list[str] = []
        for p in pre_tokenizer.get("pretokenizers") or []:
            part = _pattern(p)
            if part is None:
                return None
            out += part
        return out
    return None


def pre_tokenizer_name(tokenizer_json: Mapping[str, Any]) -> str | None:
    """llama.cpp's name for the pre-tokenizer of a tokenizer.json (a byte-level BPE one), or
    None when llama.cpp knows none that splits the same way."""
    pre = tokenizer_json.get("pre_tokenizer")
    if not isinstance(pre, Mapping):
        return None
    regexes = _pattern(pre)
    if not regexes:
        return None
    for key, names in _NAMES.items():
        if list(_PRE[key].regexes) == regexes:
            return names[0]
    return None
