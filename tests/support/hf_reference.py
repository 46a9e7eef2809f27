"""transformers as the reference for greedy outputs (fp32, one prompt at a time)."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import torch


@cache
def _model(path: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@cache
def _greedy(path: str, prompt: tuple[int, ...], max_new_tokens: int) -> tuple[int, ...]:
    model = _model(path)
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
            temperature=None, top_p=None, top_k=None,
        )
    return tuple(out[0, len(prompt):].tolist())


def hf_greedy(path: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' greedy continuation of each prompt (stops at EOS like ours)."""
    return [list(_greedy(str(path), tuple(p), max_new_tokens)) for p in prompts]
