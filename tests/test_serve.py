"""`pyruntime serve`, started on a free port and driven with the official `openai` client:
chat and text completions, streamed and not, concurrent requests, a cancelled stream, bad
requests answered 4xx while the server goes on."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from hf_fixtures import make_tiny_hf_model

openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from pyruntime.converter import convert  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
N_CTX = 2048
CHAT = [{"role": "user", "content": "Tell me a fortune."}]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("serve")
    hf = make_tiny_hf_model("olmoe", root / "hf", max_position_embeddings=N_CTX)
    return convert(hf, root / "model.gguf", "q8_0", progress=False)


@pytest.fixture(scope="module")
def server(model_path):
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "pyruntime", "serve", str(model_path), "--port", str(port),
         "-c", str(N_CTX), "--device", "cpu", "-t", "1"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            urllib.request.urlopen(f"{url}/health", timeout=1).read()
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"the server did not start: {proc.communicate()}") from None
            time.sleep(0.2)
    yield url
    proc.terminate()
    proc.wait(timeout=30)


@pytest.fixture(scope="module")
def local(model_path):
    """The same model in this process: what the server must answer."""
    from pyruntime.api import Model

    return Model(model_path, n_ctx=N_CTX, device="cpu", threads=1)


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=120)


def _health(server: str) -> dict:
    return json.loads(urllib.request.urlopen(f"{server}/health", timeout=5).read())


def _post(server: str, path: str, body: bytes) -> tuple[int, dict]:
    req = urllib.request.Request(f"{server}{path}", data=body, method="POST",
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_models_and_health(client, server, model_path):
    ids = [m.id for m in client.models.list()]
    assert ids == [model_path.name]
    assert _health(server)["status"] == "ok"


def test_chat_matches_the_python_api(client, local):
    reply = client.chat.completions.create(model="x", messages=CHAT, temperature=0, max_tokens=24)
    expect = local.create_chat_completion(CHAT, temperature=0, max_tokens=24)
    assert reply.choices[0].message.content == expect["choices"][0]["message"]["content"]
    assert reply.choices[0].finish_reason == expect["choices"][0]["finish_reason"]
    assert reply.usage.prompt_tokens == expect["usage"]["prompt_tokens"]
    assert reply.usage.completion_tokens == expect["usage"]["completion_tokens"]


def test_chat_stream_is_the_same_text(client):
    whole = client.chat.completions.create(model="x", messages=CHAT, temperature=0, max_tokens=24)
    stream = client.chat.completions.create(
        model="x", messages=CHAT, temperature=0, max_tokens=24, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finish = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finish == [whole.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_text_completion(client, local):
    out = client.completions.create(model="x", prompt="Once upon", temperature=0, max_tokens=12)
    expect = "".join(local.generate("Once upon", temp=0, max_tokens=12))
    assert out.choices[0].text == expect and out.object == "text_completion"
    streamed = client.completions.create(model="x", prompt="Once upon", temperature=0,
                                         max_tokens=12, stream=True)  # fmt: skip
    assert "".join(c.choices[0].text for c in streamed) == expect
    ids = local.tokenize("Once upon")
    by_ids = client.completions.create(model="x", prompt=ids, temperature=0, max_tokens=12)
    assert by_ids.choices[0].text == expect


def test_concurrent_requests_each_get_their_own_answer(client, server, local):
    prompts = [f"Story number {i}:" for i in range(6)]
    expect = {p: "".join(local.generate(p, temp=0, max_tokens=16)) for p in prompts}
    got: dict[str, str] = {}

    def ask(p: str, stream: bool) -> None:
        if stream:
            s = client.completions.create(model="x", prompt=p, temperature=0, max_tokens=16,
                                          stream=True)  # fmt: skip
            got[p] = "".join(c.choices[0].text for c in s)
        else:
            got[p] = client.completions.create(model="x", prompt=p, temperature=0,
                                               max_tokens=16).choices[0].text  # fmt: skip

    threads = [threading.Thread(target=ask, args=(p, i % 2 == 0)) for i, p in enumerate(prompts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert got == expect
    assert _health(server)["requests"]["running"] == 0


def _wait_for_one_more_cancelled(server: str, before: int) -> None:
    """Until /health counts one more cancelled request than `before` and none running (10 s)."""
    deadline = time.monotonic() + 10
    while True:
        counts = _health(server)["requests"]
        if counts["cancelled"] == before + 1 and counts["running"] == 0:
            return
        assert time.monotonic() < deadline, counts
        time.sleep(0.05)


def test_cancelled_stream_stops_its_generation(client, server):
    before = _health(server)["requests"]["cancelled"]
    stream = client.chat.completions.create(
        model="x", messages=CHAT, temperature=1.0, max_tokens=N_CTX, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()
    _wait_for_one_more_cancelled(server, before)
    reply = client.chat.completions.create(model="x", messages=CHAT, max_tokens=4)
    assert reply.choices[0].finish_reason in ("stop", "length")


def test_client_leaving_a_request_that_is_not_streamed_cancels_it(server):
    """No byte goes to the client before the end, so nothing fails to write: the server must
    notice the closed connection while tokens flow."""
    before = _health(server)["requests"]["cancelled"]
    body = json.dumps({"prompt": "Once", "max_tokens": N_CTX - 8, "ignore_eos": True}).encode()
    port = int(server.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                  b"\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))  # fmt: skip
        deadline = time.monotonic() + 30
        while _health(server)["requests"]["running"] == 0:  # its tokens are flowing
            assert time.monotonic() < deadline
            time.sleep(0.02)
    _wait_for_one_more_cancelled(server, before)


@pytest.mark.parametrize(
    ("body", "status", "match"),
    [
        (b"{not json", 400, "not valid JSON"),
        (b"[1, 2]", 400, "must be a JSON object"),
        (b'{"messages": "hi"}', 400, "'messages' must be a non-empty list"),
        (b'{"messages": [{"role": "user", "content": 5}]}', 400, "content must be a string"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}', 400,
         "'temperature' must be a number"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": -2}', 400,
         "'max_tokens' must be in"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "n": 2}', 400, "'n' must be 1"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "stop": [1]}', 400, "'stop' must"),
        (b'{"messages": [{"role": "wizard", "content": "hi"}]}', 400, "unknown role"),
    ],
)  # fmt: skip
def test_bad_requests_are_4xx(server, client, body, status, match):
    code, answer = _post(server, "/v1/chat/completions", body)
    assert code == status and match in answer["error"]["message"], answer
    assert client.chat.completions.create(model="x", messages=CHAT, max_tokens=2).choices


def test_over_long_prompt_and_wrong_types_through_the_client(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="x", prompt="word " * (N_CTX + 10), max_tokens=4)
    assert err.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError, match="top_p"):
        client.chat.completions.create(model="x", messages=CHAT, top_p=1.5)
    with pytest.raises(openai.NotFoundError):
        client.post("/nothing-here", cast_to=object)
    assert client.completions.create(model="x", prompt="ok", max_tokens=2).choices


def test_a_prompt_too_long_by_its_length_is_refused_untokenized(server, local):
    """Megabytes of prompt: refused on its length (a lower bound of its tokens), not tokenized
    first (which took seconds with the queue waiting); the server answers the next request."""
    n_chars = N_CTX * local.tokenizer.max_chars_per_token
    assert n_chars < 16 << 20  # under the body limit
    body = json.dumps({"prompt": "x" * n_chars, "max_tokens": 2}).encode()
    code, answer = _post(server, "/v1/completions", body)
    assert code == 400 and answer["error"]["code"] == "context_length_exceeded", answer
    assert answer["error"]["message"].startswith("the prompt is at least "), answer
    code, answer = _post(server, "/v1/completions", json.dumps({"prompt": "ok"}).encode())
    assert code == 200, answer


def test_serve_without_a_free_port_is_one_line(server, model_path):
    port = server.rsplit(":", 1)[1]
    r = subprocess.run(
        [sys.executable, "-m", "pyruntime", "serve", str(model_path), "--port", port,
         "--device", "cpu"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
        env={**os.environ},
    )  # fmt: skip
    assert r.returncode == 1 and r.stderr.splitlines()[-1].startswith("error: cannot serve on")
    assert "Traceback" not in r.stderr
    assert "OpenAI API at" not in r.stderr  # refused before the model's load and the banner


def test_serve_without_the_server_extra_is_one_line_before_the_load(tmp_path):
    """uvicorn missing (a path entry whose uvicorn fails to import, as an absent package does):
    the error names the extra, and the model (here a file that is not a GGUF) is never read."""
    (tmp_path / "uvicorn").mkdir()
    (tmp_path / "uvicorn" / "__init__.py").write_text("raise ImportError('no', name='uvicorn')\n")
    not_a_model = tmp_path / "m.gguf"
    not_a_model.write_text("not a gguf")
    path = os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])
    r = subprocess.run(
        [sys.executable, "-m", "pyruntime", "serve", str(not_a_model), "--port",
         str(_free_port()), "--device", "cpu"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": path},
    )  # fmt: skip
    assert r.returncode == 1, r.stderr
    assert r.stderr.strip().splitlines() == [
        "error: `pyruntime serve` needs the server extra (uvicorn is not installed): "
        'pip install "pyruntime[server]"'
    ]
