"""MXFP4 weights (the OCP microscaling format gpt-oss checkpoints store their experts in), dequantized at load: blocks
of 32 FP4 E2M1 values, two a byte (the low nibble first), sharing one E8M0 scale byte (a power of two, biased by
127). A checkpoint holds a weight `W` as `W_blocks` uint8 `[..., rows, G, 16]` and `W_scales` uint8 `[..., rows, G]`,
the rows being the output features and the G * 32 columns the input ones."""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch

BLOCK = 32  # values sharing one scale
SCALE_BIAS = 127
# E2M1 by its 4 bits: sign, two exponent bits, one mantissa bit
FP4_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_PACKED = re.compile(r"^(.+)_(blocks|scales)$")


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """fp32 `[..., G * 32]` from `blocks` uint8 `[..., G, 16]` and `scales` uint8 `[..., G]`. Raises ValueError for
    shapes that do not pair."""
    if blocks.shape[-1] != BLOCK // 2 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not pair "
                         f"(blocks [..., G, {BLOCK // 2}], scales [..., G])")
    table = torch.tensor(FP4_E2M1, dtype=torch.float32, device=blocks.device)
    out = torch.empty(*blocks.shape[:-1], BLOCK, dtype=torch.float32, device=blocks.device)
    for i in range(blocks.shape[0]):  # one leading slice (an expert) at a time bounds the index temporaries
        packed = blocks[i].to(torch.uint8)
        out[i, ..., 0::2] = table[(packed & 0x0F).long()]
        out[i, ..., 1::2] = table[(packed >> 4).long()]
        torch.ldexp(out[i], scales[i].to(torch.int32)[..., None] - SCALE_BIAS, out=out[i])
    return out.flatten(-2)


def dequantized_tensors(tensors: Iterator[tuple[str, torch.Tensor]],
                        transpose: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """`tensors` with each `W_blocks` / `W_scales` pair replaced by `W` in fp32 `[..., rows, G * 32]` (`transpose`:
    `[..., G * 32, rows]`); a half without its pair comes out as it was (the loader then refuses it as a tensor it has
    no use for)."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors:
        if (m := _PACKED.match(name)) is None:
            yield name, tensor
            continue
        base, part = m.groups()
        halves = pending.setdefault(base, {})
        halves[part] = tensor
        if len(halves) == 2:
            del pending[base]
            weight = dequantize_mxfp4(halves["blocks"], halves["scales"])
            yield base, weight.transpose(-1, -2) if transpose else weight
    for base, halves in pending.items():
        for part, tensor in halves.items():
            yield f"{base}_{part}", tensor
