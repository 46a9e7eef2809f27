"""Paged decode attention, flash-decoding style.

One query token per sequence. The context is cut into `num_splits` segments handled by separate
programs (so a few long sequences still fill the GPU); each writes a partial output and its
log-sum-exp, and a second kernel merges the segments. The query heads sharing one KV head are
processed together, padded to 16 rows so `tl.dot` has a legal shape. The @triton.jit bodies are in
kernels/jit/decode_attention.py.

Specialization, so that an engine compiles every variant before serving (kernels/warmup.py) and none
while serving: the ints that change from step to step are `do_not_specialize` (num_splits follows
the batch size and the block-table width; stride_bt is that width; min_keys_per_split and num_heads gain
nothing from it). The step's metadata pointers (block tables, lengths) may be views at any offset of a
staging buffer, so their alignment is not specialized either (they are read by gathers and scalar loads).
The q, cache and output pointers (fresh buffers, and q rows starting at multiples of head_dim) and the
q/out/cache strides (multiples of head_dim, fixed for an engine) keep the JIT's divisible-by-16
specialization, which gives vector loads and stores. The split count is always one of SPLIT_CHOICES, so
the reduce kernel's SPLITS constexpr takes only those values (a `num_splits` override outside them
compiles a variant of its own).

The split count aims at two waves of programs on the device (its multiprocessor count, read from the
device); the key tile, warps and stages come from the per-architecture table in kernels/decode_configs.py.

Sliding windows and soft-capping are constexpr switches (WINDOW, SOFTCAP) as in prefill (see
kernels/prefill_attention.py); the window size is a `do_not_specialize` int. With a window the split count is
chosen for the window's keys (no more than the block table holds), and each sequence's segments cover only the key
tiles of its window: the work per sequence stops growing once its context passes the window.

Attention sinks (gpt-oss) are a constexpr switch of the reduce kernel only (SINKS; without sinks the pointer is None,
a constexpr never read): the segments' partial outputs and log-sum-exps are those of the plain softmax, and the merge
adds each head's sink logit to the denominator once, whatever the split count.
"""

from __future__ import annotations

import torch
import triton

from tritium.kernels.decode_configs import DecodeConfig, default_decode_config, tuned_decode_config
from tritium.kernels.jit.decode_attention import decode_reduce_kernel, decode_split_kernel
from tritium.kernels.scores import check_sinks, check_window_and_cap, score_scales
from tritium.kernels.tiles import use_gpu_tiles

MIN_ROWS = 16
WAVES = 2  # split programs per multiprocessor the split count aims at
DEFAULT_SM_COUNT = 132  # an H100/H200's, for launches off a GPU (the interpreter, the compile check)
MIN_KEYS_PER_SPLIT = 256
SPLIT_CHOICES = (1, 2, 4, 8, 16, 32, 64)


def decode_config(head_dim: int, dtype: torch.dtype, tiles: str = "gpu",
                  device: torch.device | str = "cuda") -> DecodeConfig:
    """Launch configuration of the split kernel: on a CUDA device in fp16/bf16 what kernels/decode_configs.py
    records for its architecture, else (and for an architecture it does not record) K/V tiles of about 4K
    elements (2K in fp32), which keep registers in bounds; the interpreter gets 16-key tiles."""
    if not use_gpu_tiles(tiles, device):
        return DecodeConfig(16, 4, 2)
    if torch.device(device).type == "cuda" and dtype != torch.float32:
        tuned = tuned_decode_config(torch.cuda.get_device_capability(device), head_dim)
        if tuned is not None:
            return tuned
    return default_decode_config(head_dim, dtype)


def multiprocessor_count(device: torch.device | str) -> int:
    """The streaming multiprocessors of a CUDA `device`; DEFAULT_SM_COUNT for any other device."""
    if torch.device(device).type != "cuda":
        return DEFAULT_SM_COUNT
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


def target_programs(sm_count: int) -> int:
    """The split kernel's programs that fill `sm_count` multiprocessors WAVES times."""
    return WAVES * max(1, sm_count)


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_context: int, block_n: int,
                      sm_count: int = DEFAULT_SM_COUNT) -> int:
    """The largest of SPLIT_CHOICES that neither exceeds what brings num_seqs * num_kv_heads * splits to
    target_programs(sm_count) nor leaves segments shorter than MIN_KEYS_PER_SPLIT keys."""
    wanted = triton.cdiv(target_programs(sm_count), max(1, num_seqs * num_kv_heads))
    most = triton.cdiv(max_context, max(MIN_KEYS_PER_SPLIT, block_n))
    limit = max(1, min(wanted, most))
    return max(s for s in SPLIT_CHOICES if s <= limit)


def decode_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    num_splits: int | None = None,
    tiles: str = "auto",
    config: DecodeConfig | None = None,
) -> torch.Tensor:
    """Same contract as `reference.decode_attention`. The split count is chosen for the block table's
    width (or the window, if shorter) and the device's multiprocessors (no device sync) and each sequence
    spreads its own context (its window's keys) over the splits; `num_splits` overrides the choice (segments
    may then be shorter than MIN_KEYS_PER_SPLIT); `tiles` picks the launch configuration (kernels/tiles.py),
    `config` overrides it (gpu-check's sweep). `q` may be a strided view (rows of a fused qkv output)."""
    check_window_and_cap(sliding_window, softcap)
    num_seqs, num_heads, head_dim = q.shape
    check_sinks(sinks, num_heads)
    out = torch.empty((num_seqs, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if num_seqs == 0:
        return out
    if q.stride(2) != 1:
        q = q.contiguous()
    page, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    rows = max(MIN_ROWS, triton.next_power_of_2(group))
    cfg = config or decode_config(head_dim, q.dtype, tiles, q.device)
    max_context = block_tables.shape[1] * page
    if sliding_window is not None:
        max_context = min(max_context, sliding_window)
    splits = num_splits or choose_num_splits(num_seqs, num_kv_heads, max_context, cfg.block_n,
                                             multiprocessor_count(q.device))
    partial_out = torch.empty((num_seqs, num_heads, splits, head_dim), dtype=torch.float32, device=q.device)
    partial_lse = torch.empty((num_seqs, num_heads, splits), dtype=torch.float32, device=q.device)
    scale_log2e, cap_in = score_scales(scale, softcap)
    decode_split_kernel[(num_seqs, num_kv_heads, splits)](
        q, key_cache, value_cache, block_tables, seq_lens, partial_out, partial_lse,
        scale_log2e, cap_in, sliding_window or 0, MIN_KEYS_PER_SPLIT if num_splits is None else 1, num_heads,
        splits, q.stride(0), q.stride(1), key_cache.stride(0), key_cache.stride(1), block_tables.stride(0),
        GROUP=group, ROWS=rows, HEAD_DIM=head_dim, BLOCK_N=cfg.block_n, PAGE=page,
        WINDOW=sliding_window is not None, SOFTCAP=softcap is not None,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    decode_reduce_kernel[(num_seqs, num_heads)](
        partial_out, partial_lse, out, sinks, num_heads, splits, out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, SPLITS=triton.next_power_of_2(splits), SINKS=sinks is not None, num_warps=4, num_stages=1,
    )
    return out
