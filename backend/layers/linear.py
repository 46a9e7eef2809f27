"""Linear layers packed for oneDNN on a CPU (the quantized ones are int8_linear.py and int4_linear.py)."""

from __future__ import annotations

import torch
from torch import nn


def cpu_packing_available(dtype: torch.dtype) -> bool:
    """Whether oneDNN can pack `dtype` weights here: fp32, or bf16 on CPUs with bf16 instructions."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    if dtype == torch.float32:
        return True
    return dtype == torch.bfloat16 and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


class CpuPackedLinear(nn.Module):
    """Packed once at load: at a decode step's few rows `F.linear` repacks every call (docs/quantization.md)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
        self.bias = None if bias is None else bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return out
