"""`pyruntime bench` and `--device` on the demo model: the CPU here, also the GPU where one is.

In-process through `cli.main(argv)`, plus one subprocess run for the no-traceback error line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pyruntime import cli
from pyruntime.errors import DeviceMemoryError, UsageError
from pyruntime.tools.bench import BenchResult, run_bench
from pyruntime.tools.demo import demo_model_path

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory) -> Path:
    return demo_model_path(tmp_path_factory.getbasetemp() / "pyruntime-cache", quiet=True)


def test_bench_markdown_table(gguf_path, capsys):
    rc = cli.main(["bench", str(gguf_path), "-p", "8", "-n", "4", "-r", "2", "--device", "cpu"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    lines = out.strip().splitlines()
    assert lines[0].startswith("| model |") and len(lines) == 4  # header, rule, pp8, tg4
    assert "| pp8 |" in lines[2] and "| tg4 |" in lines[3]
    assert " ± " in lines[2] and "CPU" in lines[2]
    assert "tg4 [2/2]" in err  # progress per repetition on stderr


def test_bench_json(gguf_path, capsys):
    argv = ["bench", str(gguf_path), "-p", "6", "-n", "0", "-r", "3", "-o", "json"]
    assert cli.main([*argv, "--device", "cpu"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["test"] for r in rows] == ["pp6"]  # -n 0 skips tg
    row = rows[0]
    assert row["reps"] == 3 and len(row["samples_s"]) == 3
    assert row["device"] == "cpu" and row["sparsity_target"] == 0.0
    tps = [6 / s for s in row["samples_s"]]
    assert row["avg_ts"] == pytest.approx(sum(tps) / 3)
    assert row["stddev_ts"] >= 0


def test_bench_counts_every_decode_step():
    """tg N runs N single-token forward passes from an empty cache, per repetition."""

    class FakeNet:
        config = type("C", (), {"n_vocab": 50, "n_expert": 8, "n_expert_used": 2})()

        def __init__(self):
            self.calls: list[int] = []

        def new_cache(self, n):
            return type("K", (), {"truncate": lambda self, n: None})()

        def forward(self, ids, cache, last_only=False, *, k=None, routing=None):
            assert k is None  # plain decoding: the model's own top-k
            self.calls.append(len(ids))

    net = FakeNet()
    results = run_bench(net, n_prompt=0, n_gen=5, reps=2)
    assert [r.test for r in results] == ["tg5"]
    assert net.calls == [1] * 15  # warm-up + 2 repetitions, 5 steps each
    # with CUDA graphs two warm-ups: a prompt shape is captured the second time it comes
    net = FakeNet()
    net.cuda_graphs = True
    run_bench(net, n_prompt=4, n_gen=0, reps=2)
    assert net.calls == [4] * 4


def test_bench_result_stats():
    r = BenchResult("tg4", 4, [1.0, 2.0])
    assert r.tokens_per_second == [4.0, 2.0]
    assert r.mean == 3.0 and r.std == pytest.approx(2**0.5)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["-r", "0"], "repetitions"),
        (["-p", "0", "-n", "0"], "-p N and/or -n N"),
        (["--device", "tpu"], "--device must be"),
    ],
)
def test_bench_bad_arguments(gguf_path, capsys, argv, message):
    assert cli.main(["bench", str(gguf_path), *argv]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and message in err[-1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error")
def test_device_cuda_without_gpu_is_one_line_error(gguf_path):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    r = subprocess.run(
        [sys.executable, "-m", "pyruntime", "bench", str(gguf_path), "--device", "cuda"],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=120,
    )
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --device cuda: no CUDA GPU"), r.stderr


def test_api_device_choice(gguf_path):
    from pyruntime.api import Model

    m = Model(gguf_path, n_ctx=64, device="auto")
    assert m.device == ("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(UsageError, match="no CUDA GPU"):
            Model(gguf_path, n_ctx=64, device="cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_api_gpu_generation_matches_cpu(gguf_path):
    """Greedy text on the GPU (CUDA-graph decode) equals the CPU path's on the demo model."""
    from pyruntime.api import Model

    gpu = Model(gguf_path, n_ctx=128, device="cuda")
    cpu = Model(gguf_path, n_ctx=128, device="cpu", expert_backend="torch")
    prompt = "The hacker wrote a program that"
    a = list(gpu.generate(prompt, max_tokens=24, temp=0))
    b = list(cpu.generate(prompt, max_tokens=24, temp=0))
    assert "".join(a) == "".join(b)
    ids = gpu.tokenize(prompt * 4)
    lg = torch.log_softmax(torch.from_numpy(gpu.logits(ids)).double(), -1)
    lc = torch.log_softmax(torch.from_numpy(cpu.logits(ids)).double(), -1)
    assert (lg - lc).abs().max().item() <= 1e-3


def test_device_choice_when_the_model_does_not_fit(gguf_path, monkeypatch):
    """A GPU with too little free memory: auto falls back to the CPU and says why; cuda fails."""
    from pyruntime.gguf.file import open_gguf
    from pyruntime.model.config import ModelConfig
    from pyruntime.placement import choose_device

    f = open_gguf(gguf_path)
    cfg = ModelConfig.from_gguf(f)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev=None: (1 << 20, 80 << 30))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda dev=None: "Tiny GPU")
    choice = choose_device("auto", f, cfg, 64)
    assert choice.device == "cpu" and choice.note.startswith("running on the CPU: ")
    assert "is free on Tiny GPU" in choice.note
    with pytest.raises(DeviceMemoryError, match="--device cuda: the dense weights .* 64-token KV"):
        choose_device("cuda", f, cfg, 64)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev=None: (80 << 30, 80 << 30))
    assert choose_device("auto", f, cfg, 64).device == "cuda"


def test_device_flag_on_generate_and_perplexity(gguf_path, tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text("The hacker wrote a program that fixed the bug. " * 4)
    argv = ["generate", str(gguf_path), "-p", "Hi", "-n", "3", "--temp", "0", "--device", "cpu"]
    assert cli.main(argv) == 0
    capsys.readouterr()
    argv = ["perplexity", str(gguf_path), "-f", str(text), "--ctx", "16", "--device", "gpu"]
    assert cli.main(argv) == 1
    assert "--device must be auto, cpu, cuda or cuda:N" in capsys.readouterr().err


def test_device_choice_without_a_gpu_kernel(gguf_path, monkeypatch):
    """gelu_exact experts have no Triton kernel: auto takes the CPU, cuda is an error."""
    import dataclasses

    from pyruntime.gguf.file import open_gguf
    from pyruntime.model.config import ModelConfig
    from pyruntime.placement import choose_device

    f = open_gguf(gguf_path)
    cfg = dataclasses.replace(ModelConfig.from_gguf(f), activation="gelu_exact")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert "no GPU kernel" in choose_device("auto", f, cfg, 64).note
    with pytest.raises(UsageError, match="no GPU kernel"):
        choose_device("cuda", f, cfg, 64)


def test_the_table_gives_the_c_cores_threads_for_the_hybrid_and_the_cpu_model():
    """The threads column: the C core's pool wherever it computes experts (the CPU model's
    expert backend, the hybrid's CPU share), not torch's one thread beside it."""
    from types import SimpleNamespace

    from pyruntime.cli.bench import _cpu_threads

    core = SimpleNamespace(threads=7)
    hybrid = SimpleNamespace(net=SimpleNamespace(core=core))
    cpu = SimpleNamespace(net=SimpleNamespace(expert_backend=SimpleNamespace(core=core)))
    assert _cpu_threads(hybrid) == _cpu_threads(cpu) == 7
