"""The chat templates the converter stores in the GGUF (tokenizer.chat_template, from the
checkpoint's tokenizer_config.json jinja), one family for every architecture that ships one:
rendered by our sandboxed renderer, each is transformers' apply_chat_template text; it tokenizes
as the HF tokenizer does, its special tokens single tokens; a turn ends where the format says
(the GGUF's eot/eos and pyruntime.stop_token_ids). Each architecture's chats exercise what its
template handles (system prompts, thinking, tool calls and results)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from hf_fixtures import (
    make_deepseek2_chat_model,
    make_harmony_model,
    make_llama4_chat_model,
    make_qwen35_chat_model,
)

from pyruntime.converter import convert

TOOL_CALL = [{"type": "function", "function": {"name": "weather", "arguments": {"city": "Oslo"}}}]


def _llama4_tokens(text: str, ids: list[int], chat: int, add_generation_prompt: bool) -> None:
    """The bos token, headers, a trimmed system message, tool calls and results."""
    assert text.startswith("<|begin_of_text|>")
    assert ids[0] == 4096 and ids.count(4099) == len(CASES["llama4"].chats[chat])  # bos, <|eot|>
    assert (4101 in ids) == (chat == 2)  # <|python_start|>


def _qwen35_tokens(text: str, ids: list[int], chat: int, add_generation_prompt: bool) -> None:
    """Thinking, tool calls and responses: the thinking and tool tokens single special tokens."""
    assert (4096 in ids) == (add_generation_prompt or chat == 2)  # <think>
    assert (4098 in ids) == (chat == 2)  # <tool_call>


def _deepseek2_tokens(text: str, ids: list[int], chat: int, add_generation_prompt: bool) -> None:
    """deepseek-v2-lite-chat's template: one bos (the template's: the tokenizer adds none before
    it) and an eos after each answer."""
    assert text.startswith("<｜begin▁of▁sentence｜>")
    assert ids.count(4096) == 1 and ids.count(4097) == (chat == 1)


def _harmony_tokens(text: str, ids: list[int], chat: int, add_generation_prompt: bool) -> None:
    """gpt-oss's harmony format: channels, developer messages, thinking, tool calls."""
    assert "<|start|>assistant<|channel|>final<|message|>" in text or chat == 0
    assert 4096 in ids and 4098 in ids  # <|start|>, <|message|> are single special tokens


@dataclass(frozen=True)
class ChatCase:
    make: Callable[[Path], Path]  # writes the HF checkpoint (with its tokenizer) at the path
    chats: list[list[dict]]
    tokens: Callable[[str, list[int], int, bool], None]  # the architecture's own token checks
    add_special_tokens: bool  # what the HF tokenizer is called with on the rendered text
    fields: dict[str, int]  # GGUF keys -> token id
    stops: set[int]  # pyruntime.stop_token_ids, exactly


CASES = {
    "llama4": ChatCase(
        make_llama4_chat_model,
        [
            [{"role": "user", "content": "Hi there"}],
            [
                {"role": "system", "content": "  Be brief. "},
                {"role": "user", "content": "What is a cat?"},
                {"role": "assistant", "content": "A cat."},
                {"role": "user", "content": "Its colour?"},
            ],
            [
                {"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "content": "", "tool_calls": TOOL_CALL},
                {"role": "tool", "content": "-3 C, snow"},
                {"role": "assistant", "content": "Cold and snowy."},
            ],
        ],
        _llama4_tokens,
        add_special_tokens=True,
        fields={"tokenizer.ggml.eot_token_id": 4099},  # <|eot|>
        stops={4099, 4100, 0},
    ),
    "qwen35": ChatCase(
        make_qwen35_chat_model,
        [
            [{"role": "user", "content": "Hi there"}],
            [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "What is a cat?"},
                {"role": "assistant", "content": "<think>\nA cat.\n</think>\n\nA cat."},
                {"role": "user", "content": "Its colour?"},
            ],
            [
                {"role": "user", "content": "Weather in Oslo?"},
                {
                    "role": "assistant",
                    "content": "<think>\nCall it.\n</think>\n\n",
                    "tool_calls": TOOL_CALL,
                },
                {"role": "tool", "content": "-3 C, snow"},
                {"role": "tool", "content": "wind from the north"},
                {"role": "assistant", "content": "<think>\nCold.\n</think>\n\nCold and snowy."},
            ],
        ],  # fmt: skip
        _qwen35_tokens,
        add_special_tokens=True,
        fields={"tokenizer.ggml.eot_token_id": 2},  # <|im_end|>
        stops={2, 0},
    ),
    "deepseek2": ChatCase(
        make_deepseek2_chat_model,
        [
            [{"role": "user", "content": "Hi there"}],
            [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "What is a cat?"},
                {"role": "assistant", "content": "A small animal."},
                {"role": "user", "content": "Its colour?"},
            ],
        ],
        _deepseek2_tokens,
        add_special_tokens=False,
        fields={"tokenizer.ggml.eos_token_id": 4097, "tokenizer.ggml.bos_token_id": 4096},
        stops={4097, 2},  # eos; the base tokenizer's <|im_end|>, an end-of-turn token
    ),
    # harmony closes every message with <|end|> (4097; the analysis channel's too): a turn ends
    # at <|return|> (eot) or a tool call's <|call|>, which generation stops on; never at <|end|>.
    "gpt-oss": ChatCase(
        make_harmony_model,
        [
            [{"role": "user", "content": "Hi there"}],
            [
                {"role": "developer", "content": "Answer in one word."},
                {"role": "user", "content": "Capital of France?"},
                {"role": "assistant", "content": "Paris.", "thinking": "Easy."},
                {"role": "user", "content": "And of Italy?"},
            ],
            [
                {"role": "system", "content": "Use the tools."},
                {"role": "user", "content": "Weather in Oslo?"},
                {
                    "role": "assistant",
                    "content": "",
                    "thinking": "Call it.",
                    "tool_calls": TOOL_CALL,
                },
                {"role": "tool", "content": "-3 C, snow"},
                {"role": "assistant", "content": "Cold and snowy."},
                {"role": "user", "content": "Thanks!"},
            ],
        ],  # fmt: skip
        _harmony_tokens,
        add_special_tokens=True,
        fields={"tokenizer.ggml.eot_token_id": 4100, "tokenizer.ggml.eos_token_id": 4100},
        stops={4100, 0, 4101},  # <|return|>, <|call|>
    ),
}

CHATS = [pytest.param(arch, i, id=f"{arch}-{i}") for arch, c in CASES.items() for i in
         range(len(c.chats))]  # fmt: skip


@pytest.fixture(scope="module")
def chat_model(request, tmp_path_factory) -> tuple[str, Path, Path]:
    """(architecture, the HF checkpoint, its Q8_0 GGUF); request.param names the architecture."""
    arch = request.param
    tmp = tmp_path_factory.mktemp(f"{arch}-chat")
    hf = CASES[arch].make(tmp / "hf")
    return arch, hf, convert(hf, tmp / "m.gguf", "q8_0", progress=False)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("chat_model, chat", CHATS, indirect=["chat_model"])
def test_chat_template_renders_and_tokenizes_as_transformers(chat_model, chat,
                                                            add_generation_prompt):  # fmt: skip
    from transformers import AutoTokenizer

    from pyruntime.api import Model

    arch, hf_dir, path = chat_model
    case = CASES[arch]
    hf = AutoTokenizer.from_pretrained(hf_dir)
    model = Model(path)
    messages = case.chats[chat]
    want = hf.apply_chat_template(messages, tokenize=False,
                                  add_generation_prompt=add_generation_prompt)  # fmt: skip
    text = model.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    assert text == want
    ids = model.tokenize(text)
    assert ids == hf(text, add_special_tokens=case.add_special_tokens)["input_ids"]
    case.tokens(text, ids, chat, add_generation_prompt)


@pytest.mark.parametrize("chat_model", list(CASES), indirect=True)
def test_chat_turns_end_where_the_format_says(chat_model):
    from gguf import GGUFReader

    arch, _, path = chat_model
    fields = GGUFReader(path).fields
    for key, token in CASES[arch].fields.items():
        assert fields[key].contents() == token, key
    assert set(fields["pyruntime.stop_token_ids"].contents()) == CASES[arch].stops


@pytest.mark.parametrize("chat_model", ["deepseek2"], indirect=True)
def test_a_plain_prompt_gets_its_bos(chat_model):
    """deepseek2's tokenizer adds no bos before a rendered chat (the template has one), but a
    plain prompt still starts with it."""
    from pyruntime.api import Model

    assert Model(chat_model[2]).tokenize("Hi")[0] == 4096


@pytest.mark.parametrize("chat_model", ["gpt-oss"], indirect=True)
def test_harmony_template_refusals_are_one_line(chat_model):
    from pyruntime.api import Model
    from pyruntime.text.chat_template import ChatTemplateError

    model = Model(chat_model[2])
    bad = [{"role": "user", "content": "hi"},
           {"role": "assistant", "content": "<|channel|>analysis<|message|>hmm"}]  # fmt: skip
    with pytest.raises(ChatTemplateError, match="put the analysis in 'thinking'"):
        model.apply_chat_template(bad)
    with pytest.raises(ChatTemplateError, match="without a tool call"):
        model.apply_chat_template([{"role": "tool", "content": "x"}])
