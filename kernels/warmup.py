"""Launch every kernel variant an engine can use before it serves, so the JIT compiles none mid-serving.

The kernels specialize only on values fixed for an engine (model shape, dtype, block size, tile
configuration; see each kernel module's docstring); step-dependent counts are not specialized and the
decode split count is one of `SPLIT_CHOICES`. One launch per variant at the engine's model configuration
therefore covers every later launch, provided the dummy tensors have the engine's dtypes: q, k, v are
views into one fused qkv output of the model dtype, the rotary cache is fp32, block tables, lengths and
cu_seqlens int32, positions and slots `index_dtype` (int32, as the engine stages them). The token bitmask
(kernels/token_bitmask.py) is applied to fp32 logits of the engine's vocabulary size, its `rows` either
int32 or int64 (the contract takes both), so both variants are built. An int8-quantized engine
(`EngineShape.quantization`) also builds the W8A16 GEMM at its projections' sizes (`int8_gemm_calls`); a LoRA
engine (`EngineShape.lora_rank`) the LoRA shrink / expand at each target module's sizes (`lora_calls`; the decode
graphs' per-row form is also built by their capture); a mixture-of-experts engine (`EngineShape.num_experts`) the
fused MoE kernel once per tile configuration it can pick (`moe_calls`).
The attention kernels are launched once per attention kind the layers use (`EngineShape.windows`: full and / or
a sliding window; each with the engine's soft cap and its sinks (`EngineShape.sinks`), if any), the MLP's
activation is the engine's (`EngineShape.activation`), and a model that norms q and k per head
(`EngineShape.qk_norm`) also builds RMSNorm at head_dim. `tritium.kernels.compile_check` compiles exactly these
calls for sm_80/sm_90.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from tritium.kernels.decode_attention import SPLIT_CHOICES
from tritium.kernels.interface import KernelOps
from tritium.kernels.moe_configs import config_row_counts
from tritium.kernels.tiles import lora_row_splits


@dataclass
class OpCall:
    op: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class EngineShape:
    """What an engine's kernel launches specialize on: its model's shape, dtype, block size, the width of its
    block tables, its device, the dtype of the positions and slots it passes, its vocabulary size (the
    logits' width; the default is SmolLM2's, the default model's), and the attention, MLP and norm variants its
    layers use."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    rotary_dim: int
    block_size: int
    max_blocks_per_seq: int
    dtype: torch.dtype
    device: torch.device | str = "cpu"
    index_dtype: torch.dtype = torch.int32
    vocab_size: int = 49152
    quantization: str | None = None  # "int8": the W8A16 GEMM of every linear layer and the logits head
    lora_rank: int | None = None  # max_lora_rank of a LoRA engine: the shrink / expand kernels
    windows: tuple[int | None, ...] = (None,)  # each layer's sliding window, once each (None: full attention)
    softcap: float | None = None  # the attention logits' soft cap (every layer's)
    activation: str = "silu_and_mul"  # the MLP's op: "silu_and_mul" or "gelu_tanh_and_mul"
    qk_norm: bool = False  # RMSNorm over each head of q and k (rows of head_dim)
    num_experts: int = 0  # a mixture-of-experts model's experts per layer (0: a dense MLP): fused_moe
    moe_top_k: int = 0  # experts per token
    moe_intermediate: int = 0  # each expert's intermediate size
    moe_activation: str = "silu"  # fused_moe's activation: "silu" or "swiglu_oai"
    moe_bias: bool = False  # the experts' projections have biases (gpt-oss)
    sinks: bool = False  # every layer's attention has sink logits (gpt-oss): the attention kernels' sink variants


def warmup_calls(shape: EngineShape, split_choices: Sequence[int | None] = SPLIT_CHOICES) -> list[OpCall]:
    """The op calls `warm_up` makes: each op once (rms_norm with and without residual, and at head_dim for a
    qk-norm model; apply_token_bitmask with int32 and int64 rows; the attention ops once per entry of
    `shape.windows`, decode_attention once per entry of `split_choices` for each, None meaning the automatic
    choice), on small dummy tensors."""
    num_heads, num_kv_heads, head_dim, dtype = shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.dtype
    tokens = 2
    dev = torch.device(shape.device)
    x = torch.zeros(tokens, shape.hidden_size, dtype=dtype, device=dev)
    weight = torch.ones(shape.hidden_size, dtype=dtype, device=dev)
    qkv = torch.zeros(tokens, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype, device=dev)
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q = qkv[:, :q_size].view(tokens, num_heads, head_dim)
    k = qkv[:, q_size : q_size + kv_size].view(tokens, num_kv_heads, head_dim)
    v = qkv[:, q_size + kv_size :].view(tokens, num_kv_heads, head_dim)
    positions = torch.arange(tokens, dtype=shape.index_dtype, device=dev)
    cos_sin_cache = torch.zeros(tokens, shape.rotary_dim, dtype=torch.float32, device=dev)
    key_cache = torch.zeros(2, shape.block_size, num_kv_heads, head_dim, dtype=dtype, device=dev)
    value_cache = torch.zeros_like(key_cache)
    slot_mapping = torch.arange(tokens, dtype=shape.index_dtype, device=dev)
    block_tables = torch.zeros(1, max(1, shape.max_blocks_per_seq), dtype=torch.int32, device=dev)
    cu_seqlens_q = torch.tensor([0, tokens], dtype=torch.int32, device=dev)
    seq_lens = torch.tensor([tokens], dtype=torch.int32, device=dev)
    scale = head_dim**-0.5
    logits = torch.zeros(tokens, shape.vocab_size, dtype=torch.float32, device=dev)
    bitmask = torch.full((1, -(-shape.vocab_size // 32)), -1, dtype=torch.int32, device=dev)  # all allowed
    sinks = torch.zeros(num_heads, dtype=torch.float32, device=dev) if shape.sinks else None
    attention = [{"sliding_window": window, "softcap": shape.softcap, "sinks": sinks} for window in shape.windows]
    calls = [
        OpCall("rms_norm", (x, weight, 1e-6)),
        OpCall("rms_norm", (x, weight, 1e-6, x.clone())),
        OpCall("rotary_embedding", (q, k, positions, cos_sin_cache)),
        OpCall("store_kv", (k, v, key_cache, value_cache, slot_mapping)),
        *(OpCall("prefill_attention", (q, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, scale,
                                       tokens), kinds) for kinds in attention),
        OpCall(shape.activation, (torch.zeros(tokens, 2 * shape.intermediate_size, dtype=dtype, device=dev),)),
        *(OpCall("apply_token_bitmask", (logits, bitmask, torch.zeros(1, dtype=rows_dtype, device=dev)))
          for rows_dtype in (torch.int32, torch.int64)),
    ]
    if shape.qk_norm:
        calls.append(OpCall("rms_norm", (torch.zeros(tokens * num_heads, head_dim, dtype=dtype, device=dev),
                                         torch.ones(head_dim, dtype=dtype, device=dev), 1e-6)))
    if shape.quantization == "int8":
        calls += int8_gemm_calls(shape)
    if shape.lora_rank is not None:
        calls += lora_calls(shape, shape.lora_rank)
    if shape.num_experts:
        calls += moe_calls(shape)
    for kinds in attention:
        for splits in split_choices:
            kwargs = kinds if splits is None else {**kinds, "num_splits": splits}
            calls.append(OpCall("decode_attention", (q[:1], key_cache, value_cache, block_tables, seq_lens[:1],
                                                     scale), kwargs))
    return calls


def warm_up(ops: KernelOps, shape: EngineShape) -> int:
    """Run every kernel variant `ops` (an ops module: `triton_ops` or `reference`) can use at this engine
    shape once; returns the number of op calls made. With `reference` these are cheap torch calls; with
    `triton_ops` on CUDA each compiles (or loads from Triton's cache) its variant."""
    takes_splits = "num_splits" in inspect.signature(ops.decode_attention).parameters
    calls = warmup_calls(shape, SPLIT_CHOICES if takes_splits else (None,))
    for call in calls:
        getattr(ops, call.op)(*call.args, **call.kwargs)
    if torch.device(shape.device).type == "cuda":
        torch.cuda.synchronize(shape.device)
    return len(calls)


def _same_specialization(size: int) -> int:
    """A size no larger than 256 + 15 that Triton's JIT specializes like `size` (divisible by 16 or not, 1 or not):
    the dummy int8 weights stay small even for a 128k-token vocabulary."""
    return size if size <= 256 else 256 + size % 16


def int8_gemm_calls(shape: EngineShape) -> list[OpCall]:
    """int8_gemm at each quantized projection's (N, K) (fused QKV, output, fused gate/up, down, logits head), with
    a row count per tile configuration of kernels/int8_gemm.py (CONFIG_ROWS)."""
    from tritium.kernels.int8_gemm import CONFIG_ROWS  # triton: imported when an int8 engine warms up
    dev = torch.device(shape.device)
    q_size, kv_size = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    h, inter = shape.hidden_size, shape.intermediate_size
    calls = []
    for n, k in ((q_size + 2 * kv_size, h), (h, q_size), (2 * inter, h), (h, inter), (shape.vocab_size, h)):
        n, k = _same_specialization(n), _same_specialization(k)
        weight = torch.zeros(n, k, dtype=torch.int8, device=dev)
        scale = torch.ones(n, dtype=torch.float32, device=dev)
        calls += [OpCall("int8_gemm", (torch.zeros(rows, k, dtype=shape.dtype, device=dev), weight, scale))
                  for rows in CONFIG_ROWS]
    return calls


def lora_calls(shape: EngineShape, max_rank: int, slots: int = 2) -> list[OpCall]:
    """The LoRA shrink and expand (segmented and per row) of each fused projection (q/k/v, o, gate/up, down: its
    modules in one launch each, as backend/lora/weights.py stacks them), with stacks of `max_rank` over `slots`
    slots, int32 indices (the staging buffer's) and the engine's K splits."""
    dev = torch.device(shape.device)
    q_size, kv_size = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    h, inter = shape.hidden_size, shape.intermediate_size
    # (in, the modules' column bounds in the fused output)
    projections = [(h, (0, q_size, q_size + kv_size, q_size + 2 * kv_size)), (q_size, (0, h)),
                   (h, (0, inter, 2 * inter)), (inter, (0, h))]
    rows = torch.zeros(2, dtype=torch.int32, device=dev)
    starts = torch.tensor([0, 2], dtype=torch.int32, device=dev)
    seg_slots = torch.zeros(1, dtype=torch.int32, device=dev)
    scaling = torch.ones(slots, dtype=torch.float32, device=dev)
    calls = []
    for d_in, bounds in projections:
        modules, width = len(bounds) - 1, bounds[-1]
        a = torch.zeros(slots, modules * max_rank, d_in, dtype=shape.dtype, device=dev)
        b = torch.zeros(slots, width, max_rank, dtype=shape.dtype, device=dev)
        x = torch.zeros(2, d_in, dtype=shape.dtype, device=dev)
        y = torch.zeros(2, width, dtype=shape.dtype, device=dev)
        buffer = torch.zeros(2, modules * max_rank, dtype=shape.dtype, device=dev)
        partials = torch.zeros(lora_row_splits(d_in), 2, modules * max_rank, dtype=torch.float32, device=dev)
        calls += [OpCall("lora_shrink", (x, a, scaling, rows, starts, seg_slots, buffer, 2, modules)),
                  OpCall("lora_expand", (buffer, b, rows, starts, seg_slots, y, 2, bounds)),
                  OpCall("lora_shrink_rows", (x, a, scaling, rows, partials, modules)),
                  OpCall("lora_expand_rows", (partials, b, rows, y, bounds))]
    return calls


def moe_calls(shape: EngineShape) -> list[OpCall]:
    """fused_moe at the model's expert sizes (kept small by `_same_specialization`), activation and biases, once
    per tile configuration kernels/moe_configs.py can pick: at a token count giving each configuration's rows per
    expert (the smallest t with cdiv(t * K, E) = rows)."""
    dev = torch.device(shape.device)
    capability = torch.cuda.get_device_capability(dev) if dev.type == "cuda" else None
    experts, top_k = shape.num_experts, shape.moe_top_k
    h, inter = _same_specialization(shape.hidden_size), _same_specialization(shape.moe_intermediate)
    w13 = torch.zeros(experts, 2 * inter, h, dtype=shape.dtype, device=dev)
    w2 = torch.zeros(experts, h, inter, dtype=shape.dtype, device=dev)
    biases = {"w13_bias": torch.zeros(experts, 2 * inter, dtype=shape.dtype, device=dev),
              "w2_bias": torch.zeros(experts, h, dtype=shape.dtype, device=dev)} if shape.moe_bias else {}
    calls = []
    for rows in config_row_counts(capability, shape.dtype):
        tokens = (rows - 1) * experts // top_k + 1
        topk_ids = (torch.arange(tokens * top_k, device=dev) % experts).view(tokens, top_k).to(torch.int32)
        topk_weights = torch.full((tokens, top_k), 1.0 / top_k, dtype=torch.float32, device=dev)
        hidden = torch.zeros(tokens, h, dtype=shape.dtype, device=dev)
        calls.append(OpCall("fused_moe", (hidden, w13, w2, topk_weights, topk_ids),
                            {"activation": shape.moe_activation, **biases}))
    return calls
