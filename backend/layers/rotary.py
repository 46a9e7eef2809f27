"""Rotary position embeddings (neox style) from a checkpoint's rope settings: one cos/sin table per rotary, with
transformers' scalings (modeling_rope_utils.py) computed as it computes them: default, linear, llama3, yarn, longrope
and dynamic NTK. The last two make a token's rotation depend on its sequence's length too (`RotaryEmbedding.rows`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tritium.backend.config_readers import LENGTH_DEPENDENT_ROPE_TYPES, rope_type
from tritium.backend.layers.attention import AttentionBackend


def exponents(dim: int, device: torch.device | None = None) -> torch.Tensor:
    """2i / dim for the dim / 2 rotated pairs."""
    return torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies of `head_dim` rotated features, as a sequence within the original context sees them
    (longrope: the short factors; dynamic: unscaled). Raises ValueError for a rope type not implemented here."""
    kind = rope_type(scaling)
    if kind == "default":
        return 1.0 / (theta ** exponents(head_dim))
    assert scaling is not None
    if kind == "linear":
        return 1.0 / (theta ** exponents(head_dim)) / float(scaling["factor"])
    if kind == "llama3":
        return llama3_inv_freq(head_dim, theta, scaling)
    if kind == "yarn":
        return yarn_inv_freq(head_dim, theta, scaling)
    if kind == "longrope":
        return longrope_inv_freq(head_dim, theta, scaling["short_factor"])
    if kind == "dynamic":
        factor, original = float(scaling["factor"]), int(scaling["original_max_position_embeddings"])
        base: float = theta * ((factor * original / original) - (factor - 1)) ** (head_dim / (head_dim - 2))
        return 1.0 / (base ** exponents(head_dim))
    raise ValueError(f"unsupported rope_scaling type {kind!r}")


def llama3_inv_freq(dim: int, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** exponents(dim))
    factor = float(scaling["factor"])
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_len = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


def yarn_inv_freq(dim: int, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    """YaRN: interpolated (divided by `factor`) frequencies blended into the original ones over a linear ramp between
    the dims that turn beta_fast and beta_slow times within the original context."""
    factor = float(scaling["factor"])
    original = scaling["original_max_position_embeddings"]

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(scaling.get("beta_fast") or 32), correction_dim(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers does, against a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** exponents(dim)
    extrapolation = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def longrope_inv_freq(dim: int, theta: float, factors: list[float]) -> torch.Tensor:
    return 1.0 / (torch.tensor(factors, dtype=torch.float32) * theta ** exponents(dim))


def dynamic_inv_freq(dim: int, theta: float, scaling: dict[str, Any], seq_lens: torch.Tensor) -> torch.Tensor:
    """`[len(seq_lens), dim / 2]`: dynamic NTK's frequencies for sequences of `seq_lens` tokens (int64), row i as
    transformers computes it for one sequence of seq_lens[i] tokens."""
    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]
    grown = _elementwise(factor * seq_lens.clamp(min=original) / original - (factor - 1)) ** (dim / (dim - 2))
    base = theta * grown
    return 1.0 / (_elementwise(base)[:, None] ** exponents(dim, seq_lens.device))


def _elementwise(x: torch.Tensor) -> torch.Tensor:
    """`x` as a strided view. On a CPU torch's vectorized pow differs from its scalar one in the last bit, and
    transformers raises one 0-dim length at a time (the scalar path): on a strided view every element takes it too."""
    return torch.stack([x, x], dim=-1)[..., 0]


def attention_factor(scaling: dict[str, Any] | None) -> float:
    """What yarn and longrope scale cos and sin by (transformers' attention_scaling); 1 for the others."""
    kind = rope_type(scaling)
    if kind not in ("yarn", "longrope"):
        return 1.0
    assert scaling is not None
    factor = scaling["factor"]
    if (given := scaling.get("attention_factor")) is not None:
        return float(given)
    if kind == "longrope":
        original = scaling["original_max_position_embeddings"]
        return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
    return float(mscale(factor, m) / mscale(factor, m_all)) if m and m_all else mscale(factor)


def cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """`[len(positions), 2 * dim / 2]` fp32: cat(cos, sin) of position * inv_freq (one row of it per position, or
    the same for all), times `scale`."""
    freqs = positions.float()[:, None] * inv_freq
    return torch.cat([freqs.cos() * scale, freqs.sin() * scale], dim=-1)


def build_cos_sin_cache(inv_freq: torch.Tensor, max_positions: int, scale: float = 1.0) -> torch.Tensor:
    """`[max_positions, 2 * len(inv_freq)]` fp32: cat(cos, sin) of position * inv_freq, times `scale`."""
    return cos_sin(torch.arange(max_positions), inv_freq, scale)


@dataclass
class RopeChunk:
    """Positions start..end-1 of a prompt of `prompt_len` tokens whose cos/sin a step computes, at table rows from
    `row` (dynamic NTK past the original context)."""

    start: int
    end: int
    prompt_len: int
    row: int

    @property
    def end_row(self) -> int:
        return self.row + self.end - self.start


class RotaryEmbedding(nn.Module):
    """Rotates q and k in place by rows of its cos/sin table; one instance is shared by a model's layers.

    Row p < `num_positions` is position p of a sequence of at most p + 1 tokens, or within the original context.
    Under longrope and dynamic NTK a token's rotation also depends on its sequence: transformers' generate rotates a
    prompt token for the prompt's length and a later token at p for p + 1 tokens. `rows` maps a sequence's positions
    to table rows (the runner stages them in place of the positions); the rows past `num_positions` hold longrope's
    long rows of the positions within the original context, or dynamic NTK's scratch rows a step writes (`fill`)."""

    cos_sin_cache: torch.Tensor

    def __init__(self, head_dim: int, theta: float, scaling: dict[str, Any] | None, max_positions: int,
                 backend: AttentionBackend) -> None:
        """`head_dim`: the rotated features (a head's first ones)."""
        super().__init__()
        self.inv_freq_args = (head_dim, theta, scaling)
        self.kind = rope_type(scaling)
        self.length_dependent = self.kind in LENGTH_DEPENDENT_ROPE_TYPES
        self.original = int(scaling["original_max_position_embeddings"]) \
            if self.length_dependent and scaling is not None else 0
        self.backend = backend
        self.num_positions = max_positions
        self.scratch_rows = 0
        self.register_buffer("cos_sin_cache", self.table(max_positions), persistent=False)

    def table(self, max_positions: int) -> torch.Tensor:
        """The cos/sin table for positions below `max_positions` (on the CPU), then longrope's extra rows; it
        becomes the table's layout (`rows`), without scratch rows (`reserve`)."""
        self.num_positions, self.scratch_rows = max_positions, 0
        dim, theta, scaling = self.inv_freq_args
        scale = attention_factor(scaling)
        cache = build_cos_sin_cache(rope_inv_freq(dim, theta, scaling), max_positions, scale)
        original = self.original
        if not self.length_dependent or max_positions <= original:
            return cache
        assert scaling is not None
        if self.kind == "longrope":  # rows from `original` on are long, then the long rows below it
            long = build_cos_sin_cache(longrope_inv_freq(dim, theta, scaling["long_factor"]), max_positions, scale)
            return torch.cat([cache[:original], long[original:], long[:original]])
        positions = torch.arange(original, max_positions)  # dynamic: a token at p sees p + 1 tokens
        return torch.cat([cache[:original], cos_sin(positions, dynamic_inv_freq(dim, theta, scaling, positions + 1))])

    def reserve(self, rows: int) -> None:
        """Room for `rows` scratch rows a step computes (dynamic NTK only; before graphs capture the table)."""
        if self.kind != "dynamic" or self.num_positions <= self.original:
            return
        table = self.cos_sin_cache[: self.num_positions]
        self.cos_sin_cache = torch.cat([table, table.new_zeros(rows, table.shape[1])])
        self.scratch_rows = rows

    def rows(self, start: int, end: int, prompt_len: int, num_tokens: int, chunks: list[RopeChunk]) -> Sequence[int]:
        """The table rows of positions start..end-1 of a sequence with a `prompt_len`-token prompt, `num_tokens` tokens
        in all. Longrope: the long factors for every token once the sequence is past the original context (the
        scheduler recomputes one that grows past it, core/rotary_rule.py). Dynamic NTK: a prompt past the original
        context gets scratch rows for its tokens (its last aside), their chunk appended to the step's `chunks`.
        Raises RuntimeError when the step's scratch rows run out."""
        if self.kind == "longrope":
            if num_tokens <= self.original or start >= self.original:
                return range(start, end)
            head = min(end, self.original)
            return [*range(self.num_positions + start, self.num_positions + head), *range(head, end)]
        if not self.length_dependent or prompt_len <= self.original or start >= prompt_len - 1:
            return range(start, end)
        last = min(end, prompt_len - 1)  # the prompt's last token sees prompt_len = p + 1 tokens: a table row
        row = chunks[-1].end_row if chunks else self.num_positions
        chunk = RopeChunk(start, last, prompt_len, row)
        if chunk.end_row > self.num_positions + self.scratch_rows:
            raise RuntimeError(f"a step's prompt tokens need {chunk.end_row - self.num_positions} rotary scratch rows; "
                               f"{self.scratch_rows} were reserved")
        chunks.append(chunk)
        return [*range(row, chunk.end_row), *range(last, end)]

    def fill(self, chunks: list[RopeChunk]) -> None:
        """Write the scratch rows of a step's `chunks` (on the table's device, before its forward pass)."""
        dim, theta, scaling = self.inv_freq_args
        assert scaling is not None
        device = self.cos_sin_cache.device
        for c in chunks:
            length = torch.full((1,), c.prompt_len, dtype=torch.int64, device=device)
            inv_freq = dynamic_inv_freq(dim, theta, scaling, length)[0]
            self.cos_sin_cache[c.row : c.end_row] = cos_sin(torch.arange(c.start, c.end, device=device), inv_freq)

    def forward(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor) -> None:
        """`positions`: the tokens' table rows (their positions unless `rows` says otherwise)."""
        self.backend.rotary_embedding(q, k, positions, self.cos_sin_cache)


def length_dependent_rotary(rotaries: list[RotaryEmbedding]) -> RotaryEmbedding | None:
    """The rotary whose rows depend on a sequence's prompt length (longrope, dynamic NTK), if any. Raises ValueError
    when it is not the model's only one (its rows would index the other tables too)."""
    dependent = [r for r in rotaries if r.length_dependent]
    if dependent and len(rotaries) > 1:
        raise ValueError(f"rope type {dependent[0].kind!r} needs the model's only rotary; this one has {len(rotaries)}")
    return dependent[0] if dependent else None
