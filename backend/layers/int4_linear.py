"""`Int4Linear`: weight-only int4, `w ~ (q - 8) * scale + zero` per group of a row, CPU only; scales and zeros are
bf16 values, so every path multiplies the same weights (docs/quantization.md#int4-cpu-only)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

GROUP_SIZE = 32
GROUP_SIZES = (32, 64, 128, 256)  # the packed CPU op's group sizes
INT4_PATHS = ("cpu_bf16", "cpu_fp32", "dequant")  # cpu_fp32 (scalar kernel: slow) only when forced
_PACKED_N_MULTIPLE = 16
_VECTORIZED = ("AVX2", "AVX512")  # torch.backends.cpu.get_cpu_capability() values with the op's fast kernels


def quantize_groups(weight: torch.Tensor, group_size: int = GROUP_SIZE) -> tuple[torch.Tensor, torch.Tensor,
                                                                                 torch.Tensor]:
    """`weight` [N, K] -> (q uint8 [N, Kp], scale fp32 [N, Kp // group_size], zero fp32 [same]), Kp: K padded to
    whole groups with each row's last weight. A constant group is exact up to bf16 rounding."""
    n, k = weight.shape
    w = weight.detach().float()
    pad = -k % group_size
    if pad:
        w = torch.cat([w, w[:, -1:].expand(n, pad)], dim=1)
    g = w.reshape(n, -1, group_size)
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    # A constant group: |min| / 8 puts min on code 0 exactly ((0 - 8) * scale + zero = min); all zeros: scale 1.
    flat = torch.where(lo != 0, lo.abs() / 8, torch.ones_like(lo))
    scale = torch.where(hi > lo, (hi - lo) / 15, flat).to(torch.bfloat16).float()
    zero = (lo + 8 * scale).to(torch.bfloat16).float()
    q = torch.round((g - zero[..., None]) / scale[..., None] + 8).clamp_(0, 15).to(torch.uint8)
    return q.reshape(n, -1), scale, zero


def dequantize_groups(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, in_features: int,
                      dtype: torch.dtype) -> torch.Tensor:
    """The `[N, in_features]` weight in `dtype` that `quantize_groups`' output stands for."""
    n = q.shape[0]
    g = q.reshape(n, scale.shape[1], -1).float()
    w = (g - 8) * scale[..., None] + zero[..., None]
    return w.reshape(n, -1)[:, :in_features].to(dtype)


def packable(out_features: int, in_features: int, group_size: int) -> bool:
    """Whether the packed CPU op takes this shape; outside its limits (tests/unit/test_int4.py) the op raises."""
    return out_features % _PACKED_N_MULTIPLE == 0 and group_size in GROUP_SIZES and in_features % group_size == 0


def choose_int4_path(device: torch.device, out_features: int, in_features: int, group_size: int) -> str:
    """The multiply path for this shape on `device`. Raises ValueError off the CPU."""
    if device.type != "cpu":
        raise ValueError(f"Int4Linear runs on CPUs only, got a weight on {device}")
    if not packable(out_features, in_features, group_size) \
            or not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
        return "dequant"
    return "cpu_bf16" if torch.backends.cpu.get_cpu_capability() in _VECTORIZED else "dequant"


class Int4Linear(nn.Module):
    """`x @ dequant(q).T + bias`, quantized from `weight`; `out_dtype` None: the input's. Raises ValueError for
    a group size not in GROUP_SIZES, a weight off the CPU, or a forced `path` the shape cannot take."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype | None = None,
                 path: str | None = None, group_size: int = GROUP_SIZE) -> None:
        super().__init__()
        if group_size not in GROUP_SIZES:
            raise ValueError(f"Int4Linear group_size must be one of {GROUP_SIZES}, got {group_size!r}")
        self.out_features, self.in_features = weight.shape
        self.group_size = group_size
        self.path = path or choose_int4_path(weight.device, self.out_features, self.in_features, group_size)
        if self.path not in INT4_PATHS:
            raise ValueError(f"Int4Linear path must be one of {INT4_PATHS}, got {self.path!r}")
        if self.path != "dequant" and not packable(self.out_features, self.in_features, group_size):
            raise ValueError(f"Int4Linear path {self.path!r} needs out_features % 16 == 0 and in_features % "
                             f"group_size == 0, got [{self.out_features}, {self.in_features}], group {group_size}")
        q, scale, zero = quantize_groups(weight, group_size)
        self.bias = None if bias is None else bias.detach()
        self.out_dtype = out_dtype
        if self.path == "dequant":
            self.register_buffer("qweight", q)
            self.register_buffer("scale", scale)
            self.register_buffer("zero", zero)
        else:  # packed: [N, K / 2] uint8, and [K / group, N, 2] scales and zeros in the activations' dtype
            act = torch.bfloat16 if self.path == "cpu_bf16" else torch.float32
            self.register_buffer("qweight", torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1))
            self.register_buffer("scales_and_zeros", torch.stack([scale, zero], dim=-1).transpose(0, 1)
                                 .contiguous().to(act))

    qweight: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    scales_and_zeros: torch.Tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out_dtype = self.out_dtype or x.dtype
        y: torch.Tensor
        if self.path == "dequant":
            y = F.linear(x, dequantize_groups(self.qweight, self.scale, self.zero, self.in_features, x.dtype))
        else:
            act = self.scales_and_zeros.dtype
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(act).contiguous(), self.qweight, self.group_size,
                                                            self.scales_and_zeros)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.to(out_dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, group_size={self.group_size}, "
                f"path={self.path}")
