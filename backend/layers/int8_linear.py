"""`Int8Linear`: weight-only int8 with one fp32 scale per output row (`quantization = "int8"`; quantize_model in
models/quantization.py swaps it in).

`q = round(w / scale)` in [-127, 127], `scale = max|w_row| / 127`. How it multiplies (`Int8Linear.path`, chosen once
per host and layer by `choose_path`):
- "cpu_bf16": `torch.ops.aten._weight_int8pack_mm` with bf16 activations, then the fp32 scales: the fastest on CPUs
  with bf16 instructions (AVX512-BF16 / AMX).
- "cpu_fp32": the same op with fp32 activations for up to 4 rows, dequantize-then-matmul above (CPUs without bf16
  instructions).
- "dequant": dequantize the weight, then `F.linear` (any shape; CUDA without Triton).
- "triton": the Triton W8A16 GEMM (kernels/int8_gemm.py): dequantized in the kernel, fp32 accumulation.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

PATHS = ("cpu_bf16", "cpu_fp32", "dequant", "triton")
_PACKED_K_MULTIPLE = 32  # _weight_int8pack_mm on CPU computes wrong results (or crashes) for other K
# With fp32 activations the packed op beats dequantize-then-matmul only for a few rows (client/bench/int8_matmul.py:
# the default model's 30 layers + head, one thread: 1 row 119 vs 246 ms per step, 32 rows 4100 vs 312 ms).
_CPU_FP32_MAX_ROWS = 4


@functools.cache
def cpu_has_bf16_instructions() -> bool:
    """True when this CPU computes in bf16 natively (AVX512-BF16 or AMX-BF16 in /proc/cpuinfo's flags)."""
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return False
    for line in text.splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            return bool(flags & {"avx512_bf16", "amx_bf16"})
    return False


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: `(q int8 [N, K], scale fp32 [N])` with `q * scale[:, None] ~ weight`.
    An all-zero row gets scale 1 (and zeros)."""
    w = weight.detach().float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8).contiguous()
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.float() * scale[:, None]).to(dtype)


def choose_path(device: torch.device, in_features: int) -> str:
    """The multiply an Int8Linear of reduction size `in_features` uses on `device` (see the module docstring)."""
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
    """`y = x @ dequant(qweight).T + bias` with an int8 weight and one fp32 scale per output row.

    `out_dtype` None returns the input's dtype (the logits head asks for float32)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype | None = None,
                 path: str | None = None) -> None:
        super().__init__()
        q, scale = quantize_per_channel(weight)
        self.out_features, self.in_features = q.shape
        self.register_buffer("qweight", q.to(weight.device))
        self.register_buffer("scale", scale.to(weight.device))
        self.bias = None if bias is None else bias.detach()
        self.out_dtype = out_dtype
        self.path = path or choose_path(weight.device, self.in_features)
        if self.path not in PATHS:
            raise ValueError(f"Int8Linear path must be one of {PATHS}, got {self.path!r}")
        # The bf16 path's op wants scales in the activations' dtype and returns bf16: it gets unit scales and the
        # fp32 scales multiply its result, which halves the error of bf16 scales (perplexity: docs/quantization.md).
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
