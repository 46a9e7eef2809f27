"""PEFT LoRA adapters: read and check one against the model, and hash its content (the prefix cache's key, never
the name). What is served and refused: docs/lora.md."""

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

from tritium.backend.model_config import ModelConfig

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
# Config entries whose non-empty value asks for something this engine does not implement.
_UNSUPPORTED = {
    "use_dora": "DoRA (use_dora)",
    "modules_to_save": "modules_to_save (fully trained extra modules)",
    "rank_pattern": "rank_pattern (per-module ranks)",
    "alpha_pattern": "alpha_pattern (per-module alphas)",
    "fan_in_fan_out": "fan_in_fan_out",
    "target_parameters": "target_parameters",
    "layer_replication": "layer_replication",
    "alora_invocation_tokens": "alora_invocation_tokens (activated LoRA)",
    "use_qalora": "QALoRA (use_qalora)",
    "lora_bias": "lora_bias (a bias in lora_B)",
}
_PEFT_DEFAULT_ALPHA = 8  # LoraConfig.lora_alpha's default: a config without lora_alpha was trained with it


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
    """Host weights `(layer, module) -> (A [rank, in], B [out, rank])`; equal `content_hash`es compute the same."""

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


def _check_config(folder: Path, raw: dict[str, Any], max_rank: int) -> tuple[int, float]:
    """(rank, scaling). Raises LoraAdapterError naming what is wrong."""
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
    alpha = raw.get("lora_alpha", _PEFT_DEFAULT_ALPHA)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise LoraAdapterError(f"{where}: lora_alpha must be a number, got {alpha!r}")
    scaling = alpha / math.sqrt(rank) if raw.get("use_rslora") else alpha / rank
    return rank, float(scaling)


def _module_names(config: ModelConfig) -> list[str]:
    """PEFT's names of the modules an adapter may target (`model.layers.3.self_attn.q_proj`)."""
    return [f"model.layers.{layer}.{_PARENT[m]}.{m}" for layer in range(config.num_hidden_layers) for m in MODULES]


def _str_or_list(where: str, entry: str, value: object) -> str | list[str] | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return value
    raise LoraAdapterError(f"{where}: {entry} must be a string or a list of strings, got {value!r}")


def _regex(where: str, entry: str, pattern: str) -> re.Pattern[str]:
    try:
        return re.compile(pattern)
    except re.error as e:
        raise LoraAdapterError(f"{where}: {entry} {pattern!r} is not a valid regular expression ({e})") from e


def _listed(entries: list[str], name: str) -> bool:
    """PEFT's rule for a list of module names: `name` is one of them, or ends with a dot and one of them."""
    return any(name == e or name.endswith(f".{e}") for e in entries)


def _left_out(folder: Path, raw: dict[str, Any], config: ModelConfig) -> dict[str, str]:
    """The modules `raw` leaves out, each with why, read as PEFT reads its entries (docs/lora.md). Raises
    LoraAdapterError naming what cannot be served."""
    where = f"LoRA adapter {folder}"
    names = _module_names(config)
    targets = _str_or_list(where, "target_modules", raw.get("target_modules"))
    exclude = _str_or_list(where, "exclude_modules", raw.get("exclude_modules"))
    pattern = _str_or_list(where, "layers_pattern", raw.get("layers_pattern"))
    layers = raw.get("layers_to_transform")
    if isinstance(targets, str) and (layers is not None or pattern is not None):
        raise LoraAdapterError(f"{where}: layers_to_transform and layers_pattern cannot be used with a "
                               f"target_modules string ({targets!r})")
    if pattern and layers is None:
        raise LoraAdapterError(f"{where}: layers_pattern needs layers_to_transform")
    left_out: dict[str, str] = {}
    if isinstance(targets, str) and targets.lower() != "all-linear":
        regex = _regex(where, "target_modules", targets)
        left_out = {n: "not matched by target_modules" for n in names if regex.fullmatch(n) is None}
        if len(left_out) == len(names):
            raise LoraAdapterError(f"{where}: target_modules {targets!r} matches none of this model's modules "
                                   f"(named like model.layers.0.self_attn.q_proj; supported: {', '.join(MODULES)})")
    elif isinstance(targets, list):
        unknown = sorted(e for e in targets if not any(_listed([e], n) for n in names))
        if unknown:
            raise LoraAdapterError(f"{where}: unknown target module(s) {', '.join(unknown)}; "
                                   f"supported: {', '.join(MODULES)}")
        left_out = {n: "not in target_modules" for n in names if targets and not _listed(targets, n)}
    if layers is not None and layers != []:  # PEFT: an empty list leaves no layer out
        left_out.update(_left_out_layers(where, names, layers, pattern, config.num_hidden_layers))
    if isinstance(exclude, str):
        regex = _regex(where, "exclude_modules", exclude)
        left_out.update({n: "in exclude_modules" for n in names if regex.fullmatch(n) is not None})
    elif exclude:
        left_out.update({n: "in exclude_modules" for n in names if _listed(exclude, n)})
    if len(left_out) == len(names):
        raise LoraAdapterError(f"{where}: the config leaves out every module of this model "
                               f"({', '.join(sorted(set(left_out.values())))})")
    return left_out


def _left_out_layers(where: str, names: list[str], layers: object, pattern: str | list[str] | None,
                     num_layers: int) -> dict[str, str]:
    """A module's layer as PEFT finds it: the number after two name segments, or after a layers_pattern."""
    if isinstance(layers, int) and not isinstance(layers, bool):
        chosen = {layers}
    elif isinstance(layers, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in layers):
        chosen = set(layers)
    else:
        raise LoraAdapterError(f"{where}: layers_to_transform must be an integer or a list of integers, "
                               f"got {layers!r}")
    beyond = sorted(i for i in chosen if not 0 <= i < num_layers)
    if beyond:
        raise LoraAdapterError(f"{where}: layers_to_transform names layer(s) {', '.join(map(str, beyond))}; "
                               f"the model has {num_layers} layers")
    if not pattern:
        finders = [re.compile(r"[^.]*\.[^.]*\.(?P<idx>\d+)\.")]
    else:
        finders = [_regex(where, "layers_pattern", rf"(?:^|.*?\.){p}\.(?P<idx>\d+)\.")
                   for p in ([pattern] if isinstance(pattern, str) else pattern)]
    found = {n: next((int(m["idx"]) for f in finders if (m := f.match(n))), None) for n in names}
    if all(i is None for i in found.values()):
        raise LoraAdapterError(f"{where}: layers_pattern {pattern!r} matches no layer list of this model "
                               f"(its layers are model.layers)")
    return {n: f"not in layers_to_transform ({layers})" for n, i in found.items() if i not in chosen}


def _read_weights(folder: Path, config: ModelConfig, rank: int, left_out: dict[str, str],
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
            if _PARENT.get(module) != parent:
                raise LoraAdapterError(f"{where}: tensor {key} targets an unknown module {parent}.{module}")
            if layer >= config.num_hidden_layers:
                raise LoraAdapterError(f"{where}: tensor {key} names layer {layer}; the model has "
                                       f"{config.num_hidden_layers} layers")
            name = f"model.layers.{layer}.{parent}.{module}"
            if name in left_out:
                raise LoraAdapterError(f"{where}: tensor {key} is present in the weights but its module {name} is "
                                       f"{left_out[name]}")
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
    """Read and check the PEFT adapter in `folder`. Raises LoraAdapterError naming the folder and what is wrong."""
    folder = Path(folder).expanduser()
    if not folder.is_dir():
        raise LoraAdapterError(f"LoRA adapter {name!r}: {folder} is not a folder")
    raw = _read_config(folder)
    rank, scaling = _check_config(folder, raw, max_rank)
    weights = _read_weights(folder, config, rank, _left_out(folder, raw, config), dtype)
    return LoraAdapter(name, folder, rank, scaling, weights, content_hash(rank, scaling, weights))
