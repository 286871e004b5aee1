"""The bench/ tools that run without a GPU: the random GGUF maker's two layouts, and
bench/compare_trees.py on small fake trees (a trivial C library, a `pyruntime` whose bench prints
a fixed speed) so that its builds, isolation, calibration per tree, interleaving, ratios and
failures are checked in seconds."""

from __future__ import annotations

import importlib.util
import json
import platform
import runpy
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


def load(name: str):
    """bench/NAME.py as a module (registered, as dataclasses need)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("tool", sorted(p.name for p in BENCH.glob("*.py")))
def test_every_tool_answers_help_with_an_example(tool, capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", [tool, "--help"])
    monkeypatch.setattr(sys, "path", list(sys.path))  # the tools put their checkout first
    with pytest.raises(SystemExit) as done:
        runpy.run_path(str(BENCH / tool), run_name="__main__")
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: ") and f"python bench/{tool} " in out


def run_tool(tool: str, *argv: str, monkeypatch) -> None:
    monkeypatch.setattr(sys, "argv", [tool, *argv])
    monkeypatch.setattr(sys, "path", list(sys.path))
    runpy.run_path(str(BENCH / tool), run_name="__main__")


def test_cpu_tools_run_on_small_inputs(cc, tmp_path, capsys, monkeypatch):
    """The CPU tools end to end at toy sizes: their figures are printed, whatever they are."""
    gguf = tmp_path / "tiny.gguf"
    run_tool("make_random_gguf.py", "tiny-olmoe", "-o", str(gguf), monkeypatch=monkeypatch)
    run_tool("cpu_decode.py", "tiny-olmoe", "--gguf", str(gguf), "--threads", "1", "--tokens",
             "4", "--segments", "2", "--dram-gib", "0.01", monkeypatch=monkeypatch)  # fmt: skip
    out = capsys.readouterr().out
    assert "decode: median " in out and "paired: median " in out and "python + call" in out
    from pyruntime.cli import main

    text = str(BENCH.parent / "docs" / "gguf-layout.md")
    assert main(["calibrate", str(gguf), "-f", text, "--max-tokens", "256", "-t", "1"]) == 0
    capsys.readouterr()
    run_tool("cpu_decode.py", "tiny-olmoe", "--gguf", str(gguf), "--threads", "1", "--sparsity",
             "0.5", "--rounds", "2", monkeypatch=monkeypatch)  # fmt: skip
    out = capsys.readouterr().out
    assert "sparsity 0.5: switch: " in out and "every layer sparse" in out
    assert "as the switch chose" in out and " ms a step)" in out
    run_tool("cpu_experts.py", "--shapes", "granite-1b-a400m", "--threads", "1", "--iters", "2",
             "--batches", "1", "--sparsity", "0", "0.5", "--read-gib", "0.01",
             "--footprint-gib", "0.01", monkeypatch=monkeypatch)  # fmt: skip
    rows = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("| granite")]
    assert len(rows) == 2 and "x |" in rows[1]  # dense, then 0.5 with its speedup
    run_tool("read_ceilings.py", "--gib", "0.01", "0.02", "--rounds", "2", "--threads", "1",
             monkeypatch=monkeypatch)  # fmt: skip
    assert "| 0.02 | " in capsys.readouterr().out


def test_cpu_experts_sweep_rotates_its_rounds(cc, capsys, monkeypatch):
    """--sweep: round i runs the combinations rotated by i (none always first), and every table
    has a row per combination (a layer in cache, 1 thread, 3 rounds)."""
    order = load("cpu_experts").round_order
    assert [order(["a", "b", "c"], i) for i in range(4)] == [
        ["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]  # fmt: skip
    run_tool("cpu_experts.py", "--shapes", "granite-in-cache", "--threads", "1", "--iters", "2",
             "--batches", "1", "--sparsity", "0", "0.5", "--read-gib", "0.01", "--footprint-gib",
             "0", "--rounds", "3", "--sweep", "expert_prefetch_neurons=2,4",
             monkeypatch=monkeypatch)  # fmt: skip
    out = capsys.readouterr().out
    tables = out.split("\n\n| expert_prefetch_neurons |")[1:]
    assert len(tables) == 5, out  # wrapper, its spread, bare, its spread, paired
    for table in tables:
        rows = [ln.split(" | ")[0] for ln in table.splitlines() if ln.startswith("| ")]
        assert rows == ["| 2", "| 4"], table
    paired = tables[-1].splitlines()
    assert paired[3].count("%") == 3 and paired[3].count("x") == 3, paired  # dense %, 0.5 x


def test_sparse_read_ceiling_runs_every_case(tmp_path):
    """bench/cpu_sparse_read.c at a toy size (1 thread, 8 MiB, rows of 128 bytes): every case
    prints its rate, the sparse ones their speedup over the contiguous read."""
    compiler = shutil.which("cc")
    if compiler is None or platform.machine() != "x86_64" or "avx2" not in cpu_flags():
        pytest.skip("needs a C compiler on x86-64 with AVX2")
    exe = tmp_path / "sr"
    src = str(BENCH / "cpu_sparse_read.c")
    subprocess.run([compiler, "-O2", "-mavx2", "-pthread", src, "-o", str(exe)], check=True)
    out = subprocess.run([str(exe), "1", "0.0078125", "128", "1"], check=True,
                         capture_output=True, text=True).stdout  # fmt: skip
    rows = [ln for ln in out.splitlines() if "GB/s" in ln and not ln.startswith("plain")]
    assert len(rows) == 13, out
    for name in ("apart 0.5 pipelined", "apart 0.5 4 ahead", "apart, all up/down",
                 "apart 0.9 pipelined", "apart 0.9 4 ahead"):  # fmt: skip
        assert any(ln.strip().startswith(name) and "speedup" in ln for ln in rows), out


def cpu_flags() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def test_cpu_decode_counts_latent_attention(tmp_path, capsys, monkeypatch):
    """bench/cpu_decode.py on deepseek2 (the C step's latent attention): its bytes per token
    count the MLA matrices and one latent plane per position."""
    gguf = tmp_path / "ds.gguf"
    run_tool("make_random_gguf.py", "tiny-deepseek-v2", "-o", str(gguf), monkeypatch=monkeypatch)
    run_tool("cpu_decode.py", "tiny-deepseek-v2", "--gguf", str(gguf), "--threads", "1",
             "--tokens", "4", "--dram-gib", "0.01", monkeypatch=monkeypatch)  # fmt: skip
    assert "decode: median " in capsys.readouterr().out


def test_cpu_decode_narrow(tmp_path, capsys, monkeypatch):
    """bench/cpu_decode.py --narrow: the shape's structure at small widths (K-quant rows of 256
    stay real), run as any shape; shapes with widths of their own are a one-line error."""
    gguf = tmp_path / "narrow.gguf"
    run_tool("cpu_decode.py", "granite-1b-a400m", "--narrow", "--outtype", "q4_k_m", "--gguf",
             str(gguf), "--threads", "1", "--tokens", "2", "--segments", "1", "--dram-gib",
             "0.01", monkeypatch=monkeypatch)  # fmt: skip
    out = capsys.readouterr().out
    assert "granite-1b-a400m-narrow q4_k_m:" in out and "decode: median " in out
    from pyruntime.gguf.file import open_gguf

    f = open_gguf(gguf)
    assert f.get(f"{f.arch}.embedding_length") == 256 and f.get(f"{f.arch}.block_count") == 24
    with pytest.raises(SystemExit) as err:
        run_tool("cpu_decode.py", "deepseek-v2-lite", "--narrow", monkeypatch=monkeypatch)
    assert err.value.code == 2
    assert "--narrow: deepseek-v2-lite has widths of its own" in capsys.readouterr().err


def test_random_gguf_layouts(tmp_path):
    from gguf import GGUFReader

    from pyruntime.gguf.file import open_gguf

    maker = load("make_random_gguf")
    ours = maker.make_random_gguf("tiny-olmoe", tmp_path / "o.gguf", progress=False)
    f = open_gguf(ours)  # the runtime's reader accepts it (layout version, every tensor)
    assert f.get("olmoe.expert_count") == 16
    lcpp = tmp_path / "l.gguf"
    maker.make_random_gguf("tiny-olmoe", lcpp, progress=False, layout="llama.cpp")
    r = GGUFReader(lcpp)
    assert not [k for k in r.fields if k.startswith("pyruntime.")]
    assert int(r.fields["olmoe.feed_forward_length"].parts[-1][0]) == 96
    shapes = {t.name: [int(n) for n in t.shape] for t in r.tensors}  # innermost first
    assert "blk.0.ffn_gud_exps.weight" not in shapes
    assert shapes["blk.3.ffn_gate_exps.weight"] == [192, 96, 16]
    assert shapes["blk.3.ffn_up_exps.weight"] == [192, 96, 16]
    assert shapes["blk.3.ffn_down_exps.weight"] == [96, 192, 16]
    ours_r = GGUFReader(ours)
    # the same bytes of weights either way: the experts split in three, nothing else changed
    assert sum(t.n_bytes for t in r.tensors) == sum(t.n_bytes for t in ours_r.tensors)


FAKE_MAIN = """
import json, os, sys
from pathlib import Path
root = Path(__file__).resolve().parents[1]
assert Path(os.environ["PYRUNTIME_CORE_LIB"]).is_file()
assert Path(os.environ["PYRUNTIME_CORE_LIB"]).parent.name.startswith("build-" + root.name)
cmd, model, *rest = sys.argv[1:]
if cmd == "calibrate":
    Path(model + ".sparsity.json").write_text(str(root))
    with open(root.parent / "calibrations.txt", "a") as log:
        log.write(root.name + "\\n")
    sys.exit(0)
if "--sparsity" in rest and Path(model + ".sparsity.json").read_text() != str(root):
    sys.exit("error: calibrated by another tree")
with open(root.parent / "order.txt", "a") as log:
    log.write(root.name + " " + " ".join(rest) + "\\n")
print(json.dumps([{"test": "tg32", "avg_ts": float((root / "speed.txt").read_text())}]))
"""
FAKE_DECODE = """
from pathlib import Path
speed = float((Path(__file__).resolve().parents[1] / "speed.txt").read_text())
print(f"decode: median {1e3 / speed} ms/token = {speed} tokens/s")
"""


def fake_tree(path: Path, speed: float, cmake: str = "", decode: bool = True) -> Path:
    """A tree the tool can build and run: libpyrt from one C file, pyruntime's CLI and
    bench/cpu_decode.py reporting `speed` tokens/s."""
    (path / "pyruntime").mkdir(parents=True)
    (path / "bench").mkdir()
    (path / "CMakeLists.txt").write_text(
        "cmake_minimum_required(VERSION 3.16)\nproject(fake C)\n"
        f"{cmake}add_library(pyrt SHARED core.c)\n"
    )
    (path / "core.c").write_text("int pyrt_fake(void) { return 0; }\n")
    (path / "pyruntime" / "__init__.py").write_text("")
    (path / "pyruntime" / "__main__.py").write_text(FAKE_MAIN)
    if decode:
        (path / "bench" / "cpu_decode.py").write_text(FAKE_DECODE)
    (path / "speed.txt").write_text(str(speed))
    return path


def run_compare(tmp_path, old: Path, new: Path, *extra: str):
    tool = load("compare_trees")
    model = tmp_path / "model.gguf"
    if not model.exists():
        model.write_bytes(b"GGUF")
    argv = [str(old), str(new), "--gguf", str(model), "--workdir", str(tmp_path / "work")]
    return tool.main([*argv, "--rounds", "2", *extra])


def test_compare_trees_ratios_and_order(tmp_path, capsys):
    old, new = fake_tree(tmp_path / "old", 100.0), fake_tree(tmp_path / "new", 110.0)
    out_json = tmp_path / "samples.json"
    rc = run_compare(tmp_path, old, new, "--case", "cpu", "gpu-sparse", "cpu-decode",
                     "--threads", "3", "--json", str(out_json))  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0, out
    for case, figure in (("cpu", "tg32"), ("gpu-sparse", "tg32"), ("cpu-decode", "decode")):
        row = f"| {case} | {figure} | 100.00 (100.00-100.00) | 110.00 (110.00-110.00) "
        assert row + "| 1.100 (1.100-1.100) |" in out, out
    # A B A B: each case old then new, every round; the threads passed to both
    order = (tmp_path / "order.txt").read_text().splitlines()
    assert [line.split()[0] for line in order] == ["old", "new"] * 4
    assert all(line.endswith("-t 3") for line in order)
    rows = json.loads(out_json.read_text())["rows"]
    assert rows[0]["rounds"] == [{"old": 100.0, "new": 110.0}] * 2
    assert (tmp_path / "calibrations.txt").read_text().split() == ["old", "new"]
    assert run_compare(tmp_path, old, new, "--case", "gpu-sparse") == 0  # same workdir
    assert (tmp_path / "calibrations.txt").read_text().split() == ["old", "new"]  # kept


def test_compare_trees_build_failure(tmp_path, capsys):
    old = fake_tree(tmp_path / "old", 100.0)
    new = fake_tree(tmp_path / "new", 100.0, cmake='message(FATAL_ERROR "planted failure")\n')
    assert run_compare(tmp_path, old, new, "--case", "cpu") == 1
    out, err = capsys.readouterr()
    assert "NEW" in err and "the C core build failed" in err and "planted failure" in err
    assert "OLD" not in err  # the old tree built
    assert "round" not in out and not (tmp_path / "order.txt").exists()  # nothing ran


def test_compare_trees_never_runs_a_stale_build(tmp_path, capsys):
    old, new = fake_tree(tmp_path / "old", 100.0), fake_tree(tmp_path / "new", 100.0)
    assert run_compare(tmp_path, old, new, "--case", "cpu") == 0
    runs = (tmp_path / "order.txt").read_text()
    (new / "core.c").write_text("int pyrt_fake(void) { return }\n")  # same workdir, old lib there
    assert run_compare(tmp_path, old, new, "--case", "cpu") == 1
    assert "NEW (" in capsys.readouterr().err and (tmp_path / "order.txt").read_text() == runs


def test_compare_trees_case_failing_in_one_tree(tmp_path, capsys):
    old = fake_tree(tmp_path / "old", 100.0, decode=False)
    new = fake_tree(tmp_path / "new", 120.0)
    assert run_compare(tmp_path, old, new, "--case", "cpu-decode", "cpu") == 1
    out = capsys.readouterr().out
    assert "OLD failed cpu-decode: round 1: exit" in out
    assert "| cpu | tg32 | 100.00 (100.00-100.00) | 120.00 (120.00-120.00) | 1.200" in out
    assert out.count("round 2/2 cpu-decode") == 0  # dropped after its failure


def test_compare_trees_checks_out_revisions(tmp_path, monkeypatch):
    tool = load("compare_trees")
    repo = tmp_path / "repo"
    fake_tree(repo, 1.0)
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "one"], check=True)
    tree = tool.resolve_tree("HEAD", "old", repo, tmp_path / "work")
    assert tree.rev and (tree.root / "speed.txt").read_text() == "1.0"
    assert tree.root.parent == tmp_path / "work" / "trees"
    with pytest.raises(tool.CompareError, match="neither a folder holding a tree"):
        tool.resolve_tree("no-such-rev", "new", repo, tmp_path / "work")
    (tmp_path / "HEAD").mkdir()  # a folder that is no tree does not hide the revision
    monkeypatch.chdir(tmp_path)
    assert tool.resolve_tree("HEAD", "new", repo, tmp_path / "work").rev == tree.rev


def test_compare_trees_without_git(tmp_path, monkeypatch):
    """A host without git (folders made by `git archive`): no crash, a one-line error for a
    revision."""
    tool = load("compare_trees")

    def no_git(cmd, **kw):
        raise FileNotFoundError(2, "No such file or directory", cmd[0])

    monkeypatch.setattr(tool.subprocess, "run", no_git)
    assert tool.git(tmp_path, "rev-parse", "HEAD", check=False) == ""
    with pytest.raises(tool.CompareError, match="neither a folder holding a tree"):
        tool.resolve_tree("main", "old", tmp_path, tmp_path / "work")
    assert (
        tool.resolve_tree(str(fake_tree(tmp_path / "t", 1.0)), "old", tmp_path, tmp_path).rev
        is None
    )


def decodes_and_shows(maker, shape: str, outtype: str, tmp_path: Path, capsys):
    """Our layout of the random `shape` in `outtype` loads and decodes on the CPU (a 20-token
    prompt, then a token: finite logits) and `info` reads it: (the executor, info's output)."""
    import torch

    from pyruntime.cli import main
    from pyruntime.cpu.executor import CpuExecutor
    from pyruntime.gguf.file import open_gguf

    ours = maker.make_random_gguf(shape, tmp_path / "o.gguf", outtype, progress=False)
    model = CpuExecutor.from_gguf(open_gguf(ours))
    cache = model.new_cache(40)
    logits = torch.cat([model.forward(list(range(20)), cache), model.forward([7], cache)])
    assert logits.shape == (21, 4096) and torch.isfinite(logits).all()
    assert main(["info", str(ours)]) == 0
    return model, capsys.readouterr().out


def test_random_gpt_oss_gguf_and_its_llama_cpp_twin(tmp_path, capsys):
    """gpt-oss's shape: our layout (MXFP4 experts) loads and decodes, `info` shows its fields;
    the llama.cpp twin splits the experts and their biases and names ffn_norm as llama.cpp."""
    from gguf import GGUFReader

    maker = load("make_random_gguf")
    assert maker.CONFIGS["gpt-oss-20b"]["num_local_experts"] == 32
    _, out = decodes_and_shows(maker, "tiny-gpt-oss", "mxfp4", tmp_path, capsys)
    for row in ("swiglu_oai", "yarn x32.0", "16 on 1 of 2 layers", "attention sinks : yes"):
        assert row in out, out
    lcpp = tmp_path / "l.gguf"
    maker.make_random_gguf("tiny-gpt-oss", lcpp, "mxfp4", progress=False, layout="llama.cpp")
    shapes = {t.name: [int(n) for n in t.shape] for t in GGUFReader(lcpp).tensors}
    assert shapes["blk.1.ffn_gate_exps.bias"] == [96, 8]
    assert shapes["blk.1.ffn_down_exps.bias"] == [128, 8]
    assert shapes["blk.1.ffn_down_exps.weight"] == [96, 128, 8]
    assert "blk.1.post_attention_norm.weight" in shapes and "blk.1.ffn_norm.weight" not in shapes
    assert "blk.1.attn_sinks.weight" in shapes and "blk.1.ffn_gu_exps.bias" not in shapes


def test_random_qwen35_gguf_and_its_llama_cpp_twin(tmp_path, capsys):
    """qwen3.5's shape: our layout loads and decodes on the CPU (a prompt then a token), `info`
    shows the DeltaNet rows; the llama.cpp twin joins a full-attention layer's query and gate,
    names ffn_norm post_attention_norm and has the MRoPE sections llama.cpp requires."""
    from gguf import GGUFReader

    maker = load("make_random_gguf")
    real = maker.CONFIGS["qwen3.5-35b-a3b"]
    assert (real["num_experts"], real["num_experts_per_tok"]) == (256, 8)
    _, out = decodes_and_shows(maker, "tiny-qwen3.5", "q8_0", tmp_path, capsys)
    for row in ("Gated DeltaNet on 3 of 4 layers (full attention: 3)", "8 of 32 per head"):
        assert row in out, out
    lcpp = tmp_path / "l.gguf"
    maker.make_random_gguf("tiny-qwen3.5", lcpp, "q8_0", progress=False, layout="llama.cpp")
    r = GGUFReader(lcpp)
    shapes = {t.name: [int(n) for n in t.shape] for t in r.tensors}
    assert shapes["blk.3.attn_q.weight"] == [128, 256] and "blk.3.attn_gate.weight" not in shapes
    assert shapes["blk.0.attn_gate.weight"] == [128, 128]  # the DeltaNet's z
    assert shapes["blk.0.ssm_conv1d.weight"] == [4, 256] and "blk.0.ssm_a" in shapes
    assert shapes["blk.0.ffn_down_exps.weight"] == [64, 128, 16]
    assert "blk.0.post_attention_norm.weight" in shapes and "blk.0.ffn_norm.weight" not in shapes
    sections = r.fields["qwen35moe.rope.dimension_sections"]
    assert [int(sections.parts[i][0]) for i in sections.data] == [11, 11, 10, 0]


def test_peers_gpu_floor_is_flops_per_token_at_the_peak(tmp_path):
    """peers.py's floor of a pp row: the measured peak over FLOPs per prompt token (the
    per-token weights, attention over the mean cached length, the lm_head's share), so longer
    prompts have lower floors and the floor scales with the peak."""
    from types import SimpleNamespace

    from pyruntime.gguf.file import open_gguf
    from pyruntime.model.config import ModelConfig
    from pyruntime.model.weights import HostWeights

    gguf = load("make_random_gguf").make_random_gguf("tiny-olmoe", tmp_path / "m.gguf",
                                                      progress=False)  # fmt: skip
    peers, cpu_prefill = load("peers"), load("cpu_prefill")
    floors = peers.gpu_floors(gguf, [128, 512], 100.0)
    f = open_gguf(gguf)
    cfg = ModelConfig.from_gguf(f)
    model = SimpleNamespace(config=cfg, weights=HostWeights.from_gguf(f, cfg))
    assert floors["pp512"] == pytest.approx(100e12 / cpu_prefill.flops_per_token(model, 512))
    assert floors["pp128"] > floors["pp512"] > 0
    assert peers.gpu_floors(gguf, [512], 200.0)["pp512"] == pytest.approx(2 * floors["pp512"])


def test_peers_n_cpu_moe_is_the_fewest_layers_that_fit_the_budget(tmp_path):
    """peers.py's gpu-mem setup: llama.cpp's -ncmoe N is the fewest first layers whose routed
    experts, left on the CPU, bring its other weights within the budget less the reserve; an
    untied token_embd stays on the CPU (llama.cpp's input layer)."""
    from gguf import GGUFReader

    gguf = tmp_path / "l.gguf"
    load("make_random_gguf").make_random_gguf("tiny-olmoe", gguf, "q8_0", progress=False,
                                              layout="llama.cpp")  # fmt: skip
    peers = load("peers")
    tensors = GGUFReader(gguf).tensors
    assert "output.weight" in {t.name for t in tensors}  # untied
    total = sum(int(t.n_bytes) for t in tensors if t.name != "token_embd.weight")
    experts = {}
    for t in tensors:
        if "_exps" in t.name:
            layer = int(t.name.split(".")[1])
            experts[layer] = experts.get(layer, 0) + int(t.n_bytes)
    assert peers.n_cpu_moe(gguf, total + peers.RESERVE) == (0, total)
    two = total - experts[0] - experts[1]
    assert peers.n_cpu_moe(gguf, two + peers.RESERVE) == (2, two)
    assert peers.n_cpu_moe(gguf, two + peers.RESERVE + 1) == (2, two)
    assert peers.n_cpu_moe(gguf, two + experts[1] + peers.RESERVE - 1) == (2, two)
    with pytest.raises(SystemExit, match="without any expert"):
        peers.n_cpu_moe(gguf, peers.RESERVE + 1)


def test_random_deepseek2_gguf_and_its_llama_cpp_twin(tmp_path, capsys):
    """deepseek-v2-lite's shape: our layout loads and decodes on the CPU (a prompt then a
    token), `info` shows the latent attention rows; the llama.cpp twin splits the experts and
    keeps the MLA tensors under their (llama.cpp's) names and shapes."""
    from gguf import GGUFReader

    maker = load("make_random_gguf")
    real = maker.CONFIGS["deepseek-v2-lite"]
    assert (real["num_hidden_layers"], real["hidden_size"], real["kv_lora_rank"]) == (27, 2048, 512)
    assert (real["n_routed_experts"], real["num_experts_per_tok"], real["n_shared_experts"]) == (
        64, 6, 2,
    )  # fmt: skip
    assert real["first_k_dense_replace"] == 1 and real["q_lora_rank"] is None
    _, out = decodes_and_shows(maker, "tiny-deepseek-v2", "q8_0", tmp_path, capsys)
    assert "latent 64 + rope key 32 per token; per head 32 + 32 key, 32 value dims" in out, out
    lcpp = tmp_path / "l.gguf"
    maker.make_random_gguf("tiny-deepseek-v2", lcpp, "q8_0", progress=False, layout="llama.cpp")
    r = GGUFReader(lcpp)
    shapes = {t.name: [int(n) for n in t.shape] for t in r.tensors}
    assert shapes["blk.1.attn_k_b.weight"] == [32, 64, 4]  # ggml order: nope, rank, heads
    assert shapes["blk.1.attn_v_b.weight"] == [64, 32, 4]
    assert shapes["blk.1.attn_kv_a_mqa.weight"] == [128, 96]
    assert shapes["blk.1.ffn_down_exps.weight"] == [64, 128, 16]
    assert "blk.1.ffn_gate_shexp.weight" in shapes and "blk.0.ffn_gate.weight" in shapes
    assert int(r.fields["deepseek2.attention.q_lora_rank"].parts[-1][0]) == 64


def test_random_llama4_gguf_and_its_llama_cpp_twin(tmp_path, capsys):
    """llama-4-scout's shape: our layout loads and decodes on the CPU (a prompt longer than the
    tiny shape's chunk, then a token), `info` shows its rows; the llama.cpp twin splits the
    experts, keeps the shared expert and the dense layers, and drops the llama3 scaling keys."""
    from gguf import GGUFReader

    from pyruntime.cli import main

    maker = load("make_random_gguf")
    real = maker.CONFIGS["llama-4-scout"]
    assert (real["num_local_experts"], real["num_experts_per_tok"]) == (16, 1)
    assert (real["num_hidden_layers"], real["hidden_size"], real["intermediate_size"]) == (
        48, 5120, 8192)  # fmt: skip
    model, out = decodes_and_shows(maker, "tiny-llama4", "q8_0", tmp_path, capsys)
    assert model.moe_layers() == [1, 3]
    for row in ("llama3 x16.0 (original context 8192)", "nope layers       : 1, 3",
                "attention chunk   : 8 tokens on the rope layers"):  # fmt: skip
        assert row in out, out
    lcpp = tmp_path / "l.gguf"
    maker.make_random_gguf("tiny-llama4", lcpp, "q8_0", progress=False, layout="llama.cpp")
    r = GGUFReader(lcpp)
    shapes = {t.name: [int(n) for n in t.shape] for t in r.tensors}
    assert shapes["blk.1.ffn_down_exps.weight"] == [64, 128, 8]
    assert shapes["blk.1.ffn_up_shexp.weight"] == [128, 64]
    assert (
        shapes["blk.0.ffn_gate.weight"] == [128, 128] and "blk.0.ffn_gate_inp.weight" not in shapes
    )
    assert r.fields["llama4.interleave_moe_layer_step"].contents() == 2
    assert r.fields["llama4.feed_forward_length"].contents() == 128
    assert not [k for k in r.fields if k.startswith(("llama4.rope.scaling.", "pyruntime."))]
    assert main(["info", str(lcpp)]) == 0  # its MoE layers found by llama.cpp's expert names
    assert "dense ffn layers  : 0, 2 (ffn 128; MoE every 2)" in capsys.readouterr().out
