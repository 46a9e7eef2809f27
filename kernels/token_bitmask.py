"""Apply a grammar's token bitmask to logits rows in place: disallowed tokens become -inf.

Structured output (JSON schema, regex, grammar) constrains each step's next token: the grammar engine
(llguidance / xgrammar) fills one packed bitmask row per constrained sequence, and the sampler must only
see the allowed tokens. The layout is theirs: `bitmask` `[R, W]` int32, bit `t % 32` of word `t // 32` set
means token `t` is allowed (little bit order); tokens at or past `32 * W` (a tokenizer smaller than the
model's padded vocabulary) are disallowed. Bitmask row `r` applies to logits row `rows[r]`; other rows are
not touched. `reference.apply_token_bitmask` is the plain-torch version (and the CPU path).

The kernel only writes: each program unpacks `BLOCK_W` words of one bitmask row into a `[BLOCK_W, 32]` tile
of tokens and stores -inf where the bit is clear (and the token is below the vocabulary size). Allowed
logits are never read nor rewritten, so they keep their exact bits, and a row listed twice gets the
intersection of its masks. Grid: one program per (bitmask row, `32 * BLOCK_W` tokens). The tile (2048
tokens, 16 per thread) is cheap on GPUs and, the kernel being a few vector ops, also the fastest under the
interpreter (whose cost is per program), so `tiles` (kernels/tiles.py) is accepted and checked but picks
the same launch anywhere. The @triton.jit body is in kernels/jit/token_bitmask.py.

Specialization, so that an engine compiles every variant before serving (kernels/warmup.py) and none while
serving: the row count R is only the grid's size, so no launch argument carries it. The vocabulary size and
the logits row stride are fixed for an engine and keep the JIT's divisible-by-16 specialization. The
bitmask's width W and row stride follow the grammar engine's tokenizer, which the warm-up does not know,
and address only scalar word loads: `do_not_specialize`. The `rows` pointer may be a view at any offset of
a step's staging buffer and the bitmask a slice of a persistent one: their alignment is not specialized.
The logits dtype and the `rows` dtype (int32 or int64) each make a variant; the warm-up launches fp32
logits (what the engine samples from) with both index dtypes.
"""

from __future__ import annotations

import torch
import triton

from tritium.kernels.jit.token_bitmask import token_bitmask_kernel
from tritium.kernels.tiles import check_tiles

BLOCK_W = 64  # bitmask words (32 tokens each) per program
NUM_WARPS = 4


def apply_token_bitmask(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor, tiles: str = "auto"
) -> None:
    """Same contract as `reference.apply_token_bitmask`: in place on `logits` `[B, V]` (fp32, fp16 or
    bf16; rows may be strided, tokens contiguous), `bitmask` `[R, W]` int32 on the same device, `rows`
    `[R]` int32 or int64 (a row listed twice gets both masks). `tiles` is checked (one launch configuration
    everywhere). No device sync."""
    check_tiles(tiles)
    num_rows = rows.shape[0]
    assert logits.dim() == 2 and bitmask.dim() == 2 and rows.dim() == 1, "logits [B, V], bitmask [R, W], rows [R]"
    assert bitmask.shape[0] == num_rows, f"{bitmask.shape[0]} bitmask rows for {num_rows} logits rows"
    assert bitmask.dtype == torch.int32, f"bitmask must be int32, got {bitmask.dtype}"
    assert rows.dtype in (torch.int32, torch.int64), f"rows must be int32 or int64, got {rows.dtype}"
    assert logits.device == bitmask.device == rows.device, "logits, bitmask and rows must share a device"
    assert logits.stride(1) == 1, "apply_token_bitmask needs contiguous logits rows (it writes in place)"
    vocab, num_words = logits.shape[1], bitmask.shape[1]
    if num_rows == 0 or vocab == 0:
        return
    if bitmask.stride(1) != 1:
        bitmask = bitmask.contiguous()
    if rows.stride(0) != 1:
        rows = rows.contiguous()
    grid = (num_rows, triton.cdiv(vocab, 32 * BLOCK_W))
    token_bitmask_kernel[grid](
        logits, bitmask, rows, vocab, num_words, logits.stride(0), bitmask.stride(0),
        BLOCK_W=BLOCK_W, num_warps=NUM_WARPS,
    )
