"""The @triton.jit bodies of `tritium.kernels.token_bitmask`: a grammar's token bitmask applied to logits
rows in place.

The launch configuration, the specialization and the contract are documented with the host wrappers in
kernels/token_bitmask.py. These bodies are Triton language, not Python: mypy skips this package.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["num_words", "stride_bitmask"],
            do_not_specialize_on_alignment=["bitmask_ptr", "rows_ptr"])
def token_bitmask_kernel(
    logits_ptr, bitmask_ptr, rows_ptr, vocab, num_words, stride_logits, stride_bitmask,
    BLOCK_W: tl.constexpr,
):
    r = tl.program_id(0)
    words = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    row = tl.load(rows_ptr + r).to(tl.int64)
    packed = tl.load(bitmask_ptr + r.to(tl.int64) * stride_bitmask + words, mask=words < num_words, other=0)
    bits = tl.arange(0, 32)
    tokens = words[:, None] * 32 + bits[None, :]
    blocked = ((packed[:, None] >> bits[None, :]) & 1) == 0  # words past W load as 0: blocked
    tl.store(logits_ptr + row * stride_logits + tokens, float("-inf"), mask=blocked & (tokens < vocab))
