"""Tokenizer read from the GGUF file, with exact Hugging Face behaviour where the file allows it.

The converter stores the checkpoint's original `tokenizer.json` verbatim under
`tokenizer.huggingface.json`; we hand it to the `tokenizers` library, so splitting, merges,
added/special tokens and decoding are those of `transformers.AutoTokenizer`. A file without it
(llama.cpp's converter writes none) is tokenized from its ggml vocabulary as llama.cpp does
(ggml_vocab.py). The GGUF keys decide what lies outside the vocabulary: whether to prepend BOS,
and which ids end generation.

`IncrementalDetokenizer` turns a stream of token ids into text pieces for streaming output without
ever emitting half of a multi-byte UTF-8 character (byte-level BPE splits characters across tokens).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import tokenizers

from pyruntime.errors import ModelFileError, UsageError
from pyruntime.gguf.file import GGUFFile
from pyruntime.text.ggml_vocab import ggml_tokenizer

# What `tokenizers` produces for an incomplete UTF-8 sequence at the end of a decode.
_REPLACEMENT_CHAR = "\ufffd"


def _from_tokenizer_json(f: GGUFFile, tokenizer_json: str) -> tokenizers.Tokenizer:
    try:
        return tokenizers.Tokenizer.from_str(tokenizer_json)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # its own Exception subclass; a Rust panic: BaseException
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ModelFileError(
            f"{f.path}: 'tokenizer.huggingface.json' is not a valid tokenizer.json ({reason})"
        ) from None


class Tokenizer:
    """Text <-> token ids for one model."""

    def __init__(
        self,
        hf_tokenizer: tokenizers.Tokenizer,
        bos_id: int | None,
        eos_id: int | None,
        stop_ids: Sequence[int],
        add_bos: bool,
        chat_template: str | None,
    ) -> None:
        self._hf = hf_tokenizer
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.stop_ids: frozenset[int] = frozenset(int(i) for i in stop_ids)
        self.add_bos = add_bos
        self.chat_template = chat_template

    @classmethod
    def from_gguf(cls, f: GGUFFile, n_vocab: int | None = None) -> Tokenizer:
        """Build the tokenizer from the file's metadata: the stored tokenizer.json when there is
        one (our converter's files), else the ggml vocabulary (llama.cpp's files; ggml_vocab.py).
        With n_vocab (the embedding's rows), every id the tokenizer can produce or stops on is
        checked to be one of the model's tokens."""
        tokenizer_json = f.get("tokenizer.huggingface.json", None)
        if tokenizer_json:
            hf = _from_tokenizer_json(f, tokenizer_json)
            bos_by_default = False
        else:  # a llama.cpp file: its ggml vocabulary, tokenized as llama.cpp does
            hf, pre = ggml_tokenizer(f)
            bos_by_default = pre.add_bos
        bos_id = f.get("tokenizer.ggml.bos_token_id", None)
        eos_id = f.get("tokenizer.ggml.eos_token_id", None)
        stop_ids = list(f.get("pyruntime.stop_token_ids", None) or [])
        if not stop_ids:
            # Older or foreign files: fall back to the end-of-text / end-of-turn ids.
            eot_id = f.get("tokenizer.ggml.eot_token_id", None)
            stop_ids = [i for i in (eos_id, eot_id) if i is not None]
        add_bos = bool(f.get("tokenizer.ggml.add_bos_token", bos_by_default)) and bos_id is not None
        if n_vocab is not None:
            _check_ids(f, hf, n_vocab, {"bos": bos_id, "eos": eos_id, "stop": stop_ids})
        return cls(
            hf,
            bos_id=bos_id,
            eos_id=eos_id,
            stop_ids=stop_ids,
            add_bos=add_bos,
            chat_template=f.get("tokenizer.chat_template", None),
        )

    @property
    def vocab_size(self) -> int:
        return self._hf.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special: bool = True) -> list[int]:
        """Token ids of `text`; special tokens written in the text (`<|im_start|>`) are parsed.

        `add_special` prepends BOS when the model asks for it (`tokenizer.ggml.add_bos_token`),
        unless the text already starts with the BOS token.
        """
        if not isinstance(text, str):
            raise UsageError(f"text to tokenize must be a str, got {type(text).__name__}")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:  # tokenizers would raise a TypeError deep inside
            raise UsageError(
                f"text is not valid Unicode: a lone surrogate at index {exc.start} (bytes that "
                "were not UTF-8, decoded with surrogateescape?)"
            ) from None
        ids = self._hf.encode(text, add_special_tokens=False).ids
        if add_special and self.add_bos and not (ids and ids[0] == self.bos_id):
            ids = [self.bos_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
        return self._hf.decode(list(ids), skip_special_tokens=skip_special)

    @functools.cached_property
    def max_chars_per_token(self) -> int:
        """At most this many characters of text make one token, so a text of n characters is at
        least n / max_chars_per_token tokens (a bound to refuse a text far over a context before
        tokenizing it): the longest vocabulary entry (byte-level forms: a character a byte, so at
        least the text characters it covers; a byte fallback's `<0x0A>` is longer than its
        byte), times 4 for normalizers that compose several characters into one."""
        longest = max((len(t) for t in self._hf.get_vocab(with_added_tokens=True)), default=1)
        return 4 * max(longest, 1)

    def token_text(self, token_id: int) -> str | None:
        """The vocabulary entry of `token_id` (byte-level form), or None if out of range."""
        return self._hf.id_to_token(token_id)


def _check_ids(f: GGUFFile, hf: tokenizers.Tokenizer, n_vocab: int, special: dict) -> None:
    """Every id of tokenizer.json and every special id in [0, n_vocab): an id past the embedding
    would be refused at the first forward pass, far from its cause."""
    vocab = hf.get_vocab(with_added_tokens=True)
    top = max(vocab.values(), default=-1)
    if top >= n_vocab:
        raise ModelFileError(
            f"{f.path}: 'tokenizer.huggingface.json' has token id {top}, but the model has "
            f"{n_vocab} tokens"
        )
    for name, ids in special.items():
        for i in ids if isinstance(ids, list) else [ids]:
            if i is not None and not 0 <= i < n_vocab:
                raise ModelFileError(
                    f"{f.path}: the {name} token id {i} is not one of the model's {n_vocab} tokens"
                )


class IncrementalDetokenizer:
    """Decode a growing list of ids into text pieces whose concatenation is `decode(all ids)`.

    Each `push` decodes only a short window (the ids since the last emitted piece, with the few ids
    before them as context, so tokenizers that strip a leading space decode consistently). A piece
    ending in U+FFFD is an incomplete UTF-8 character: held back until the next ids complete it.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = True) -> None:
        self._tok = tokenizer
        self._skip_special = skip_special
        self.ids: list[int] = []
        self._prefix = 0  # start of the decode window (context already emitted)
        self._read = 0  # ids before this index have been emitted as text

    def push(self, token_id: int) -> str:
        """Add one id; return the text that is now complete ('' if none yet)."""
        self.ids.append(int(token_id))
        prefix_text = self._tok.decode(self.ids[self._prefix : self._read], self._skip_special)
        new_text = self._tok.decode(self.ids[self._prefix :], self._skip_special)
        if len(new_text) > len(prefix_text) and not new_text.endswith(_REPLACEMENT_CHAR):
            self._prefix = self._read
            self._read = len(self.ids)
            return new_text[len(prefix_text) :]
        return ""

    def flush(self) -> str:
        """Text still held back (e.g. a truly invalid byte sequence at the end), then reset."""
        prefix_text = self._tok.decode(self.ids[self._prefix : self._read], self._skip_special)
        new_text = self._tok.decode(self.ids[self._prefix :], self._skip_special)
        self._prefix = self._read = len(self.ids)
        return new_text[len(prefix_text) :]
