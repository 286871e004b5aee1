"""What a model needs in GPU memory, part by part, and how a budget is spent on it.

`DeviceBytes` counts a model's device bytes as the GPU executor uploads them
(pyruntime.gpu.weights): the dense weights (embeddings, attention, norms, routers, shared
experts, dense FFN layers, lm_head), the routed experts, the KV cache at a context size, and
working memory. `plan_budget` spends a budget on them: the whole model when it fits; else the
dense part and the KV cache, and the rest as expert slots (each holds one routed expert of any
layer, in the kernels' format: pyruntime.offload.slots) for the hybrid executor, whose dense
part leaves out an untied token embedding (it stays in host memory:
pyruntime.offload.embedding; a tied one is the lm_head, on the GPU). A budget below the dense
part is a DeviceMemoryError saying how much is needed.

No torch.cuda and no Triton here: `pyruntime info --gpu-mem 8G` prints a plan on any machine.
"""

from __future__ import annotations

from dataclasses import dataclass

from gguf import GGMLQuantizationType

from pyruntime.errors import DeviceMemoryError
from pyruntime.gguf.file import GGUFFile
from pyruntime.kernels.expert_layouts import REPACKED, row_bytes
from pyruntime.model.config import ModelConfig

Q = GGMLQuantizationType
EXPERTS_SUFFIX = "ffn_gud_exps.weight"
# Layer tensors the GPU keeps in the activation dtype whatever their GGUF type (the attention
# biases; MLA's absorbed k_b and v_b), and matrices it keeps float32 (the router, DeltaNet's
# conv, the shared-expert gate, the routed experts' biases). pyruntime.gpu.weights.upload_block.
QKV_BIASES = ("attn_q.bias", "attn_k.bias", "attn_v.bias")
ACTIVATION_DTYPE_TENSORS = ("attn_output.bias", "attn_k_b.weight", "attn_v_b.weight")
FLOAT32_MATRICES = (
    "ffn_gate_inp.weight", "ssm_conv1d.weight", "ffn_gate_inp_shexp.weight", "ffn_gu_exps.bias",
    "ffn_down_exps.bias",
)  # fmt: skip
# Weights a conversion at load handles at once (pyruntime.gpu.weights: a float cast, a block
# format dequantized to f32, Q4_0 -> Q8_0): 2 Mi weights, 8 MiB in f32.
LOAD_CHUNK_ELEMENTS = 1 << 21
# The transients of converting one such chunk, at most this many bytes a weight: the stored
# bytes of two chunks on the device, the decoders' integer and f32 intermediates (Q6_K's take
# the most, ~32; tests/test_offload_plan.py measures every format against this bound).
LOAD_BYTES_PER_ELEMENT = 40
# Activations and kernel workspaces (prefill activations of a few hundred tokens, the grouped
# GEMMs' buffers, a layer's q, k, v stacked at load) plus the transients of a chunk converted
# at load.
WORK_BYTES = (256 << 20) + LOAD_CHUNK_ELEMENTS * LOAD_BYTES_PER_ELEMENT
# GGUF block formats the kernels read repacked (kernels.expert_layouts.REPACKED): staged through
# a device buffer and repacked there, so they need that buffer beside the slots.
REPACKED_FORMATS = tuple(REPACKED)


def gib(n: float) -> str:
    """Bytes for a message: GiB with two decimals, or MiB under 1 GiB."""
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def activation_itemsize(attn_q_type: Q) -> int:
    """Bytes per element of the GPU's float weights and KV cache: float32 for an F32 GGUF, else
    bfloat16 (the rule of pyruntime.gpu.weights.dense_dtype_for, which a test holds equal)."""
    return 4 if attn_q_type == Q.F32 else 2


@dataclass(frozen=True)
class DeviceBytes:
    """A model's GPU memory by part, in bytes."""

    dense: int  # every weight but the routed experts, as uploaded
    experts: int  # every routed expert, in its GGUF format (repacking keeps the size)
    kv: int  # the KV cache at n_ctx tokens
    work: int  # WORK_BYTES: activations, workspaces, a chunk converted at load
    expert_bytes: int  # one routed expert (0: the model has none)
    n_experts: int  # routed experts of all layers
    expert_format: str  # their format's kernel name ("q8_0", "f32", ...; "" without experts)
    n_expert_used: int
    kv_form: str = ""  # what the KV cache holds, when not keys and values (for `info`)
    # an untied token_embd's share of `dense`, which the hybrid leaves in host memory (0: tied,
    # the lm_head's weights, on the GPU in either placement)
    embedding: int = 0

    @property
    def whole(self) -> int:
        """The whole model on the GPU."""
        return self.dense + self.experts + self.kv + self.work

    @property
    def hybrid_dense(self) -> int:
        """The dense weights the hybrid puts on the GPU."""
        return self.dense - self.embedding

    @property
    def fixed(self) -> int:
        """What the hybrid keeps on the GPU besides its expert slots."""
        return self.hybrid_dense + self.kv + self.work


def device_bytes(f: GGUFFile, cfg: ModelConfig, n_ctx: int) -> DeviceBytes:
    """A model's GPU memory at a context of n_ctx tokens, by part (module doc)."""
    first = "blk.0.attn_qkv.weight" if cfg.is_recurrent(0) else "blk.0.attn_q.weight"
    if cfg.is_mla:
        first = "blk.0.attn_kv_a_mqa.weight"
    itemsize = activation_itemsize(f.tensor(first).qtype)
    dense = experts = n_experts = expert_bytes = 0
    biased = set()  # layers with attention biases (q, k, v stacked, a missing one zeros)
    fmt = ""
    for t in f.tensors.values():
        if t.name.endswith(EXPERTS_SUFFIX):
            fmt = t.qtype.name.lower()  # "q8_0", "q4_k": gguf.quant.FORMAT_NAMES' names
            expert_bytes = _device_expert_bytes(t.n_bytes // t.shape[0], fmt, cfg.n_embd)
            experts += expert_bytes * t.shape[0]
            n_experts += t.shape[0]
        elif t.name.endswith(QKV_BIASES):
            biased.add(t.name.split(".")[1])
        else:
            dense += _dense_tensor_bytes(t, itemsize)
    dense += len(biased) * (cfg.n_head + 2 * cfg.n_head_kv) * cfg.head_dim * itemsize
    tied = "output.weight" not in f.tensors  # pyruntime.model.weights.HostWeights
    embedding = 0 if tied else _dense_tensor_bytes(f.tensor("token_embd.weight"), itemsize)
    n_kv_layers = cfg.n_layer - sum(cfg.recurrent_layers)  # DeltaNet layers keep no K/V
    planes = 1 if cfg.is_mla else 2  # MLA: one latent serves as key and value
    kv = n_kv_layers * planes * cfg.n_head_kv * n_ctx * cfg.head_dim * itemsize
    if n_kv_layers < cfg.n_layer:  # their conv and ssm states (f32), one per sequence
        per_layer = cfg.ssm_conv_channels * (cfg.ssm_conv_kernel - 1)
        per_layer += cfg.ssm_n_v_heads * cfg.ssm_head_k_dim * cfg.ssm_head_v_dim
        kv += (cfg.n_layer - n_kv_layers) * per_layer * 4
    return DeviceBytes(
        dense=dense, experts=experts, kv=kv, work=WORK_BYTES,
        expert_bytes=expert_bytes, n_experts=n_experts, expert_format=fmt,
        n_expert_used=cfg.n_expert_used, kv_form=_kv_form(cfg), embedding=embedding,
    )  # fmt: skip


def _dense_tensor_bytes(t, itemsize: int) -> int:
    """A dense tensor's device bytes as pyruntime.gpu.weights uploads it: matrices as Q8_0 (a
    Q8_0 or Q4_0 GGUF tensor) or in the activation dtype; vectors, the router and the tensors
    upload_block keeps float32 in float32; the attention biases and MLA's k_b / v_b in the
    activation dtype."""
    part = t.name.split(".", 2)[2] if t.name.startswith("blk.") else t.name
    if part in ACTIVATION_DTYPE_TENSORS:
        return t.n_elements * itemsize
    if len(t.shape) == 1 or part in FLOAT32_MATRICES:
        return t.n_elements * 4
    if t.qtype in (Q.Q8_0, Q.Q4_0):
        return t.n_elements // 32 * 34  # q int8 + d f16 per 32 weights (Q4_0 repacked)
    return t.n_elements * itemsize


def _kv_form(cfg: ModelConfig) -> str:
    """What a layer's cache keeps per token, where it is not keys and values."""
    if cfg.is_mla:
        return (f"a latent of {cfg.mla_kv_rank} and a rope key of {cfg.rope_dim} values per token "
                "and layer")  # fmt: skip
    return ""


def _device_expert_bytes(gguf_bytes: int, fmt: str, n_embd: int) -> int:
    """One expert's bytes on the device: its GGUF bytes, or its repacked rows' (mxfp4r pads
    each row to 16 bytes: kernels.expert_layouts.ROW_ALIGN)."""
    if fmt not in REPACKED:
        return gguf_bytes
    rows = gguf_bytes // row_bytes(fmt, n_embd)
    return rows * row_bytes(REPACKED[fmt], n_embd)


@dataclass(frozen=True)
class OffloadPlan:
    """A budget spent on a model: the whole model, or the hybrid's fixed part and its slots."""

    budget: int
    need: DeviceBytes
    n_ctx: int
    slots: int  # expert slots of the hybrid (need.n_experts when the whole model fits)
    staging_buffer: int  # experts' worth of device buffer where staged experts are repacked

    @property
    def whole_model(self) -> bool:
        return self.budget >= self.need.whole

    @property
    def slot_bytes(self) -> int:
        return self.slots * self.need.expert_bytes

    @property
    def resident_share(self) -> float:
        """The share of all routed experts a GPU slot can hold at once."""
        n = self.need.n_experts
        return 1.0 if self.whole_model or n == 0 else self.slots / n

    def summary(self, device: str) -> str:
        """One line on what sits where, for stderr when a model loads hybrid."""
        need = self.need
        embedding = " (the token embedding in host memory)" if need.embedding else ""
        return (f"hybrid on {device}: dense weights{embedding} and KV cache on the GPU, "
                f"{self.slots} of {need.n_experts} routed experts fit its "
                f"{gib(self.slot_bytes)} of expert slots ({100 * self.resident_share:.1f}%), "
                "all at home in host memory")  # fmt: skip

    def rows(self) -> list[tuple[str, str]]:
        """(what, how much) lines for `pyruntime info`."""
        need = self.need
        whole = self.whole_model
        if not need.embedding:
            embedding = "on the GPU (tied: the lm_head's weights)"
        elif whole:
            embedding = f"{gib(need.embedding)} on the GPU (in the dense weights)"
        else:
            embedding = f"{gib(need.embedding)} in host memory (the host looks up its rows)"
        rows = [
            ("gpu budget", gib(self.budget)),
            ("dense weights", f"{gib(need.dense if whole else need.hybrid_dense)} (GPU)"),
            ("token embedding", embedding),
            (
                f"KV cache ({self.n_ctx} tokens)",
                f"{gib(need.kv)} (GPU" + (f"; {need.kv_form})" if need.kv_form else ")"),
            ),
            ("working memory", f"{gib(need.work)} (GPU)"),
            (
                "routed experts",
                f"{need.n_experts} x {need.expert_bytes:,} bytes = "
                f"{gib(need.experts)} ({need.expert_format})",
            ),  # fmt: skip
        ]
        if whole:
            rows.append(("placement", f"the whole model on the GPU ({gib(need.whole)})"))
            return rows
        rows += [
            ("placement", "hybrid: dense weights and KV cache on the GPU, routed experts "
                          + ("and the token embedding " if need.embedding else "")
                          + "in host memory, the rest of the budget as GPU expert slots"),
            ("expert slots", f"{self.slots} ({gib(self.slot_bytes)}"
                             + (f", + {self.staging_buffer} experts' staging buffer"
                                if self.staging_buffer else "") + ")"),
            ("experts resident", f"{100 * self.resident_share:.1f}% of all routed experts"),
        ]  # fmt: skip
        return rows


def plan_budget(need: DeviceBytes, budget: int, n_ctx: int, source: str = "") -> OffloadPlan:
    """Spend `budget` bytes: the whole model if it fits, else the fixed part and as many expert
    slots as the rest holds. DeviceMemoryError when the budget is below the fixed part, or the
    model has no routed experts to keep off the GPU. source: where the budget came from, for
    the message (e.g. "1.2 GiB is free on <GPU>, less a 512 MiB margin")."""
    if budget >= need.whole:
        return OffloadPlan(budget, need, n_ctx, need.n_experts, 0)
    whose = f"the budget is {gib(budget)}" + (f" ({source})" if source else "")
    if need.n_experts == 0:
        raise DeviceMemoryError(
            f"the model has no routed experts to keep in host memory, and it needs "
            f"{gib(need.whole)} of GPU memory with a {n_ctx}-token KV cache; {whose}: use "
            "--device cpu, or a smaller --ctx-size"
        )
    if budget < need.fixed:
        raise DeviceMemoryError(
            f"the dense weights ({gib(need.hybrid_dense)}), a {n_ctx}-token KV cache "
            f"({gib(need.kv)}) "
            f"and working memory ({gib(need.work)}) need {gib(need.fixed)} of GPU memory; "
            f"{whose}: raise --gpu-mem, lower --ctx-size, or use --device cpu"
        )
    fit = (budget - need.fixed) // need.expert_bytes
    staging = 0
    if need.expert_format in REPACKED_FORMATS:
        # A staging buffer of up to k experts beside the slots (half the room at most); fewer
        # than two experts' room leaves no useful slot.
        staging = 0 if fit < 2 else min(need.n_expert_used, fit // 2)
        fit = fit - staging if staging else 0
    # An embedding left in host memory can make room for every expert below need.whole.
    return OffloadPlan(budget, need, n_ctx, int(min(fit, need.n_experts)), staging)
