"""Load a Hugging Face Llama-family folder (config.json + safetensors, one file or sharded) into
`LlamaForCausalLM`, fusing Q/K/V and gate/up weights on the way."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from tritium.backend.config import check_quantization, check_quantization_device
from tritium.backend.layers.attention import AttentionBackend
from tritium.backend.layers.linear import cpu_packing_available
from tritium.backend.model_config import ModelConfig, ModelFolderError
from tritium.backend.models.llama import LlamaForCausalLM
from tritium.backend.models.quantization import QuantizationOptions, quantize_model

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_DIRECT = {
    "self_attn.o_proj.weight": "o_proj.weight",
    "self_attn.o_proj.bias": "o_proj.bias",
    "mlp.down_proj.weight": "down_proj.weight",
    "mlp.down_proj.bias": "down_proj.bias",
    "input_layernorm.weight": "input_layernorm.weight",
    "post_attention_layernorm.weight": "post_attention_layernorm.weight",
}
_FUSED = {  # HF name -> (our name, part index)
    "self_attn.q_proj.weight": ("qkv_proj.weight", 0),
    "self_attn.k_proj.weight": ("qkv_proj.weight", 1),
    "self_attn.v_proj.weight": ("qkv_proj.weight", 2),
    "self_attn.q_proj.bias": ("qkv_proj.bias", 0),
    "self_attn.k_proj.bias": ("qkv_proj.bias", 1),
    "self_attn.v_proj.bias": ("qkv_proj.bias", 2),
    "mlp.gate_proj.weight": ("gate_up_proj.weight", 0),
    "mlp.up_proj.weight": ("gate_up_proj.weight", 1),
    "mlp.gate_proj.bias": ("gate_up_proj.bias", 0),
    "mlp.up_proj.bias": ("gate_up_proj.bias", 1),
}
_IGNORED = re.compile(r"\.rotary_emb\.inv_freq$")  # a cache some old checkpoints saved, recomputed here


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files of `folder`. Raises ModelFolderError naming what is missing."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        files = [folder / name for name in sorted(set(weight_map.values()))]
        for f in files:
            if not f.is_file():
                raise ModelFolderError(
                    f"model folder {folder} is missing weight shard {f.name} (named in {index.name})"
                )
        return files
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    raise ModelFolderError(f"model folder {folder} has no model.safetensors (nor model.safetensors.index.json)")


def checkpoint_numel(folder: Path) -> int:
    """Weight elements in `folder`'s safetensors, from their headers. Raises ModelFolderError as weight_files does."""
    total = 0
    for f in weight_files(folder):
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():  # noqa: SIM118 - safe_open is not a dict
                total += math.prod(st.get_slice(name).get_shape())
    return total


def iter_tensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():  # noqa: SIM118 - safe_open is not a dict
                yield name, st.get_tensor(name)


def load_model(
    folder: str | Path, dtype: torch.dtype, device: torch.device, max_positions: int | None = None,
    quantization: str | None = None, quantization_options: QuantizationOptions | None = None,
    backend: AttentionBackend | None = None,
) -> LlamaForCausalLM:
    """`backend` None: the torch references. Raises ModelFolderError for a missing file, an unsupported
    architecture or feature, missing tensors or tensors the model would not use, or a `max_positions` beyond the
    model's context (where a sliding window would be active); ValueError, before any weight is read, for a
    `quantization` unknown or that `device` cannot run."""
    folder = Path(folder)
    check_quantization(quantization)
    check_quantization_device(quantization, device)
    config = ModelConfig.from_folder(folder)
    if max_positions is not None and max_positions > config.max_position_embeddings:
        reason = f" (its sliding_window of {config.sliding_window} tokens)" if config.sliding_window else ""
        raise ModelFolderError(
            f"max_model_len {max_positions} exceeds the model's context of {config.max_position_embeddings} "
            f"tokens{reason}"
        )
    files = weight_files(folder)
    with torch.device("meta"):
        model = LlamaForCausalLM(config, backend, max_positions=1)
    state: dict[str, torch.Tensor] = {}
    parts: dict[str, dict[int, torch.Tensor]] = {}
    unused: list[str] = []
    for name, tensor in iter_tensors(files):
        tensor = tensor.to(dtype)
        if name == "model.embed_tokens.weight":
            state["embed_tokens.weight"] = tensor
        elif name == "model.norm.weight":
            state["norm.weight"] = tensor
        elif name == "lm_head.weight":
            if not config.tie_word_embeddings:
                state["lm_head.weight"] = tensor
        elif m := _LAYER.match(name):
            layer, rest = m.group(1), m.group(2)
            if rest in _DIRECT:
                state[f"layers.{layer}.{_DIRECT[rest]}"] = tensor
            elif rest in _FUSED:
                target, idx = _FUSED[rest]
                parts.setdefault(f"layers.{layer}.{target}", {})[idx] = tensor
            elif not _IGNORED.search(name):
                unused.append(name)
        elif not _IGNORED.search(name):
            unused.append(name)
    expected = set(model.state_dict())
    unused += sorted(k for k in parts if k not in expected)  # e.g. a bias the config does not announce
    unused += sorted(k for k in state if k not in expected)
    if unused:
        shown = ", ".join(unused[:5]) + (f" and {len(unused) - 5} more" if len(unused) > 5 else "")
        raise ModelFolderError(
            f"model folder {folder}: the checkpoint has tensors this model code does not use ({shown}); "
            "an unsupported feature, refused rather than loaded without them"
        )
    for target, pieces in parts.items():
        count = 3 if "qkv" in target else 2
        if len(pieces) != count:
            raise ModelFolderError(f"model folder {folder}: incomplete weights for {target}")
        state[target] = torch.cat([pieces[i] for i in range(count)], dim=0)
    missing = sorted(expected - state.keys())
    if missing:
        shown = ", ".join(missing[:5])
        raise ModelFolderError(f"model folder {folder}: weights missing for {shown}")
    model.load_state_dict(state, strict=False, assign=True)
    positions = max_positions or config.max_position_embeddings
    model.rotary.cos_sin_cache = model.rotary.table(positions)
    model = model.to(device).eval()
    if quantization is not None:
        quantize_model(model, quantization, quantization_options)
    elif device.type == "cpu" and cpu_packing_available(dtype):
        model.pack_for_cpu()
    return model
