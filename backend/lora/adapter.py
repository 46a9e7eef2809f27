"""PEFT LoRA adapters: read `adapter_config.json` + `adapter_model.safetensors`, check them against the model,
and identify them by content (the prefix cache keys a block by that hash, never by name)."""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from tritium.backend.models.config import ModelConfig

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
# Config entries whose non-empty value asks for something this engine does not implement.
_UNSUPPORTED = {
    "use_dora": "DoRA (use_dora)",
    "modules_to_save": "modules_to_save (fully trained extra modules)",
    "layers_to_transform": "layers_to_transform",
    "rank_pattern": "rank_pattern (per-module ranks)",
    "alpha_pattern": "alpha_pattern (per-module alphas)",
    "fan_in_fan_out": "fan_in_fan_out",
    "target_parameters": "target_parameters",
}


class LoraAdapterError(ValueError):
    """An adapter folder that cannot be served with this model; the message names the folder and the problem."""


def module_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each target module of `config`'s layers."""
    h, inter = config.hidden_size, config.intermediate_size
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}


@dataclass(eq=False)
class LoraAdapter:
    """One loaded adapter in host memory: `weights[(layer, module)] = (A [rank, in], B [out, rank])` in the
    model's dtype, `scaling` (lora_alpha / r, or / sqrt(r) with rslora), and `content_hash`, 16 bytes over the
    weights and the scaling: two adapters with equal hashes compute the same thing."""

    name: str
    folder: Path
    rank: int
    scaling: float
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(repr=False)
    content_hash: bytes = b""

    @property
    def nbytes(self) -> int:
        """Host bytes its weights take."""
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def _read_config(folder: Path) -> dict[str, Any]:
    path = folder / "adapter_config.json"
    if not path.is_file():
        raise LoraAdapterError(f"LoRA adapter {folder}: no adapter_config.json")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise LoraAdapterError(f"LoRA adapter {folder}: adapter_config.json is not JSON ({e})") from e
    if not isinstance(raw, dict):
        raise LoraAdapterError(f"LoRA adapter {folder}: adapter_config.json must hold an object")
    return raw


def _check_config(folder: Path, raw: dict[str, Any], max_rank: int) -> tuple[int, float, set[str]]:
    """The rank, the scaling and the target modules `raw` declares. Raises LoraAdapterError naming what is wrong."""
    where = f"LoRA adapter {folder}"
    if raw.get("peft_type", "LORA") != "LORA":
        raise LoraAdapterError(f"{where}: peft_type {raw.get('peft_type')!r} is not supported (only LORA)")
    for key, what in _UNSUPPORTED.items():
        if raw.get(key):
            raise LoraAdapterError(f"{where}: {what} is not supported")
    if raw.get("bias", "none") != "none":
        raise LoraAdapterError(f"{where}: bias {raw.get('bias')!r} is not supported (only 'none')")
    rank = raw.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise LoraAdapterError(f"{where}: r must be an integer >= 1, got {rank!r}")
    if rank > max_rank:
        raise LoraAdapterError(f"{where}: rank {rank} exceeds max_lora_rank {max_rank}")
    alpha = raw.get("lora_alpha", rank)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise LoraAdapterError(f"{where}: lora_alpha must be a number, got {alpha!r}")
    scaling = alpha / math.sqrt(rank) if raw.get("use_rslora") else alpha / rank
    targets = raw.get("target_modules") or []
    if targets == "all-linear":
        targets = list(MODULES)
    if isinstance(targets, str):
        targets = [targets]
    unknown = sorted(set(targets) - set(MODULES))
    if unknown:
        raise LoraAdapterError(f"{where}: unknown target module(s) {', '.join(unknown)}; "
                               f"supported: {', '.join(MODULES)}")
    return rank, float(scaling), set(targets)


def _read_weights(folder: Path, config: ModelConfig, rank: int, targets: set[str],
                  dtype: torch.dtype) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    where = f"LoRA adapter {folder}"
    path = folder / "adapter_model.safetensors"
    if not path.is_file():
        also = " (adapter_model.bin is not read: convert it to safetensors)" \
            if (folder / "adapter_model.bin").is_file() else ""
        raise LoraAdapterError(f"{where}: no adapter_model.safetensors{also}")
    shapes = module_shapes(config)
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    with safe_open(str(path), framework="pt") as st:
        for key in st.keys():  # noqa: SIM118 - safe_open is not a dict
            m = _KEY.match(key)
            if m is None:
                raise LoraAdapterError(f"{where}: tensor {key} is not a LoRA weight of a supported module "
                                       f"({', '.join(MODULES)})")
            layer, parent, module, which = int(m.group(1)), m.group(2), m.group(3), m.group(4)
            if _PARENT.get(module) != parent or (targets and module not in targets):
                raise LoraAdapterError(f"{where}: tensor {key} targets an unknown module {parent}.{module}")
            if layer >= config.num_hidden_layers:
                raise LoraAdapterError(f"{where}: tensor {key} names layer {layer}; the model has "
                                       f"{config.num_hidden_layers} layers")
            tensor = st.get_tensor(key)
            d_in, d_out = shapes[module]
            want = (rank, d_in) if which == "A" else (d_out, rank)
            if tuple(tensor.shape) != want:
                raise LoraAdapterError(f"{where}: tensor {key} has shape {list(tensor.shape)}; this model and "
                                       f"rank {rank} need {list(want)}")
            tensor = tensor.to(dtype).contiguous()
            if not torch.isfinite(tensor).all():  # it would reach other requests' rows as 0 * inf = NaN
                raise LoraAdapterError(f"{where}: tensor {key} holds NaN or infinite values (as {dtype})")
            parts.setdefault((layer, module), {})[which] = tensor
    if not parts:
        raise LoraAdapterError(f"{where}: adapter_model.safetensors holds no LoRA weights")
    weights = {}
    for (layer, module), ab in sorted(parts.items()):
        if set(ab) != {"A", "B"}:
            missing = "lora_B" if "A" in ab else "lora_A"
            raise LoraAdapterError(f"{where}: layer {layer} {module} has no {missing} weight")
        weights[(layer, module)] = (ab["A"], ab["B"])
    return weights


def content_hash(rank: int, scaling: float, weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]) -> bytes:
    """16 bytes over the rank, the scaling and every weight (names, dtypes and values)."""
    h = hashlib.blake2b(f"lora r={rank} scaling={scaling!r}".encode(), digest_size=16)
    for (layer, module), (a, b) in sorted(weights.items()):
        h.update(f"{layer}.{module}.{a.dtype}".encode())
        for t in (a, b):
            h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return h.digest()


def load_adapter(name: str, folder: str | Path, config: ModelConfig, max_rank: int, dtype: torch.dtype) -> LoraAdapter:
    """Read and check the PEFT adapter in `folder` for a model of `config`, its weights in `dtype` on the host.
    Returns the adapter with its content hash. Raises LoraAdapterError naming the folder and what is wrong: a
    missing file, a rank above `max_rank`, an unknown target, a shape that does not fit the model, DoRA, bias,
    modules_to_save or another unsupported PEFT feature."""
    folder = Path(folder).expanduser()
    if not folder.is_dir():
        raise LoraAdapterError(f"LoRA adapter {name!r}: {folder} is not a folder")
    rank, scaling, targets = _check_config(folder, _read_config(folder), max_rank)
    weights = _read_weights(folder, config, rank, targets, dtype)
    return LoraAdapter(name, folder, rank, scaling, weights, content_hash(rank, scaling, weights))
