"""tanh in fp32 for the kernels: Triton's language has none that its interpreter runs (libdevice's is GPU-only).
Triton language, not Python: mypy skips this package."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def tanh(x):
    """Within about an ulp, as libdevice's: below |x| = 0.3 the Taylor polynomial to x^9 (the next term is under
    half an ulp there), above it 1 - 2 / (e^(2|x|) + 1), where the subtraction loses nothing."""
    a = tl.abs(x)
    x2 = x * x
    poly = x * (1.0 + x2 * (-0.3333333333333333 + x2 * (0.13333333333333333 + x2 * (-0.05396825396825397
                                                                                     + x2 * 0.021869488536155203))))
    big = 1.0 - 2.0 / (tl.math.exp2(a * 2.8853900817779268) + 1.0)  # e^(2a) = 2^(2a / ln 2)
    return tl.where(a < 0.3, poly, tl.where(x < 0, -big, big))
