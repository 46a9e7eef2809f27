"""`quantize_model`: weight-only int8 or int4 of a loaded model's projections and logits head
(docs/quantization.md)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tritium.backend.config import check_quantization, check_quantization_device
from tritium.backend.layers.int4_linear import GROUP_SIZE, Int4Linear
from tritium.backend.layers.int8_linear import Int8Linear
from tritium.backend.models.base import PROJECTIONS, CausalLM


@dataclass(frozen=True)
class QuantizationOptions:
    """quantize_model's measurement knobs; the engine uses the defaults (None: int4 groups of 32, the head in
    HEAD_SCHEMES[scheme], multiply paths chosen per host and shape)."""

    group_size: int | None = None
    head: str | None = None
    path: str | None = None
    head_path: str | None = None


# int4's logits head stays int8: an int4 head costs far more accuracy than int4 layers (docs/quantization.md).
HEAD_SCHEMES = {"int8": "int8", "int4": "int8"}


ROW_PARALLEL = ("o_proj", "down_proj")  # a tensor-parallel rank holds some columns of each row (models/sharding.py)


def _linear(scheme: str, weight: torch.Tensor, bias: torch.Tensor | None, path: str | None,
            group_size: int | None, out_dtype: torch.dtype | None = None, amax: torch.Tensor | None = None,
            ) -> nn.Module:
    if scheme == "int4":
        return Int4Linear(weight, bias, out_dtype, path, group_size or GROUP_SIZE)
    return Int8Linear(weight, bias, out_dtype, path, amax)


def quantize_model(model: CausalLM, scheme: str, options: QuantizationOptions | None = None) -> None:
    """Quantize `model` in place, its logits head in HEAD_SCHEMES[scheme]. Raises ValueError naming a scheme unknown
    or not for this device, or a projection that is not a plain nn.Linear (e.g. already packed)."""
    check_quantization(scheme)
    if scheme is None:
        return
    check_quantization_device(scheme, model.embed_tokens.weight.device)
    if model.config.is_moe:
        raise ValueError(f"quantization {scheme!r} of a mixture-of-experts model ({model.config.architecture}) is "
                         "not implemented")
    opts = options or QuantizationOptions()
    head_scheme = opts.head or HEAD_SCHEMES[scheme]
    check_quantization(head_scheme)
    ranks = model.backend.parallel
    for i, layer in enumerate(model.layers):
        for name in PROJECTIONS:
            linear = getattr(layer, name)
            if not isinstance(linear, nn.Linear):
                raise ValueError(f"quantization {scheme!r}: layers.{i}.{name} is a {type(linear).__name__}, "
                                 "not an nn.Linear; only unpacked linear layers can be quantized")
            amax = None
            if name in ROW_PARALLEL and ranks.size > 1:  # int8 scales of the whole rows, as one rank quantizes them
                amax = ranks.all_max(linear.weight.detach().float().abs().amax(dim=1))
            setattr(layer, name, _linear(scheme, linear.weight, linear.bias, opts.path, opts.group_size,
                                         amax=amax))
    lm_head = model.lm_head
    weight = model.head_weight
    model.packed_lm_head = _linear(head_scheme, weight, None, opts.head_path, opts.group_size, torch.float32)
    if lm_head is not None:
        model.lm_head = None  # its fp weight is no longer used: freed
    model.quantization = scheme  # read by the runner's kernel warm-up (kernels/warmup.py)
