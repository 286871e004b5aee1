"""pyruntime.Model on the demo model (f32 GGUF) vs transformers float32 on the same checkpoint."""

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from pyruntime.api import Model
from pyruntime.errors import ModelFileError, UsageError
from pyruntime.text.chat_template import ChatTemplateError, render_chat
from pyruntime.tools.demo import DEMO_SOURCE, demo_model_path
from pyruntime.tools.perplexity import perplexity, split_windows

PROMPT = "The hacker wrote a program that"
N_GREEDY = 20
MESSAGES = [
    {"role": "system", "content": "You are a fortune cookie."},
    {"role": "user", "content": "Tell me a fortune."},
]


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory) -> Path:
    return demo_model_path(tmp_path_factory.getbasetemp() / "pyruntime-cache", quiet=True)


@pytest.fixture(scope="module")
def model(gguf_path) -> Model:
    return Model(gguf_path, n_ctx=512, seed=0)


@pytest.fixture(scope="module")
def hf_model():
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(DEMO_SOURCE, dtype=torch.float32)
    return m.eval()


def hf_greedy(hf_model, ids: list[int], n: int) -> list[int]:
    """Plain greedy decoding, recomputing the whole sequence each step (no stop tokens)."""
    ids = list(ids)
    out = []
    with torch.no_grad():
        for _ in range(n):
            logits = hf_model(torch.tensor([ids])).logits[0, -1]
            out.append(int(torch.argmax(logits)))
            ids.append(out[-1])
    return out


def test_tokenize_detokenize_roundtrip(model):
    ids = model.tokenize(PROMPT)
    assert all(isinstance(i, int) for i in ids)
    assert model.detokenize(ids) == PROMPT


def test_logits_match_transformers(model, hf_model):
    ids = model.tokenize(PROMPT + " prints the answer to every question.")
    ours = model.logits(ids)
    assert ours.dtype == np.float32 and ours.shape == (len(ids), model.config.n_vocab)
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0].float()
    diff = torch.log_softmax(torch.from_numpy(ours), -1) - torch.log_softmax(ref, -1)
    assert diff.abs().max().item() <= 1e-3  # issue #2's f32 parity bound
    # a fresh cache each call: the same ids give the same logits
    np.testing.assert_array_equal(model.logits(ids), ours)


def test_greedy_generation_equals_transformers(model, hf_model):
    ids = model.tokenize(PROMPT)
    stream = model.generate(PROMPT, max_tokens=N_GREEDY, temp=0, ignore_eos=True)
    text = "".join(stream)
    expected = hf_greedy(hf_model, ids, N_GREEDY)
    assert stream.token_ids == expected
    assert text == model.detokenize(expected)
    assert stream.finish_reason == "length"


def test_seeded_sampling_reproduces(model):
    a = "".join(model.generate(PROMPT, max_tokens=24, seed=42, temp=1.2))
    b = "".join(model.generate(PROMPT, max_tokens=24, seed=42, temp=1.2))
    c = "".join(model.generate(PROMPT, max_tokens=24, seed=43, temp=1.2))
    assert a == b
    assert a != c


def test_model_seed_makes_a_run_of_calls_reproducible(gguf_path):
    def run() -> list[str]:
        m = Model(gguf_path, n_ctx=128, seed=7)
        return ["".join(m.generate(PROMPT, max_tokens=12, temp=1.0)) for _ in range(2)]

    first = run()
    assert first == run()
    assert first[0] != first[1]  # the stream moves on between calls


def test_chat_completion_shape(model):
    reply = model.create_chat_completion(MESSAGES, max_tokens=32, seed=1)
    assert reply["object"] == "chat.completion"
    assert reply["id"].startswith("chatcmpl-")
    assert isinstance(reply["created"], int) and reply["model"] == "tiny-olmoe"
    choice = reply["choices"][0]
    assert choice["index"] == 0 and choice["message"]["role"] == "assistant"
    assert choice["finish_reason"] in ("stop", "length")
    assert choice["message"]["content"].strip()
    usage = reply["usage"]
    prompt_ids = model.tokenize(model.apply_chat_template(MESSAGES))
    assert usage["prompt_tokens"] == len(prompt_ids)
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert "<|im_end|>" not in choice["message"]["content"]


def test_chat_stream_chunks_equal_the_whole_reply(model):
    whole = model.create_chat_completion(MESSAGES, max_tokens=32, seed=3)
    chunks = list(model.create_chat_completion(MESSAGES, stream=True, max_tokens=32, seed=3))
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant"}
    assert chunks[-1]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == whole["choices"][0]["message"]["content"]
    assert len({c["id"] for c in chunks}) == 1


def test_chat_stop_string_and_length(model):
    reply = model.create_chat_completion(MESSAGES, max_tokens=3, temperature=0)
    assert reply["choices"][0]["finish_reason"] == "length"
    assert reply["usage"]["completion_tokens"] == 3
    full = model.create_chat_completion(MESSAGES, max_tokens=40, temperature=0)
    content = full["choices"][0]["message"]["content"]
    cut = content[3:6]
    assert cut.strip(), content
    stopped = model.create_chat_completion(MESSAGES, max_tokens=40, temperature=0, stop=[cut])
    assert stopped["choices"][0]["message"]["content"] == content[: content.index(cut)]
    assert stopped["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("stop", [5, [b"x"], ["ok", None]])
def test_a_stop_that_is_not_strings_is_a_usage_error(model, stop):
    with pytest.raises(UsageError, match="stop must be a string or a sequence of strings"):
        model.generate("x", max_tokens=2, stop=stop)
    with pytest.raises(UsageError, match="stop must be a string"):
        model.create_chat_completion(MESSAGES, max_tokens=2, stop=stop)


def test_second_chat_turn_reuses_the_cache_and_matches_a_fresh_model(model, gguf_path):
    model.reset()
    first = model.create_chat_completion(MESSAGES, max_tokens=16, temperature=0)
    history = [*MESSAGES, first["choices"][0]["message"], {"role": "user", "content": "Again."}]
    prompt_ids = model.tokenize(model.apply_chat_template(history))
    stream = model.generate(prompt_ids, max_tokens=16, temp=0)
    reused = "".join(stream)
    assert stream.stats.prompt_evaluated < len(prompt_ids) - len(
        model.tokenize(MESSAGES[1]["content"])
    )
    fresh = Model(gguf_path, n_ctx=512)
    assert "".join(fresh.generate(prompt_ids, max_tokens=16, temp=0)) == reused


def test_chat_template_errors(model):
    with pytest.raises(ChatTemplateError, match="no system messages"):
        render_chat(
            "{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system messages') }}"
            "{% endif %}",
            MESSAGES,
        )
    with pytest.raises(ModelFileError, match="no chat template"):
        render_chat(None, MESSAGES, source="x.gguf")
    with pytest.raises(UsageError, match="unknown role"):
        model.create_chat_completion([{"role": "robot", "content": "hi"}])
    with pytest.raises(UsageError, match="non-empty list"):
        model.create_chat_completion([])


def test_template_sees_bos_eos_and_generation_prompt():
    template = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}" + (
        "{% if add_generation_prompt %}|{{ eos_token }}{% endif %}"
    )
    assert render_chat(template, MESSAGES[1:], "<s>", "</s>") == "<s>Tell me a fortune.|</s>"
    assert render_chat(template, MESSAGES[1:], "<s>", "</s>", add_generation_prompt=False) == (
        "<s>Tell me a fortune."
    )


def test_overlong_prompt_is_a_usage_error(gguf_path):
    small = Model(gguf_path, n_ctx=8)
    with pytest.raises(UsageError, match="context holds 8"):
        list(small.generate("word " * 20, max_tokens=4))


def test_split_windows_drops_only_a_one_token_tail():
    assert split_windows(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert split_windows(9, 4) == [(0, 4), (4, 8)]
    with pytest.raises(UsageError):
        split_windows(10, 1)


def test_perplexity_matches_transformers(model, hf_model, shared):
    text = (shared / "data" / "eval-jargon.txt").read_text(encoding="utf-8")[:6000]
    ids = model.tokenize(text)
    ctx = 256
    result = perplexity(model, ids, ctx)
    # reference: the same windows through transformers float32
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(ids), ctx):
            window = ids[start : start + ctx]
            if len(window) < 2:
                continue
            logits = hf_model(torch.tensor([window])).logits[0].double()
            logprobs = torch.log_softmax(logits[:-1], -1)
            total -= float(logprobs.gather(1, torch.tensor(window[1:])[:, None]).sum())
            count += len(window) - 1
    assert result.tokens_scored == count == len(ids) - math.ceil(len(ids) / ctx)
    assert result.windows == math.ceil(len(ids) / ctx)
    assert result.ppl == pytest.approx(math.exp(total / count), rel=1e-3)
    assert 1.0 < result.ppl < model.config.n_vocab


def test_library_objects_frozen_and_a_dropped_model_is_collected(gguf_path):
    """A Model moves the objects of the modules imported so far out of full collections
    (gc.freeze: one of those walked torch's ~180,000 objects mid-decode) before it loads, and
    again only after more imports; its own objects stay collectable: a dropped Model is freed
    by the next collection, reference cycles included."""
    import gc
    import sys
    import types
    import weakref

    from pyruntime import gc_freeze

    Model(gguf_path, n_ctx=64)  # modules a first Model imports are in sys.modules from now on
    assert gc.get_freeze_count() > 0
    assert not gc_freeze.freeze_imports()  # nothing imported since
    sys.modules["_pyruntime_test_import"] = types.ModuleType("_pyruntime_test_import")
    try:
        assert gc_freeze.freeze_imports()
    finally:
        del sys.modules["_pyruntime_test_import"]
    m = Model(gguf_path, n_ctx=64)
    ref = weakref.ref(m)
    del m
    gc.collect()
    assert ref() is None


def test_no_leak_report_at_exit(gguf_path):
    """A process that loaded a Model (so froze triton's objects) exits without nanobind's
    leaked-objects report: the frozen objects go back to the collector at exit."""
    import subprocess
    import sys

    code = f"import triton, pyruntime; pyruntime.Model({str(gguf_path)!r}, n_ctx=32).logits([1, 2])"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "leaked" not in done.stderr and "nanobind" not in done.stderr, done.stderr[-2000:]


# -- arguments of the wrong type or value: one UsageError each, before anything loads ------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"n_ctx": "2048"}, "n_ctx must be an int in [0, 2^31), got '2048'"),
        ({"n_ctx": 100.5}, "n_ctx must be an int in [0, 2^31), got 100.5"),
        ({"threads": "2"}, "threads must be an int in [1, 2^31), got '2'"),
        ({"seed": "1"}, "seed must be an int in [-1, 2^64), got '1'"),
        ({"sparsity": "0.5"}, "sparsity must be a number, got '0.5'"),
        ({"expert_backend": "cuda"}, "expert_backend must be one of auto, c, torch, got 'cuda'"),
    ],
)
def test_model_arguments_of_the_wrong_type(gguf_path, kwargs, message):
    with pytest.raises(UsageError) as err:
        Model(gguf_path, **kwargs)
    assert str(err.value).startswith(message), str(err.value)


def test_model_path_of_the_wrong_type():
    with pytest.raises(UsageError, match=r"path must be a GGUF file's path \(str or Path\), got 5"):
        Model(5)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temp": "0.5"}, "temp must be a number, got '0.5'"),
        ({"top_k": 2.5}, "top_k must be an int, got 2.5"),
        ({"top_k": None}, "top_k must be an int, got None"),
        ({"seed": "1"}, "seed must be an int, got '1'"),
        ({"max_tokens": "5"}, "max_tokens must be an int, got '5'"),
        ({"max_tokens": 2.5}, "max_tokens must be an int, got 2.5"),
        ({"max_tokens": -2}, "max_tokens must be >= 0, or -1 / None for no limit, got -2"),
        ({"temperature": 0}, "unknown generation option(s): temperature (generate() takes temp="),
    ],
)
def test_generate_arguments_of_the_wrong_type(model, kwargs, message):
    with pytest.raises(UsageError) as err:
        "".join(model.generate("Hi", **{"max_tokens": 3, **kwargs}))
    assert message in str(err.value), str(err.value)


def test_max_tokens_minus_one_is_no_limit(model):
    """-1 as the CLI's -n -1: until a stop (here the first space) or a full context."""
    stream = model.generate(PROMPT, max_tokens=-1, temp=0, stop=[" "])
    text = "".join(stream)
    assert stream.finish_reason == "stop" and " " not in text


def test_detokenize_refuses_ids_outside_the_vocabulary(model):
    n_vocab = model.config.n_vocab
    for bad in (-1, n_vocab):
        with pytest.raises(UsageError, match=rf"token id {bad} is outside the vocabulary"):
            model.detokenize([1, bad])
    with pytest.raises(UsageError, match="detokenize\\(\\) takes a sequence of int token ids"):
        model.detokenize([1.5])


def test_chat_arguments_named_as_generate_does(model):
    with pytest.raises(UsageError, match=r"takes temperature= \(OpenAI's name\), not temp="):
        model.create_chat_completion(MESSAGES, temp=0)
    with pytest.raises(UsageError, match=r"messages\[1\] has no 'content'"):
        model.create_chat_completion([MESSAGES[0], {"role": "user"}])


def test_gpu_options_on_the_cpu_are_warned_about(gguf_path):
    from pyruntime.errors import PyruntimeWarning

    with pytest.warns(PyruntimeWarning, match="gpu_mem, lookahead: no effect, the model runs on"):
        Model(gguf_path, n_ctx=32, device="cpu", gpu_mem="8G", lookahead=True)


def test_close_frees_the_model_and_later_calls_say_so(gguf_path):
    with Model(gguf_path, n_ctx=32) as m:
        assert m.logits([1, 2]).shape[0] == 2
        core = m.net.core
    assert core._pool is None  # the C core's worker threads stopped at close
    for call in (lambda: m.logits([1]), lambda: "".join(m.generate("Hi", max_tokens=2)),
                 lambda: m.session):  # fmt: skip
        with pytest.raises(UsageError, match="this Model is closed"):
            call()
    m.close()  # again: nothing to do


def test_the_same_prompt_again_continues_as_the_first_time(model):
    """A repeated prompt takes its kept logits (the prompt's batched pass), not its last token
    through the one-token step (which rounds otherwise on quantized kernels)."""
    model.reset()
    s = model.session
    ids = model.tokenize(PROMPT)
    first, n_first = s.prefill(ids)
    assert n_first == len(ids)
    s.feed(int(first.argmax()))
    again, n_again = s.prefill(ids)
    assert n_again == 0 and torch.equal(again, first) and s.ids == ids
    assert s.cache.n_tokens == len(ids)
    s.rewind(1)  # the last prompt position gone: evaluated again
    _, n_after = s.prefill(ids)
    assert n_after == 1
    a = "".join(model.generate(PROMPT, max_tokens=12, temp=0))
    b = model.generate(PROMPT, max_tokens=12, temp=0)
    assert "".join(b) == a and b.stats.prompt_evaluated == 0


def test_seed_minus_one_is_a_random_seed(model):
    """-1 as llama.cpp's --seed -1: a random seed each call (not an error, not a fixed one)."""
    texts = {"".join(model.generate(PROMPT, max_tokens=8, temp=1.5, seed=-1)) for _ in range(4)}
    assert len(texts) > 1
