"""The model's weights as the host holds them: views into the GGUF mmap, read in place.

Weight matrices (attention, routers, shared experts, embeddings, output) stay in the mmap in their
stored format (QuantMatrix); norms and biases (small, always F32) are copied to tensors; a layer's
routed experts are an ExpertStore over the mmap. Every executor starts from this description: the
CPU executor reads it in place, the GPU executor uploads from it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from gguf import GGMLQuantizationType

from pyruntime.errors import ModelFileError
from pyruntime.experts.store import ExpertBias, ExpertHandle, ExpertStore
from pyruntime.gguf.file import GGUFFile
from pyruntime.gguf.quant import QuantMatrix, dequantize, first_broken_mxfp4_block, row_bytes
from pyruntime.model.config import ModelConfig
from pyruntime.model.deltanet import DeltaNetWeights
from pyruntime.model.mla import MLAWeights


@dataclass
class FFNWeights:
    """A dense gated FFN: gate/up [n_ff, n_embd], down [n_embd, n_ff]."""

    gate: QuantMatrix
    up: QuantMatrix
    down: QuantMatrix


@dataclass
class BlockWeights:
    attn_norm: torch.Tensor  # [n_embd]
    # q/k/v/o: None on a Gated DeltaNet layer (qwen35moe), which has `deltanet` instead
    wq: QuantMatrix | None  # [n_head*head_dim, n_embd]
    wk: QuantMatrix | None  # [n_head_kv*head_dim, n_embd]
    wv: QuantMatrix | None  # [n_head_kv*head_dim, n_embd]
    wo: QuantMatrix | None  # [n_embd, n_head*head_dim]
    bq: torch.Tensor | None
    bk: torch.Tensor | None
    bv: torch.Tensor | None
    bo: torch.Tensor | None  # [n_embd] (gpt-oss)
    sinks: torch.Tensor | None  # [n_head] per-head sink logits (gpt-oss)
    q_norm: torch.Tensor | None  # olmoe [n_head*head_dim]; qwen3moe [head_dim]
    k_norm: torch.Tensor | None
    ffn_norm: torch.Tensor  # [n_embd]
    router: QuantMatrix | None  # [n_expert, n_embd] (F32); None for a dense FFN layer
    router_bias: torch.Tensor | None  # [n_expert] (gpt-oss)
    experts: ExpertStore | None
    shared: FFNWeights | None  # shared expert (qwen2moe)
    shared_gate: torch.Tensor | None  # [n_embd]: shared output *= sigmoid(x . shared_gate)
    dense_ffn: FFNWeights | None  # dense FFN layer (qwen mlp_only_layers)
    attn_gate: QuantMatrix | None = None  # [n_head*head_dim, n_embd]: out *= sigmoid(x Wg^T)
    deltanet: DeltaNetWeights | None = None  # a Gated DeltaNet layer's weights (qwen35moe)
    mla: MLAWeights | None = None  # multi-head latent attention (deepseek2); wo is its output


def _load(f: GGUFFile, name: str) -> torch.Tensor:
    """A small F32 tensor (norm, bias, gate vector), copied out of the mmap."""
    t = f.tensor(name)
    return dequantize(t.data, t.qtype, t.shape)


def _matrix(f: GGUFFile, name: str) -> QuantMatrix:
    """A weight matrix, left in the mmap in its stored format."""
    t = f.tensor(name)
    if len(t.shape) != 2:
        raise ModelFileError(f"{f.path}: tensor '{name}' has shape {list(t.shape)}, expected 2-D")
    return QuantMatrix(name, t.qtype, (int(t.shape[0]), int(t.shape[1])), t.data)


def _check_mxfp4(f: GGUFFile, name: str, cfg: ModelConfig) -> None:
    """An MXFP4 expert tensor with a 0xFF (NaN) block scale: one ModelFileError naming the tensor
    and where in it (read once at load: 1 byte in 17 of the tensor)."""
    t = f.tensor(name)
    if t.qtype != GGMLQuantizationType.MXFP4:
        return
    block = first_broken_mxfp4_block(t.data)
    if block is None:
        return
    per_row = row_bytes(t.qtype, cfg.n_embd) // 17
    row, b = divmod(block, per_row)
    expert, rest = divmod(row, cfg.n_ff_exp * 3)
    neuron, part = divmod(rest, 3)
    raise ModelFileError(
        f"{f.path}: tensor '{name}' has a broken MXFP4 block scale (E8M0 0xFF, not a number) in "
        f"expert {expert}, neuron {neuron}, {('gate', 'up', 'down')[part]} row, block {b}; the "
        "file is corrupt: convert the model again"
    )


def _load_opt(f: GGUFFile, name: str) -> torch.Tensor | None:
    return _load(f, name) if f.has_tensor(name) else None


def _load_ffn(f: GGUFFile, prefix: str, suffix: str) -> FFNWeights | None:
    if not f.has_tensor(f"{prefix}.ffn_gate{suffix}.weight"):
        return None
    return FFNWeights(
        gate=_matrix(f, f"{prefix}.ffn_gate{suffix}.weight"),
        up=_matrix(f, f"{prefix}.ffn_up{suffix}.weight"),
        down=_matrix(f, f"{prefix}.ffn_down{suffix}.weight"),
    )


def _load_deltanet(f: GGUFFile, p: str) -> DeltaNetWeights:
    return DeltaNetWeights(
        qkv=_matrix(f, f"{p}.attn_qkv.weight"),
        gate=_matrix(f, f"{p}.attn_gate.weight"),
        beta=_matrix(f, f"{p}.ssm_beta.weight"),
        alpha=_matrix(f, f"{p}.ssm_alpha.weight"),
        conv=_load(f, f"{p}.ssm_conv1d.weight"),
        dt_bias=_load(f, f"{p}.ssm_dt.bias"),
        a=_load(f, f"{p}.ssm_a"),
        norm=_load(f, f"{p}.ssm_norm.weight"),
        out=_matrix(f, f"{p}.ssm_out.weight"),
    )


def _per_head(f: GGUFFile, name: str) -> QuantMatrix:
    """A per-head stack of matrices [H, rows, cols] as one matrix [H rows, cols], in place."""
    t = f.tensor(name)
    H, rows, cols = (int(d) for d in t.shape)
    return QuantMatrix(name, t.qtype, (H * rows, cols), t.data.reshape(H * rows, -1))


def _load_mla(f: GGUFFile, p: str) -> MLAWeights:
    lora = f.has_tensor(f"{p}.attn_q_a.weight")
    return MLAWeights(
        q=None if lora else _matrix(f, f"{p}.attn_q.weight"),
        q_a=_matrix(f, f"{p}.attn_q_a.weight") if lora else None,
        q_a_norm=_load(f, f"{p}.attn_q_a_norm.weight") if lora else None,
        q_b=_matrix(f, f"{p}.attn_q_b.weight") if lora else None,
        kv_a=_matrix(f, f"{p}.attn_kv_a_mqa.weight"),
        kv_a_norm=_load(f, f"{p}.attn_kv_a_norm.weight"),
        k_b=_per_head(f, f"{p}.attn_k_b.weight"),
        v_b=_per_head(f, f"{p}.attn_v_b.weight"),
    )


def _matrix_opt(f: GGUFFile, name: str) -> QuantMatrix | None:
    return _matrix(f, name) if f.has_tensor(name) else None


def _load_block(f: GGUFFile, cfg: ModelConfig, i: int) -> BlockWeights:
    p = f"blk.{i}"
    recurrent = cfg.is_recurrent(i)
    has_experts = f.has_tensor(f"{p}.ffn_gud_exps.weight")
    shared_gate = _load_opt(f, f"{p}.ffn_gate_inp_shexp.weight")
    if has_experts:
        _check_mxfp4(f, f"{p}.ffn_gud_exps.weight", cfg)
    bias = None
    if f.has_tensor(f"{p}.ffn_gu_exps.bias"):
        bias = ExpertBias(_load(f, f"{p}.ffn_gu_exps.bias"), _load(f, f"{p}.ffn_down_exps.bias"))
    return BlockWeights(
        attn_norm=_load(f, f"{p}.attn_norm.weight"),
        wq=_matrix_opt(f, f"{p}.attn_q.weight"),
        wk=_matrix_opt(f, f"{p}.attn_k.weight"),
        wv=_matrix_opt(f, f"{p}.attn_v.weight"),
        wo=_matrix_opt(f, f"{p}.attn_output.weight"),
        bq=_load_opt(f, f"{p}.attn_q.bias"),
        bk=_load_opt(f, f"{p}.attn_k.bias"),
        bv=_load_opt(f, f"{p}.attn_v.bias"),
        bo=_load_opt(f, f"{p}.attn_output.bias"),
        sinks=_load_opt(f, f"{p}.attn_sinks.weight"),
        q_norm=_load_opt(f, f"{p}.attn_q_norm.weight"),
        k_norm=_load_opt(f, f"{p}.attn_k_norm.weight"),
        ffn_norm=_load(f, f"{p}.ffn_norm.weight"),
        router=_matrix(f, f"{p}.ffn_gate_inp.weight") if has_experts else None,
        router_bias=_load_opt(f, f"{p}.ffn_gate_inp.bias"),
        experts=ExpertStore.from_tensor(
            f.tensor(f"{p}.ffn_gud_exps.weight"),
            cfg.n_expert,
            cfg.n_ff_exp,
            cfg.n_embd,
            i,
            bias,
            (cfg.swiglu_alpha, cfg.swiglu_limit),
        )
        if has_experts
        else None,
        shared=_load_ffn(f, p, "_shexp"),
        shared_gate=None if shared_gate is None else shared_gate.reshape(-1),
        dense_ffn=None if has_experts else _load_ffn(f, p, ""),
        attn_gate=None if recurrent else _matrix_opt(f, f"{p}.attn_gate.weight"),
        deltanet=_load_deltanet(f, p) if recurrent else None,
        mla=_load_mla(f, p) if cfg.is_mla else None,
    )


@dataclass
class HostWeights:
    """Every tensor of the model, as BlockWeights per layer plus the embedding and the output."""

    token_embd: QuantMatrix  # [n_vocab, n_embd]
    output_norm: torch.Tensor  # [n_embd]
    output: QuantMatrix  # [n_vocab, n_embd] (token_embd itself when the model ties them)
    blocks: list[BlockWeights]

    @classmethod
    def from_gguf(cls, f: GGUFFile, cfg: ModelConfig) -> HostWeights:
        """`cfg` from ModelConfig.from_gguf, which has checked every tensor's name, shape and
        type against the layout, so nothing here reads a tensor of the wrong size."""
        token_embd = _matrix(f, "token_embd.weight")
        tied = not f.has_tensor("output.weight")
        return cls(
            token_embd=token_embd,
            output_norm=_load(f, "output_norm.weight"),
            output=token_embd if tied else _matrix(f, "output.weight"),
            blocks=[_load_block(f, cfg, i) for i in range(cfg.n_layer)],
        )

    def expert(self, layer: int, e: int) -> ExpertHandle:
        """The handle of routed expert e of `layer` (a MoE layer)."""
        store = self.blocks[layer].experts
        if store is None:
            raise IndexError(f"layer {layer} has a dense FFN, no routed experts")
        return store.handle(e)
