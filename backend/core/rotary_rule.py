"""Rotary scalings that make a sequence's K/V depend on its length, not only on its tokens (longrope, dynamic NTK;
layers/rotary.py computes them): what the prefix cache must key on, and when transformers would recompute."""

from __future__ import annotations

from dataclasses import dataclass

from tritium.backend.core.sequence import Sequence


@dataclass(frozen=True)
class RotaryLengthRule:
    kind: str  # "longrope" or "dynamic"
    original: int  # the checkpoint's original context (original_max_position_embeddings)

    def kv_key(self, seq: Sequence) -> bytes:
        """What `seq`'s K/V depend on besides its tokens, b"" within the original context. Longrope: the long factors
        once the sequence is past it; dynamic NTK: the prompt's length when the prompt is past it."""
        if self.kind == "longrope":
            return b"longrope" if seq.num_tokens > self.original else b""
        return b"dynamic:%d" % seq.num_prompt_tokens if seq.num_prompt_tokens > self.original else b""

    def must_recompute(self, seq: Sequence) -> bool:
        """K/V computed under another key than the sequence has now: a longrope sequence that grew past the original
        context, whose keys transformers' Phi-3 recomputes with the long factors (prepare_inputs_for_generation)."""
        return seq.num_computed_tokens > 0 and seq.kv_key != self.kv_key(seq)

    def draft_room(self, seq: Sequence) -> int | None:
        """The most drafts `seq` may verify without a step past the original context under the short factors (None:
        no bound)."""
        if self.kind == "longrope" and seq.num_tokens <= self.original:
            return self.original - seq.num_tokens
        return None
