"""Weight-only int8 quantization (`EngineConfig.quantization = "int8"`), and the entry point of both schemes
(`quantize_model`; int4, CPU only, is in int4.py).

Every linear layer (the fused QKV, output, fused gate/up and down projections) and the logits projection are
quantized at load, from the checkpoint's weights: symmetric, one fp32 scale per output channel (row),
`q = round(w / scale)` in [-127, 127] with `scale = max|w_row| / 127`. The token embedding stays in the
model's dtype: it is a lookup, not a matmul; with tied embeddings the logits head gets its own int8 copy.
Norms, rotary and attention are untouched. Activations are not quantized (W8A16 on CUDA, W8A16/W8A32 on a CPU).

How an `Int8Linear` multiplies (`Int8Linear.path`, chosen once per host and layer by `choose_path`):
- "cpu_bf16": `torch.ops.aten._weight_int8pack_mm` with bf16 activations (the int8 x bf16 dot products in
  bf16), then the fp32 per-channel scales in fp32, cast back to the input's dtype. The fastest by far on
  CPUs with bf16 instructions (AVX512-BF16 / AMX).
- "cpu_fp32": the same op with fp32 activations and scales for up to 4 rows, dequantize-then-matmul above
  (CPUs without bf16 instructions, where bf16 arithmetic is emulated; the README has the figures that chose it).
- "dequant": dequantize the weight to the input's dtype, then `F.linear` (any shape: the packed op needs the
  reduction size to be a multiple of 32; the CUDA path when Triton is unavailable).
- "triton": the Triton W8A16 GEMM (kernels/int8_gemm.py): dequantized in the kernel, fp32 accumulation.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from tritium.backend.models.int4 import GROUP_SIZE, Int4Linear

if TYPE_CHECKING:
    from tritium.backend.models.llama import LlamaForCausalLM

QUANTIZATIONS = ("int8", "int4")
CPU_ONLY = ("int4",)
PATHS = ("cpu_bf16", "cpu_fp32", "dequant", "triton")
_PACKED_K_MULTIPLE = 32  # _weight_int8pack_mm on CPU computes wrong results (or crashes) for other K
# With fp32 activations the packed op beats dequantize-then-matmul only for a few rows (client/bench/int8_matmul.py:
# the default model's 30 layers + head, one thread: 1 row 119 vs 246 ms per step, 32 rows 4100 vs 312 ms).
_CPU_FP32_MAX_ROWS = 4


def check_quantization(value: object) -> None:
    """Raise ValueError naming the field and the allowed values unless `value` is None or a known scheme."""
    if value is not None and value not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {list(QUANTIZATIONS)} (or null: none), got {value!r}; "
                         "other schemes are not implemented")


def check_quantization_device(value: str | None, device: torch.device) -> None:
    """Raise ValueError naming the scheme and the device when `value` cannot run on `device` (int4 off a CPU)."""
    if value in CPU_ONLY and device.type != "cpu":
        raise ValueError(f"quantization {value!r} is implemented for CPUs only (the device is {device.type}); "
                         "'int8' is the weight-only scheme on CUDA")


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
        # fp32 scales multiply its result, which halves the error of bf16 scales (perplexity: see the README).
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


LAYER_PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


@dataclass(frozen=True)
class QuantizationOptions:
    """quantize_model's measurement knobs (the engine uses the defaults): int4's group size (None: 32), the logits
    head's scheme (None: HEAD_SCHEMES[scheme]) and forced multiplies (`path` for the layers, `head_path`; None:
    chosen per host and shape)."""

    group_size: int | None = None
    head: str | None = None
    path: str | None = None
    head_path: str | None = None


# The logits head of "int4" stays int8: an int4 head (49152 x 576, tied to the embedding) alone raised the default
# model's perplexity by 9% against +0.3% for int4 layers with an int8 head (README, "Quantization").
HEAD_SCHEMES = {"int8": "int8", "int4": "int8"}


def _linear(scheme: str, weight: torch.Tensor, bias: torch.Tensor | None, path: str | None,
            group_size: int | None, out_dtype: torch.dtype | None = None) -> nn.Module:
    if scheme == "int4":
        return Int4Linear(weight, bias, out_dtype, path, group_size or GROUP_SIZE)
    return Int8Linear(weight, bias, out_dtype, path)


def quantize_model(model: LlamaForCausalLM, scheme: str, options: QuantizationOptions | None = None) -> None:
    """Quantize `model` (a loaded LlamaForCausalLM) in place: every layer projection in `scheme`, the logits head in
    HEAD_SCHEMES[scheme] (`options`: measurement knobs, None the defaults).

    Raises ValueError naming the scheme unless it is implemented here (int4 off a CPU), or the part of the model
    it cannot quantize (a projection that is not a plain nn.Linear, e.g. already packed)."""
    check_quantization(scheme)
    if scheme is None:
        return
    check_quantization_device(scheme, model.embed_tokens.weight.device)
    opts = options or QuantizationOptions()
    head_scheme = opts.head or HEAD_SCHEMES[scheme]
    check_quantization(head_scheme)
    for i, layer in enumerate(model.layers):
        for name in LAYER_PROJECTIONS:
            linear = getattr(layer, name)
            if not isinstance(linear, nn.Linear):
                raise ValueError(f"quantization {scheme!r}: layers.{i}.{name} is a {type(linear).__name__}, "
                                 "not an nn.Linear; only unpacked linear layers can be quantized")
            setattr(layer, name, _linear(scheme, linear.weight, linear.bias, opts.path, opts.group_size))
    lm_head = model.lm_head
    weight = model.embed_tokens.weight if lm_head is None else lm_head.weight
    # the logits head: fp32 logits, like LlamaForCausalLM.compute_logits; the embedding lookup stays unquantized
    model.packed_lm_head = _linear(head_scheme, weight, None, opts.head_path, opts.group_size, torch.float32)
    if lm_head is not None:
        model.lm_head = None  # its fp weight is no longer used: freed
    model.quantization = scheme  # read by the runner's kernel warm-up (kernels/warmup.py)
