"""Fused mixture-of-experts MLP: each token's top-k experts' gated MLPs, weighted and summed (the contract:
`KernelOps.fused_moe` in kernels/interface.py; the torch reference: `reference.fused_moe`).

Three steps, no host sync:
1. Alignment (kernels/moe_align.py): the T * K (token, k) pairs sorted by expert, each expert's group padded to a
   multiple of BLOCK_M, so every block of BLOCK_M rows belongs to one expert; the grid is sized for the most
   padded rows there can be and blocks past the real count exit at once.
2. Gate/up GEMM (`moe_gate_up_kernel`): a program takes one row block and BLOCK_N intermediate columns, gathers its
   rows of `hidden`, and accumulates the gate and the up columns of its expert's `w13` in two fp32 tiles; the
   activation (silu or swiglu_oai, a constexpr switch) runs in the epilogue, so only `[T * K, I]` activations in
   hidden's dtype reach memory (the reference rounds there too).
3. Down GEMM (`moe_down_kernel`): the same row blocks times `w2[e]`, plus the bias, times the pair's routing
   weight, written in fp32 to the pair's row of a `[T, K, H]` buffer; then a sum over K (torch) and the cast to
   hidden's dtype. A sum rather than atomic adds into `[T, H]`: the order of the additions is fixed, so the
   result does not depend on scheduling or on the batch, and the buffer needs no zeroing; the extra traffic
   (T * K * H fp32 written and read once) is small next to the expert weights the GEMMs read.

Programs are ordered GROUP_M row blocks per column sweep, so neighbouring programs share an expert's weight
columns in L2. fp32 accumulation; fp32 `tl.dot` in IEEE precision (it matches the reference).

Specialization: the pair count and the row-block count change every step and are `do_not_specialize`; the
sizes, strides, top-k, activation, bias switch and tiles are fixed per model and engine. Tiles come from
kernels/moe_configs.py by rows per expert (two configurations by default: decode- and prefill-sized), and the
warm-up launches each. `python -m tritium.kernels.compile_check --kernel fused_moe` builds them for sm_80/sm_90.
"""

from __future__ import annotations

import torch
import triton

from tritium.kernels.interface import MOE_ACTIVATIONS
from tritium.kernels.jit.fused_moe import moe_down_kernel, moe_gate_up_kernel
from tritium.kernels.moe_align import moe_align_block_size
from tritium.kernels.moe_configs import MoeConfig, moe_config, rows_per_expert


def _check(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
           topk_ids: torch.Tensor, activation: str, w13_bias: torch.Tensor | None,
           w2_bias: torch.Tensor | None) -> None:
    if activation not in MOE_ACTIVATIONS:
        raise ValueError(f"unsupported MoE activation {activation!r} (supported: {', '.join(MOE_ACTIVATIONS)})")
    num_experts, two_inter, hidden_size = w13.shape
    shapes_ok = (hidden.dim() == 2 and hidden.shape[1] == hidden_size and two_inter % 2 == 0
                 and w2.shape == (num_experts, hidden_size, two_inter // 2)
                 and topk_ids.dim() == 2 and topk_ids.shape[0] == hidden.shape[0]
                 and topk_weights.shape == topk_ids.shape
                 and (w13_bias is None or w13_bias.shape == (num_experts, two_inter))
                 and (w2_bias is None or w2_bias.shape == (num_experts, hidden_size)))
    if not shapes_ok:
        raise ValueError(f"fused_moe: hidden {tuple(hidden.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)}, "
                         f"topk_ids {tuple(topk_ids.shape)}, topk_weights {tuple(topk_weights.shape)} mismatch")


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def fused_moe(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, activation: str = "silu", w13_bias: torch.Tensor | None = None,
              w2_bias: torch.Tensor | None = None, tiles: str = "auto",
              config: MoeConfig | None = None) -> torch.Tensor:
    """Same contract as `reference.fused_moe`. `tiles` picks the launch configuration (kernels/tiles.py),
    `config` overrides it (the MoE sweep)."""
    _check(hidden, w13, w2, topk_weights, topk_ids, activation, w13_bias, w2_bias)
    num_tokens, top_k = topk_ids.shape
    num_experts, two_inter, hidden_size = w13.shape
    inter = two_inter // 2
    if num_tokens == 0:
        return torch.empty((0, hidden_size), dtype=hidden.dtype, device=hidden.device)
    hidden, w13, w2 = _last_dim_contiguous(hidden), _last_dim_contiguous(w13), _last_dim_contiguous(w2)
    w13_bias = None if w13_bias is None else _last_dim_contiguous(w13_bias)
    w2_bias = None if w2_bias is None else _last_dim_contiguous(w2_bias)
    weights = topk_weights.reshape(-1).contiguous()
    cfg = config or moe_config(rows_per_expert(num_tokens, top_k, num_experts), hidden.dtype, tiles, hidden.device)
    sorted_ids, expert_ids, num_post_padded = moe_align_block_size(topk_ids, cfg.block_m, num_experts)
    num_pairs = num_tokens * top_k
    num_blocks_m = expert_ids.shape[0]
    act = torch.empty((num_pairs, inter), dtype=hidden.dtype, device=hidden.device)
    out = torch.empty((num_tokens, top_k, hidden_size), dtype=torch.float32, device=hidden.device)
    precision = "ieee" if hidden.dtype == torch.float32 else "tf32"
    launch = {"BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n, "BLOCK_K": cfg.block_k, "GROUP_M": cfg.group_m,
              "DOT_PRECISION": precision, "num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    b13 = w13_bias if w13_bias is not None else w13  # any pointer: never read without HAS_BIAS
    moe_gate_up_kernel[(num_blocks_m * triton.cdiv(inter, cfg.block_n),)](
        hidden, w13, b13, act, sorted_ids, expert_ids, num_post_padded,
        num_pairs, num_blocks_m, inter, hidden_size, hidden.stride(0), w13.stride(0), w13.stride(1),
        b13.stride(0), act.stride(0),
        TOP_K=top_k, ACTIVATION=activation, HAS_BIAS=w13_bias is not None, **launch,
    )
    b2 = w2_bias if w2_bias is not None else w2
    moe_down_kernel[(num_blocks_m * triton.cdiv(hidden_size, cfg.block_n),)](
        act, w2, b2, weights, out, sorted_ids, expert_ids, num_post_padded,
        num_pairs, num_blocks_m, hidden_size, inter, act.stride(0), w2.stride(0), w2.stride(1),
        b2.stride(0), hidden_size,
        HAS_BIAS=w2_bias is not None, **launch,
    )
    return (out[:, 0] if top_k == 1 else out.sum(dim=1)).to(hidden.dtype)
