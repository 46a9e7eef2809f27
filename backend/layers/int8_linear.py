"""`Int8Linear`: weight-only int8, one fp32 scale per output row (`quantization = "int8"`). Its multiply paths:
docs/quantization.md#int8."""

from __future__ import annotations

import functools
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

PATHS = ("cpu_bf16", "cpu_fp32", "dequant", "triton")
_PACKED_K_MULTIPLE = 32  # _weight_int8pack_mm on CPU computes wrong results (or crashes) for other K
# fp32 activations: the packed op beats dequantize-then-matmul only for a few rows (docs/quantization.md).
_CPU_FP32_MAX_ROWS = 4


@functools.cache
def cpu_has_bf16_instructions() -> bool:
    """Whether /proc/cpuinfo's flags have AVX512-BF16 or AMX-BF16."""
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return False
    for line in text.splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            return bool(flags & {"avx512_bf16", "amx_bf16"})
    return False


def quantize_per_channel(weight: torch.Tensor, amax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`(q int8 [N, K], scale fp32 [N])`, `q * scale[:, None] ~ weight`; an all-zero row gets scale 1. `amax`: each
    row's largest |weight| when `weight` is part of wider rows (a row-parallel rank's columns)."""
    w = weight.detach().float()
    amax = w.abs().amax(dim=1) if amax is None else amax
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8).contiguous()
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.float() * scale[:, None]).to(dtype)


def choose_path(device: torch.device, in_features: int) -> str:
    """The multiply path on `device` (dequant: CUDA without triton, shapes the packed op cannot take)."""
    if device.type == "cuda":
        try:
            import tritium.kernels.int8_gemm  # noqa: F401  (needs triton)
        except ImportError:
            return "dequant"
        return "triton"
    if device.type != "cpu" or in_features % _PACKED_K_MULTIPLE or not hasattr(torch.ops.aten, "_weight_int8pack_mm"):
        return "dequant"
    return "cpu_bf16" if cpu_has_bf16_instructions() else "cpu_fp32"


class Int8Linear(nn.Module):
    """`x @ dequant(qweight).T + bias`; `out_dtype` None: the input's. Raises ValueError for an unknown `path`."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype | None = None,
                 path: str | None = None, amax: torch.Tensor | None = None) -> None:
        super().__init__()
        q, scale = quantize_per_channel(weight, amax)
        self.out_features, self.in_features = q.shape
        self.register_buffer("qweight", q.to(weight.device))
        self.register_buffer("scale", scale.to(weight.device))
        self.bias = None if bias is None else bias.detach()
        self.out_dtype = out_dtype
        self.path = path or choose_path(weight.device, self.in_features)
        if self.path not in PATHS:
            raise ValueError(f"Int8Linear path must be one of {PATHS}, got {self.path!r}")
        # The bf16 op wants bf16 scales: it gets unit ones and the fp32 scales multiply its result, which costs
        # less accuracy (docs/quantization.md).
        self.unit_bf16 = torch.ones_like(self.scale, dtype=torch.bfloat16) if self.path == "cpu_bf16" else None

    qweight: torch.Tensor
    scale: torch.Tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out_dtype = self.out_dtype or x.dtype
        y: torch.Tensor
        if self.path == "cpu_bf16":
            assert self.unit_bf16 is not None
            y = torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16).contiguous(), self.qweight, self.unit_bf16)
            y = y.float() * self.scale
        elif self.path == "cpu_fp32" and x.shape[0] <= _CPU_FP32_MAX_ROWS:
            y = torch.ops.aten._weight_int8pack_mm(x.float().contiguous(), self.qweight, self.scale)
        elif self.path == "triton":
            from tritium.kernels.int8_gemm import int8_gemm
            y = int8_gemm(x, self.qweight, self.scale)
        else:
            y = F.linear(x, dequantize(self.qweight, self.scale, x.dtype))
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.to(out_dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, path={self.path}"
