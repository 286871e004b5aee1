"""Does `pyruntime serve` hold N concurrent streaming clients for M minutes, losing or mixing up no
token, and answer bad requests with 4xx throughout?

Starts the server on a free port (the demo model unless MODEL is given), then runs `--clients`
threads with the official `openai` client, each streaming its own chat request again and again at
temperature 0; every streamed answer must equal that client's reference answer (the same request
asked once, not streamed, before the load starts: a lost, duplicated or foreign piece changes
it). One more thread sends a malformed or invalid request every `--bad-every` seconds and
expects a 4xx. Prints one JSON line of counts and latencies; exits 1 on any error or mismatch.

    python bench/serve_load.py --clients 8 --minutes 5
    python bench/serve_load.py model.gguf --clients 4 --minutes 1 --max-tokens 64
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai

REPO = Path(__file__).resolve().parents[1]
BAD_REQUESTS = [
    (b"{not json", 400),
    (b'{"messages": []}', 400),
    (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}', 400),
    (b'{"messages": [{"role": "user", "content": "hi"}], "n": 3}', 400),
    (b'{"messages": [{"role": "user", "content": "' + b"word " * 5000 + b'"}]}', 400),
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str | None, port: int, ctx: int, threads: int | None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "pyruntime", "serve", "--port", str(port), "-c", str(ctx)]
    cmd += [model] if model else []
    cmd += ["-t", str(threads)] if threads else []
    proc = subprocess.Popen(cmd, cwd=REPO, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 600  # the demo model may be converted first
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1).read()
            return proc
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise SystemExit(f"the server did not start: {proc.communicate()[1]}") from None
            time.sleep(0.5)


class Tally:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.requests = self.pieces = self.errors = self.mismatches = 0
        self.bad_sent = self.bad_4xx = 0
        self.first_piece: list[float] = []
        self.problems: list[str] = []

    def problem(self, text: str) -> None:
        with self.lock:
            if len(self.problems) < 10:
                self.problems.append(text)


def client_loop(i: int, client: openai.OpenAI, reference: str, args, tally: Tally,
                stop: threading.Event) -> None:  # fmt: skip
    messages = [{"role": "user", "content": f"Tell me fortune number {i}."}]
    while not stop.is_set():
        start = time.perf_counter()
        first = None
        pieces = []
        try:
            stream = client.chat.completions.create(
                model="m",
                messages=messages,
                temperature=0,
                max_tokens=args.max_tokens,
                stream=True,
            )
            for chunk in stream:
                content = chunk.choices[0].delta.content if chunk.choices else None
                if content:
                    first = first or time.perf_counter() - start
                    pieces.append(content)
        except Exception as exc:  # any failure of the server counts
            with tally.lock:
                tally.errors += 1
            tally.problem(f"client {i}: {type(exc).__name__}: {exc}")
            continue
        text = "".join(pieces)
        with tally.lock:
            tally.requests += 1
            tally.pieces += len(pieces)
            if first is not None:
                tally.first_piece.append(first)
            if text != reference:
                tally.mismatches += 1
        if text != reference:
            tally.problem(f"client {i}: got {text[:60]!r}, expected {reference[:60]!r}")


def bad_loop(url: str, every: float, tally: Tally, stop: threading.Event) -> None:
    k = 0
    while not stop.wait(every):
        body, want = BAD_REQUESTS[k % len(BAD_REQUESTS)]
        k += 1
        req = urllib.request.Request(f"{url}/v1/chat/completions", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})  # fmt: skip
        try:
            urllib.request.urlopen(req, timeout=600).read()
            status = 200
        except urllib.error.HTTPError as e:
            status = e.code
        except OSError as exc:
            status = 0
            tally.problem(f"bad request {k}: {exc}")
        with tally.lock:
            tally.bad_sent += 1
            tally.bad_4xx += 400 <= status < 500
        if status != want:
            tally.problem(f"bad request {body[:40]!r}: HTTP {status}, expected {want}")


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("model", nargs="?", help="GGUF file (default: the demo model)")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--minutes", type=float, default=5.0)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--ctx-size", type=int, default=2048)
    p.add_argument("--bad-every", type=float, default=1.0, help="seconds between bad requests")
    p.add_argument("-t", "--threads", type=int, default=None, help="the server's CPU threads")
    args = p.parse_args()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_server(args.model, port, args.ctx_size, args.threads)
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0,
                               timeout=600)  # fmt: skip
        references = []
        for i in range(args.clients):
            messages = [{"role": "user", "content": f"Tell me fortune number {i}."}]
            reply = client.chat.completions.create(model="m", messages=messages, temperature=0,
                                                   max_tokens=args.max_tokens)  # fmt: skip
            references.append(reply.choices[0].message.content)
        tally, stop = Tally(), threading.Event()
        threads = [threading.Thread(target=client_loop, args=(i, client, references[i], args,
                                                              tally, stop))  # fmt: skip
                   for i in range(args.clients)]  # fmt: skip
        threads.append(threading.Thread(target=bad_loop, args=(url, args.bad_every, tally, stop)))
        start = time.perf_counter()
        for t in threads:
            t.start()
        time.sleep(args.minutes * 60)
        stop.set()
        for t in threads:
            t.join()
        seconds = time.perf_counter() - start
        health = json.loads(urllib.request.urlopen(f"{url}/health", timeout=10).read())
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    firsts = sorted(tally.first_piece) or [0.0]
    result = {
        "clients": args.clients, "seconds": round(seconds, 1), "requests": tally.requests,
        "pieces": tally.pieces, "pieces_per_s": round(tally.pieces / seconds, 1),
        "errors": tally.errors, "mismatches": tally.mismatches, "bad_sent": tally.bad_sent,
        "bad_answered_4xx": tally.bad_4xx,
        "first_piece_s_p50": round(statistics.median(firsts), 3),
        "first_piece_s_p95": round(firsts[int(0.95 * (len(firsts) - 1))], 3),
        "server_counts": health["requests"], "problems": tally.problems,
    }  # fmt: skip
    print(json.dumps(result))
    ok = not (tally.errors or tally.mismatches or tally.bad_4xx != tally.bad_sent)
    return 0 if ok and tally.requests else 1


if __name__ == "__main__":
    sys.exit(main())
