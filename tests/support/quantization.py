"""Reference quantizations in plain torch, written from the schemes' definitions (not from the engine's code), and
checkpoints whose weights went through them: the engine runs such a checkpoint unquantized, in fp32, so what
it computes is the scheme's own rounding error and nothing else."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

PROJECTION_WEIGHTS = tuple(f".{parent}.{name}.weight" for parent, names in
                           (("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj")),
                            ("mlp", ("gate_proj", "up_proj", "down_proj"))) for name in names)


def int8_round_trip(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [N, K] through symmetric int8 with one scale per output row: step max|row| / 127, codes rounded
    to the nearest."""
    w = weight.double()
    step = w.abs().amax(dim=1, keepdim=True) / 127
    step[step == 0] = 1
    return (torch.round(w / step) * step).float()


def int4_round_trip(weight: torch.Tensor, group: int = 32) -> torch.Tensor:
    """`weight` [N, K] (K a multiple of `group`) through asymmetric int4 in groups of `group` along each row: 16
    levels from the group's min to its max, step and offset rounded to bf16 first (the scheme's storage), codes
    rounded to the nearest level. A constant group stays as it is."""
    n, k = weight.shape
    g = weight.double().reshape(n, k // group, group)
    lo, hi = g.amin(dim=-1, keepdim=True), g.amax(dim=-1, keepdim=True)
    step = ((hi - lo) / 15).to(torch.bfloat16).double()
    mid = (lo + 8 * step).to(torch.bfloat16).double()  # the value of code 8
    flat = step == 0
    codes = torch.round((g - mid) / torch.where(flat, 1.0, step)).clamp(-8, 7)
    out = torch.where(flat, g, codes * step + mid)
    return out.reshape(n, k).float()


ROUND_TRIPS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"int8": int8_round_trip, "int4": int4_round_trip}


def write_quantized_reference(model: Path, dest: Path, scheme: str, head_scheme: str = "int8") -> Path:
    """A copy of the checkpoint `model` with every layer projection's weight through `scheme`'s round trip and an
    untied logits head through `head_scheme`'s (the token embedding as it was), in fp32. Returns `dest`."""
    dest.mkdir(parents=True)
    for path in model.iterdir():
        if path.is_file() and not path.name.endswith((".safetensors", ".safetensors.index.json")):
            shutil.copy(path, dest / path.name)
    weights: dict[str, torch.Tensor] = {}
    for shard in sorted(model.glob("*.safetensors")):
        weights.update(load_file(str(shard)))
    out = {name: ROUND_TRIPS[scheme](w) if name.endswith(PROJECTION_WEIGHTS) else w.float()
           for name, w in weights.items()}
    head = weights.get("lm_head.weight", weights["model.embed_tokens.weight"])
    out["lm_head.weight"] = ROUND_TRIPS[head_scheme](head)
    save_file(out, str(dest / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((dest / "config.json").read_text(encoding="utf-8"))
    (dest / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False, "torch_dtype": "float32"}),
                                      encoding="utf-8")
    return dest
