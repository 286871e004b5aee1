"""Generation loop on a scripted network: stop tokens, stop strings, max_tokens, cache reuse.

The network is a fake whose next token is a fixed function of the last one, so every outcome is
known in advance; the tokenizer is the real one of the packaged demo model.
"""

from collections.abc import Sequence

import pytest
import tokenizers
import torch

from pyruntime.decoding.sampling import Sampler, SamplingParams
from pyruntime.decoding.session import Session, common_prefix_length
from pyruntime.decoding.stream import StopStrings, TextStream
from pyruntime.errors import UsageError
from pyruntime.text.tokenizer import Tokenizer
from pyruntime.tools.demo import DEMO_SOURCE

EOS, IM_END = 0, 2
GREEDY = SamplingParams(temp=0.0)


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    hf = tokenizers.Tokenizer.from_file(str(DEMO_SOURCE / "tokenizer.json"))
    return Tokenizer(hf, None, EOS, [EOS, IM_END], add_bos=False, chat_template=None)


class FakeCache:
    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self.n_tokens = 0

    def truncate(self, n: int) -> None:
        self.n_tokens = max(0, min(n, self.n_tokens))


class ScriptedNet:
    """next token = script[last token] (default: EOS); records every forward call."""

    def __init__(self, script: dict[int, int], n_vocab: int = 4096) -> None:
        self.script = script
        self.n_vocab = n_vocab
        self.calls: list[list[int]] = []

    def new_cache(self, max_tokens: int) -> FakeCache:
        return FakeCache(max_tokens)

    def forward(
        self,
        tokens: Sequence[int],
        cache: FakeCache,
        last_only: bool = False,
        *,
        k: int | None = None,
        routing=None,
    ) -> torch.Tensor:
        assert cache.n_tokens + len(tokens) <= cache.max_tokens
        self.calls.append(list(tokens))
        cache.n_tokens += len(tokens)
        logits = torch.zeros(len(tokens), self.n_vocab)
        for i, t in enumerate(tokens):
            logits[i, self.script.get(t, EOS)] = 10.0
        return logits[-1:] if last_only else logits


def _chain(tok: Tokenizer, text: str, then: int = EOS) -> tuple[list[int], dict[int, int]]:
    """Ids of `text` (distinct tokens) and a script that produces them after the prompt."""
    ids = tok.encode(text)
    assert len(set(ids)) == len(ids), "test text must use distinct tokens"
    script = {a: b for a, b in zip(ids, ids[1:], strict=False)}
    script[ids[-1]] = then
    return ids, script


def _run(tok, net, prompt, max_tokens=50, stop=(), ignore_eos=False, session=None):
    session = session or Session(net, 64)
    stream = TextStream(
        session,
        tok,
        prompt,
        Sampler(GREEDY),
        max_tokens=max_tokens,
        stop=stop,
        ignore_eos=ignore_eos,
    )
    pieces = list(stream)
    return stream, pieces


def test_stops_on_stop_token_without_emitting_it(tok):
    ids, script = _chain(tok, "The cat sat", then=IM_END)
    net = ScriptedNet({1000: ids[0], **script})
    stream, pieces = _run(tok, net, [1000])
    assert "".join(pieces) == "The cat sat" == stream.text
    assert stream.finish_reason == "stop"
    assert stream.token_ids == ids
    assert stream.stats.generated_tokens == len(ids) + 1  # the stop token was sampled
    # the stop token is never fed back into the model
    assert all(IM_END not in call for call in net.calls)


def test_max_tokens_gives_length_and_does_not_feed_the_last_token(tok):
    ids, script = _chain(tok, "The cat sat on")
    net = ScriptedNet({1000: ids[0], **script})
    stream, _ = _run(tok, net, [1000], max_tokens=2)
    assert stream.token_ids == ids[:2]
    assert stream.finish_reason == "length"
    assert net.calls == [[1000], [ids[0]]]


def test_ignore_eos_keeps_going_until_max_tokens(tok):
    net = ScriptedNet({})  # always predicts EOS
    stream, pieces = _run(tok, net, [1000], max_tokens=5, ignore_eos=True)
    assert stream.token_ids == [EOS] * 5
    assert stream.finish_reason == "length"
    assert "".join(pieces) == ""  # special tokens are not printed


def test_stop_string_spanning_tokens_is_cut_and_never_emitted(tok):
    ids, script = _chain(tok, "Hello world, good day")
    net = ScriptedNet({1000: ids[0], **script})
    stream, pieces = _run(tok, net, [1000], stop=["d, go"])
    assert "".join(pieces) == "Hello worl"
    assert stream.finish_reason == "stop"
    assert all("d, go" not in p for p in pieces)


def test_text_that_only_looks_like_a_stop_string_is_released(tok):
    ids, script = _chain(tok, "Hello world")
    net = ScriptedNet({1000: ids[0], **script})
    stream, pieces = _run(tok, net, [1000], stop=["world!"])
    assert "".join(pieces) == "Hello world"
    assert stream.finish_reason == "stop"  # ended by EOS, the held-back "world" was flushed


def test_stop_strings_hold_back_possible_prefixes():
    s = StopStrings(["</s>", "STOP"])
    assert s.push("abc<") == ("abc", False)
    assert s.push("/") == ("", False)
    assert s.push("x") == ("</x", False)
    assert s.push("ST") == ("", False)
    assert s.push("OP and more") == ("", True)
    s = StopStrings(["ab"])
    assert s.push("xa") == ("x", False)
    assert s.flush() == "a"
    assert StopStrings([]).push("text") == ("text", False)


def test_earliest_stop_string_wins():
    s = StopStrings(["world", "lo"])
    assert s.push("hello world") == ("hel", True)


def test_session_reuses_the_common_prefix(tok):
    net = ScriptedNet({})
    session = Session(net, 64)
    stream, _ = _run(tok, net, [5, 6, 7, 8], session=session)
    assert stream.stats.prompt_evaluated == 4
    assert session.ids == [5, 6, 7, 8]  # the sampled EOS is not in the cache
    net.calls.clear()
    stream, _ = _run(tok, net, [5, 6, 7, 9, 10], session=session)
    assert stream.stats.prompt_evaluated == 2
    assert net.calls[0] == [9, 10]
    assert session.cache.n_tokens == 5
    # the same prompt again: the logits its pass left, nothing evaluated (Session's doc)
    net.calls.clear()
    stream, _ = _run(tok, net, [5, 6, 7, 9, 10], session=session)
    assert net.calls == [] and stream.stats.prompt_evaluated == 0
    assert session.cache.n_tokens == 5
    # a prompt that ends before the kept end evaluates its last token, to get logits
    stream, _ = _run(tok, net, [5, 6, 7, 9], session=session)
    assert net.calls == [[9]] and stream.stats.prompt_evaluated == 1
    net.calls.clear()
    stream, _ = _run(tok, net, [5, 6, 7, 9, 10], session=session)  # that end is gone now
    assert net.calls == [[10]]


def test_full_context_ends_with_length(tok):
    net = ScriptedNet({1000: 1000})
    stream, _ = _run(tok, net, [1000] * 3, max_tokens=None, session=Session(net, 8))
    assert stream.finish_reason == "length"
    assert len(stream.token_ids) == 6  # 3 prompt + 5 fed tokens fill 8 positions, +1 unfed
    with pytest.raises(UsageError, match="prompt has 9 tokens but the context holds 8"):
        _run(tok, net, [1000] * 9, session=Session(net, 8))


def test_stats_and_common_prefix(tok):
    ids, script = _chain(tok, "The cat", then=EOS)
    net = ScriptedNet({1000: ids[0], **script})
    stream, _ = _run(tok, net, [1000, 1000])
    st = stream.stats
    assert st.prompt_tokens == 2 and st.prompt_evaluated == 2
    assert st.generated_tokens == len(ids) + 1
    assert st.prompt_seconds > 0 and st.generation_seconds > 0
    assert "tokens/s" in st.summary()
    assert common_prefix_length([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix_length([], [1]) == 0


def test_negative_max_tokens_is_a_usage_error(tok):
    net = ScriptedNet({})
    with pytest.raises(UsageError, match="max_tokens"):
        TextStream(Session(net, 8), tok, [1], Sampler(GREEDY), max_tokens=-2)
    net = ScriptedNet({1000: 1000})  # -1 as the CLI's -n -1: until a stop or a full context
    stream, _ = _run(tok, net, [1000] * 3, max_tokens=-1, session=Session(net, 8))
    assert stream.finish_reason == "length" and len(stream.token_ids) == 6
