"""llama.cpp's GGUFs: layout detection, the repack into ours, its cache, `pyruntime repack`, and
one-line errors for what cannot run (i-quants, missing keys and tensors)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize, quantize
from hf_fixtures import ARCHS, make_tiny_hf_model
from llamacpp_fixtures import kquant_type, llama_quantize, permute, to_llamacpp

from pyruntime.converter import convert
from pyruntime.converter.repack import repack
from pyruntime.converter.repack_cache import cached_copy_path, open_model_file
from pyruntime.errors import ModelFileError
from pyruntime.gguf.file import open_gguf
from pyruntime.model.config import ModelConfig
from pyruntime.model.llamacpp_layout import EXPERT_WEIGHTS_NORM, detect_layout, unpermute_rows

Q = GGMLQuantizationType
IDS = list(range(5, 60, 3))
# The families the repack knows (llamacpp_layout.FAMILIES); llama.cpp's gpt-oss files are not
# repacked yet (refused in one line: test_gpt_oss_file_is_refused_in_one_line), nor its qwen35moe
# files (DeltaNet value heads tiled, the attention gate inside attn_q), nor its deepseek2 files
# (interleaved rope rows), nor its llama4 files
REPACKED_ARCHS = [a for a in ARCHS if a not in ("gptoss", "qwen35moe", "deepseek2", "llama4")]
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PYRUNTIME_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """{(arch, outtype): (our file, the llama.cpp layout of it)} of the tiny random models
    (qwen without dense layers: llama.cpp's qwen graphs have none; qwen3moe normalising its
    routing weights, which llama.cpp's qwen3moe graph always does, as real Qwen3 models do)."""
    root = tmp_path_factory.mktemp("llamacpp")
    out = {}
    for arch in REPACKED_ARCHS:
        extra = {"mlp_only_layers": []} if arch.startswith("qwen") else {}
        if arch == "qwen3moe":
            extra["norm_topk_prob"] = True
        hf = make_tiny_hf_model(arch, root / arch, **extra)
        for outtype in ("f32", "q8_0"):
            ours = convert(hf, root / f"{arch}-{outtype}.gguf", outtype, progress=False)
            out[arch, outtype] = ours, to_llamacpp(ours, root / f"{arch}-{outtype}-lcpp.gguf")
    return out


def _logits(path: Path) -> np.ndarray:
    from pyruntime.api import Model

    return Model(path, device="cpu").logits(IDS)


def test_unpermute_undoes_llamacpp_permute():
    w = np.arange(4 * 8 * 3).reshape(4 * 8, 3)  # 4 heads of 8 rows
    assert (permute(w, 4)[unpermute_rows(32, 4)] == w).all()
    assert not (permute(w, 4) == w).all()


@pytest.mark.parametrize("arch", REPACKED_ARCHS)
def test_llamacpp_file_runs_as_ours(files, arch):
    """F32: the repacked llama.cpp file computes exactly what our own conversion does (the
    experts rearranged, q/k rows of llama and granitemoe put back in Hugging Face's order)."""
    ours, lcpp = files[arch, "f32"]
    assert detect_layout(open_gguf(lcpp)) == "llama.cpp"
    assert detect_layout(open_gguf(ours)) == "pyruntime"
    np.testing.assert_array_equal(_logits(lcpp), _logits(ours))


def test_quantized_experts_repacked_row_by_row(files, tmp_path):
    """Q8_0: gate and up rows are the source's bytes; down rows are the source's down matrix
    transposed and quantized once more along n_embd."""
    _, lcpp = files["olmoe", "q8_0"]
    src = open_gguf(lcpp)
    out = open_gguf(repack(src, tmp_path / "out.gguf", progress=False))
    gud = np.asarray(out.tensors["blk.1.ffn_gud_exps.weight"].data)  # [E, ff, 3, row_bytes]
    gate = np.asarray(src.tensors["blk.1.ffn_gate_exps.weight"].data)
    up = np.asarray(src.tensors["blk.1.ffn_up_exps.weight"].data)
    down = np.asarray(src.tensors["blk.1.ffn_down_exps.weight"].data)  # [E, n, ff bytes]
    assert out.tensors["blk.1.ffn_gud_exps.weight"].qtype == Q.Q8_0
    np.testing.assert_array_equal(gud[:, :, 0], gate)
    np.testing.assert_array_equal(gud[:, :, 1], up)
    for e in (0, 3):
        d = dequantize(down[e], Q.Q8_0)  # [n, ff]
        expect = quantize(np.ascontiguousarray(d.T), Q.Q8_0)
        np.testing.assert_array_equal(gud[e, :, 2], expect)
    # lossless with --outtype f32: the down rows are the source's values exactly
    exact = open_gguf(repack(src, tmp_path / "f32.gguf", "f32", progress=False))
    rows = np.asarray(exact.tensors["blk.1.ffn_gud_exps.weight"].data)  # [E, ff, 3, n] f32
    np.testing.assert_array_equal(rows[2, :, 2], dequantize(down[2], Q.Q8_0).T)


def test_repacked_metadata_applies_llamacpp_defaults(files, tmp_path):
    """Keys llama.cpp's converter leaves out get llama.cpp's values: the routing normalisation
    its graph fixes per family, the experts' size from feed_forward_length."""
    _, lcpp = files["mixtral", "q8_0"]
    src = open_gguf(lcpp)
    assert "llama.expert_weights_norm" not in src.metadata
    out = open_gguf(repack(src, tmp_path / "out.gguf", progress=False))
    cfg = ModelConfig.from_gguf(out)
    assert cfg.expert_weights_norm is EXPERT_WEIGHTS_NORM["llama"] is True
    assert cfg.n_ff_exp == 32 and out.get("pyruntime.hf_architecture") == "MixtralForCausalLM"
    assert out.get("tokenizer.ggml.pre") == src.get("tokenizer.ggml.pre")


def test_cache_is_reused_and_follows_the_source(files, tmp_path, capfd):
    _, lcpp = files["olmoe", "q8_0"]
    src = tmp_path / "model.gguf"
    src.write_bytes(lcpp.read_bytes())
    first = open_model_file(src)
    assert "repacking its experts once" in capfd.readouterr().err
    assert first.path == cached_copy_path(src) and first.path.parent.name == "repacked"
    made = first.path.stat().st_mtime_ns
    again = open_model_file(src)
    assert again.path == first.path and again.path.stat().st_mtime_ns == made
    assert "repacking" not in capfd.readouterr().err
    os.utime(src, ns=(made + 10**9, made + 10**9))  # the source changed: made again
    open_model_file(src)
    assert "repacking its experts once" in capfd.readouterr().err


def test_cache_made_again_for_a_replaced_source(files, tmp_path, capfd):
    """Same size and modification time, another header (a metadata value edited in place):
    the copy is of another file, so it is made again."""
    src = tmp_path / "model.gguf"
    src.write_bytes(files["olmoe", "f32"][1].read_bytes())
    open_model_file(src)
    st = os.stat(src)
    data = bytearray(src.read_bytes())
    at = data.index(b"general.name") + len(b"general.name") + 4 + 8  # its type, its length
    data[at] = ord("X") if data[at] != ord("X") else ord("Y")
    src.write_bytes(data)
    os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(src).st_size == st.st_size
    capfd.readouterr()
    again = open_model_file(src)
    assert "repacking its experts once" in capfd.readouterr().err
    assert again.get("general.name")[0] in "XY"


def test_model_opens_a_llamacpp_file_once(files):
    from pyruntime.api import Model

    _, lcpp = files["qwen2moe", "q8_0"]
    m = Model(lcpp, device="cpu")
    assert m.path == lcpp and m.file.path == cached_copy_path(lcpp)
    assert m.tokenize("Hello world") == Model(files["qwen2moe", "q8_0"][0]).tokenize("Hello world")


def _mean_kl(ref: np.ndarray, other: np.ndarray) -> float:
    """Mean over positions of KL(softmax(ref) || softmax(other)) of logits [T, V]; nats."""
    lp = torch.log_softmax(torch.from_numpy(ref).double(), -1)
    lq = torch.log_softmax(torch.from_numpy(other).double(), -1)
    return float((lp.exp() * (lp - lq)).sum(-1).mean())


# Mean KL from F32 (nats) of llama-quantize's Q4_K_M / Q5_K_M mixes at rows of 64 and 32 (every
# K-quant falls back to Q5_0 / Q5_1 / Q8_0) over IDS: measured 3.8e-5 .. 6.0e-5 on olmoe and
# qwen2moe; a Q5 decoder that drops the fifth bit gives 0.022 .. 0.026.
MIX_KL_TOL = {"Q4_K_M": 3e-4, "Q5_K_M": 3e-4}


@pytest.mark.parametrize("ftype", ["Q4_K_M", "Q5_K_M"])
@pytest.mark.parametrize("arch", ["olmoe", "qwen2moe"])
def test_llama_quantize_mix_at_small_rows(files, arch, ftype, tmp_path):
    """What llama-quantize writes for rows that are not a multiple of 256 (the trained
    checkpoints' 192, 128, 96, 64: Q5_0 or Q5_1 with Q8_0 for attn_v, ffn_down and output in
    the layers llama.cpp gives more bits): it opens and runs at its own size (the repacked
    experts keep the source's formats) and close to F32."""
    from pyruntime.api import Model

    ours, lcpp = files[arch, "f32"]
    src = llama_quantize(lcpp, tmp_path / f"{arch}-{ftype}.gguf", ftype, k_quantize=None)
    fallback = {"Q4_K_M": Q.Q5_0, "Q5_K_M": Q.Q5_1}[ftype]
    m = Model(src, device="cpu")
    got = m.file.tensors
    for i in range(2):
        down = kquant_type(f"blk.{i}.ffn_down_exps.weight", 32, 2, ftype)  # Q8_0 in layer 1
        assert got[f"blk.{i}.ffn_gud_exps.weight"].qtype == (fallback if i == 0 else Q.Q8_0)
        assert down == (fallback if i == 0 else Q.Q8_0)
        assert got[f"blk.{i}.attn_q.weight"].qtype == fallback
    kl = _mean_kl(_logits(ours), m.logits(IDS))
    assert kl <= MIX_KL_TOL[ftype], f"{arch} {ftype}: mean KL from f32 {kl:.4g}"


def _write(path: Path, arch: str, tensors: dict, keys: dict) -> Path:
    w = GGUFWriter(path, arch)
    for k, v in keys.items():
        (w.add_uint32 if isinstance(v, int) else w.add_string)(k, v)
    for name, (data, qtype) in tensors.items():
        w.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _copy(src: Path, dest: Path, add: dict | None = None, drop_tensor: str = "") -> Path:
    """`src` rewritten with keys added (u32) and one tensor left out."""
    from gguf import GGUFReader
    from llamacpp_fixtures import _value

    r = GGUFReader(src)
    w = GGUFWriter(dest, _value(r.fields["general.architecture"]))
    for k, field in r.fields.items():
        if not k.startswith("GGUF.") and k != "general.architecture":
            sub = field.types[1] if len(field.types) > 1 else None
            w.add_key_value(k, _value(field), field.types[0], sub)
    for k, v in (add or {}).items():
        w.add_uint32(k, v)
    for t in r.tensors:
        if t.name != drop_tensor:
            raw = np.asarray(t.data).view(np.uint8)
            w.add_tensor(t.name, raw, raw_shape=raw.shape, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dest


def test_iquant_file_is_one_line(tmp_path):
    iq4 = np.zeros((2, 8, 144), np.uint8)  # 2 experts x 8 rows of 256 elements, IQ4_NL blocks
    path = _write(tmp_path / "k.gguf", "olmoe", {
        "blk.0.ffn_gate_exps.weight": (iq4, Q.IQ4_NL),
    }, {})  # fmt: skip
    with pytest.raises(ModelFileError, match=r"is IQ4_NL, a format pyruntime does not read"):
        open_model_file(path)


def test_missing_key_and_tensor_named(files, tmp_path):
    _, lcpp = files["olmoe", "f32"]
    no_key = to_llamacpp(files["olmoe", "f32"][0], tmp_path / "k.gguf",
                         drop=("olmoe.expert_count",))  # fmt: skip
    with pytest.raises(ModelFileError, match=r"'olmoe.expert_count' is missing$"):
        open_model_file(no_key)
    _copy(lcpp, tmp_path / "t.gguf", drop_tensor="blk.1.ffn_up_exps.weight")
    with pytest.raises(ModelFileError, match=r"tensor 'blk.1.ffn_up_exps.weight' is missing$"):
        open_model_file(tmp_path / "t.gguf")


def _cli(*args: str, env_cache: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYRUNTIME_CACHE": str(env_cache)}
    return subprocess.run([sys.executable, "-m", "pyruntime", *args], capture_output=True,
                          text=True, cwd=REPO, env=env, timeout=300)  # fmt: skip


def test_repack_command(files, tmp_path):
    ours, lcpp = files["granitemoe", "q8_0"]
    out = tmp_path / "out.gguf"
    r = _cli("repack", str(lcpp), "-o", str(out), env_cache=tmp_path / "c")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(out) and "repack: wrote" in r.stderr
    assert detect_layout(open_gguf(out)) == "pyruntime"
    assert oct(out.stat().st_mode & 0o777) == oct(0o666 & ~_umask())
    r = _cli("repack", str(lcpp), "-o", str(out), env_cache=tmp_path / "c")
    assert r.returncode == 1 and r.stderr == f"error: {out} exists; pass --force to overwrite it\n"
    r = _cli("repack", str(ours), env_cache=tmp_path / "c")
    assert r.returncode == 1 and "already in pyruntime's layout" in r.stderr
    assert "Traceback" not in r.stderr
    r = _cli("repack", str(lcpp), "--outtype", "f32", env_cache=tmp_path / "c")
    assert r.returncode == 1 and "--outtype f32 needs -o FILE" in r.stderr  # else it ran as f32
    assert not (tmp_path / "c").exists()
    r = _cli("repack", str(lcpp), env_cache=tmp_path / "c")  # into the cache
    assert r.returncode == 0 and Path(r.stdout.strip()).parent == tmp_path / "c" / "repacked"
    copy = Path(r.stdout.strip())
    r = _cli("repack", str(lcpp), env_cache=tmp_path / "c")
    assert r.returncode == 0 and "already a current copy" in r.stderr
    before = copy.stat().st_ino
    r = _cli("repack", str(lcpp), "--force", env_cache=tmp_path / "c")  # written again
    assert r.returncode == 0 and "repack: wrote" in r.stderr and copy.stat().st_ino != before


def test_repack_outtypes_are_the_converters():
    """`repack --outtype` and convert_hf_to_gguf.py's list the converter's formats, in its order,
    without importing it (for --help)."""
    from pyruntime.cli import repack as repack_command
    from pyruntime.converter.tensors import OUTTYPES

    assert tuple(repack_command.OUTTYPES) == tuple(OUTTYPES)


def test_info_plans_the_repacked_copy(files, tmp_path):
    """info describes a llama.cpp file without repacking it; its GPU plan is the copy's, once
    there is a current one."""
    _, lcpp = files["olmoe", "q8_0"]
    r = _cli("info", str(lcpp), "--gpu-mem", "1G", env_cache=tmp_path / "c")
    assert r.returncode == 0, r.stderr
    assert "layout          : llama.cpp" in r.stdout
    assert "hf architecture : OlmoeForCausalLM" in r.stdout  # llama.cpp's family, not '?'
    ours = open_gguf(files["olmoe", "q8_0"][0]).arch_get("expert_feed_forward_length")
    assert f"expert ffn      : {ours}\n" in r.stdout  # llama.cpp's key for olmoe: not '?'
    assert "gpu plan        : once repacked" in r.stdout
    assert not any((tmp_path / "c" / "repacked").glob("*.gguf"))
    assert _cli("repack", str(lcpp), env_cache=tmp_path / "c").returncode == 0
    r = _cli("info", str(lcpp), "--gpu-mem", "1G", env_cache=tmp_path / "c")
    assert r.returncode == 0 and "the whole model on the GPU" in r.stdout, r.stdout + r.stderr


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def test_errors_of_the_commands_are_one_line(files, tmp_path):
    iq4 = np.zeros((2, 8, 144), np.uint8)  # IQ4_NL blocks: 256 elements a row
    path = _write(tmp_path / "k.gguf", "olmoe", {"blk.0.ffn_up_exps.weight": (iq4, Q.IQ4_NL)}, {})
    for command in ("info", "generate", "repack"):
        args = [command, str(path)] + (["-p", "hi"] if command == "generate" else [])
        r = _cli(*args, env_cache=tmp_path / "c")
        if command == "info":
            assert r.returncode == 0 and "llama.cpp" in r.stdout
            continue
        assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
        assert "IQ4_NL, a format" in r.stderr and "Traceback" not in r.stderr


def test_llamacpp_file_with_our_layout_key_is_one_line(files, tmp_path):
    """A llama.cpp file whose metadata claims our layout (the issue's patched file): one line
    naming what our layout misses, where a decoder once met a layer with no FFN (an
    AttributeError)."""
    from pyruntime.api import Model

    path = _copy(files["olmoe", "f32"][1], tmp_path / "claims-ours.gguf",
                 add={"pyruntime.layout_version": 1})  # fmt: skip
    with pytest.raises(ModelFileError, match=r"'olmoe.expert_feed_forward_length' is missing$"):
        Model(path, device="cpu")
    keys = {"pyruntime.layout_version": 1, "olmoe.expert_feed_forward_length": 32}
    path = _copy(files["olmoe", "f32"][1], tmp_path / "claims-ours-2.gguf", add=keys)
    with pytest.raises(ModelFileError, match=r"tensor 'blk.0.ffn_gate_inp.weight' is not part of"):
        Model(path, device="cpu")


def test_old_split_expert_layout_is_named(tmp_path):
    old = {"blk.0.ffn_gate.0.weight": (np.zeros((4, 32), np.float32), Q.F32)}
    path = _write(tmp_path / "old.gguf", "llama", old, {})
    with pytest.raises(ModelFileError, match=r"holds one expert alone, llama.cpp's layout before"):
        open_model_file(path)


def test_gpt_oss_file_is_refused_in_one_line(tmp_path):
    """A llama.cpp gpt-oss GGUF (experts as ffn_*_exps): one line naming the architecture and
    what the repack supports, no half-written copy."""
    from pyruntime.api import Model

    lcpp = tmp_path / "lcpp.gguf"
    w = GGUFWriter(lcpp, "gpt-oss")
    w.add_block_count(2)
    w.add_tensor("blk.0.ffn_gate_exps.weight", np.zeros((4, 32, 64), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert detect_layout(open_gguf(lcpp)) == "llama.cpp"
    with pytest.raises(ModelFileError) as info:
        Model(lcpp, device="cpu")
    message = str(info.value)
    assert "\n" not in message and "'gpt-oss' is not supported" in message, message
    assert not cached_copy_path(lcpp).exists()
