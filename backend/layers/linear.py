"""Linear layers packed for oneDNN on a CPU (the quantized ones are int8_linear.py and int4_linear.py)."""

from __future__ import annotations

import torch
from torch import nn


def cpu_packing_available(dtype: torch.dtype) -> bool:
    """Whether oneDNN can pack linear weights of `dtype` on this CPU: fp32 wherever torch has oneDNN, bf16 only
    where the CPU has bf16 instructions (AVX512-BF16, AMX); never fp16."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    if dtype == torch.float32:
        return True
    return dtype == torch.bfloat16 and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


class CpuPackedLinear(nn.Module):
    """An fp32 or bf16 linear whose weight oneDNN packs once at load time. At the small row counts of decode
    steps `F.linear` repacks the weight on every call: packed is about 1.5x faster in fp32 and 10x in bf16 (the
    default model's projections at one row, `python -m tritium.client.bench.int8_matmul`)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
        self.bias = None if bias is None else bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return out
