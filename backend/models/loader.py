"""Load a Hugging Face folder (config.json + safetensors, one file or sharded) into the model class of its
architecture (architectures.py), fusing Q/K/V and gate/up weights on the way."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

import torch
from safetensors import safe_open

from tritium.backend.config import check_quantization, check_quantization_device
from tritium.backend.layers.attention import AttentionBackend
from tritium.backend.layers.linear import cpu_packing_available
from tritium.backend.layers.parallel import RankGroup
from tritium.backend.model_config import ModelConfig, ModelFolderError
from tritium.backend.models.architectures import model_class
from tritium.backend.models.base import CausalLM
from tritium.backend.models.quantization import QuantizationOptions, quantize_model
from tritium.backend.models.sharding import RankSlice, Shard, rank_slice, shard_config

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


def iter_tensors(files: list[Path], part_of: Callable[[str], RankSlice] | None = None,
                 ) -> Iterator[tuple[str, torch.Tensor]]:
    """Each checkpoint tensor, or only the part `part_of(name)` says (a tensor-parallel rank's, read as slices)."""
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():  # noqa: SIM118 - safe_open is not a dict
                if part_of is None:
                    yield name, st.get_tensor(name)
                else:
                    piece = st.get_slice(name)
                    yield name, part_of(name).of(piece, piece.get_shape())


def stack_experts(target: str, pieces: dict[tuple[int, int | None], torch.Tensor], num_experts: int,
                  folder: Path) -> torch.Tensor:
    """`[num_experts, ...]` from each expert's tensor (gate and up parts joined). Raises ModelFolderError when one
    is missing."""
    fused = any(part is not None for _, part in pieces)
    wanted = [(e, p) for e in range(num_experts) for p in ((0, 1) if fused else (None,))]
    if len(pieces) != len(wanted) or any(w not in pieces for w in wanted):
        raise ModelFolderError(f"model folder {folder}: incomplete expert weights for {target} "
                               f"({len(pieces)} of {len(wanted)} tensors)")
    if fused:
        return torch.stack([torch.cat([pieces[e, 0], pieces[e, 1]], dim=0) for e in range(num_experts)])
    return torch.stack([pieces[e, None] for e in range(num_experts)])


def load_model(
    folder: str | Path, dtype: torch.dtype, device: torch.device, max_positions: int | None = None,
    quantization: str | None = None, quantization_options: QuantizationOptions | None = None,
    backend: AttentionBackend | None = None,
) -> CausalLM:
    """`backend` None: the torch references; its `parallel` group: the rank whose shard loads (models/sharding.py).
    Raises ModelFolderError for a missing file, an unsupported architecture or feature, missing tensors or tensors
    the model would not use, a `max_positions` beyond the model's context, or sizes the ranks do not divide;
    ValueError, before any weight is read, for a `quantization` unknown or that `device` cannot run."""
    folder = Path(folder)
    check_quantization(quantization)
    check_quantization_device(quantization, device)
    config = ModelConfig.from_folder(folder)
    ranks = backend.parallel if backend is not None else RankGroup()
    shard = Shard(ranks.rank, ranks.size)
    rank_config = shard_config(config, shard.size)
    if quantization is not None and config.is_moe:
        raise ModelFolderError(f"quantization {quantization!r} of a mixture-of-experts model ({config.architecture}) "
                               "is not implemented; load it unquantized")
    if max_positions is not None and max_positions > config.max_position_embeddings:
        raise ModelFolderError(
            f"max_model_len {max_positions} exceeds the model's context of {config.max_position_embeddings} tokens"
        )
    files = weight_files(folder)
    cls = model_class(config.architecture)
    with torch.device("meta"):
        model = cls(rank_config, backend, max_positions=1)
    # A rank reads its slices of each tensor, unless the model converts a tensor's layout first (then it slices after).
    part_of = partial(_rank_part, cls, config, shard)
    read_slices = shard.size > 1 and not cls.CONVERTS_LAYOUT
    state: dict[str, torch.Tensor] = {}
    parts: dict[str, dict[int, torch.Tensor]] = {}
    experts: dict[str, dict[tuple[int, int | None], torch.Tensor]] = {}  # stacked key -> (expert, part) -> tensor
    unused: list[str] = []
    for name, tensor in cls.checkpoint_tensors(iter_tensors(files, part_of if read_slices else None)):
        if _IGNORED.search(name) or (name == "lm_head.weight" and config.tie_word_embeddings):
            continue
        key = cls.checkpoint_key(name)
        if key is None:
            if (expert_key := cls.expert_key(name)) is None:
                unused.append(name)
            else:
                target, expert, part = expert_key
                tensor = cls.convert_weight(target, tensor)
                if shard.size > 1 and not read_slices:
                    tensor = rank_slice(target, part, config, shard).of(tensor, list(tensor.shape))
                experts.setdefault(target, {})[expert, part] = tensor.to(dtype)
            continue
        target, part = key
        tensor = cls.convert_weight(target, tensor)
        if shard.size > 1 and not read_slices:
            tensor = rank_slice(target, part, config, shard).of(tensor, list(tensor.shape))
        tensor = tensor.to(dtype)
        if part is None:
            state[target] = tensor
        else:
            parts.setdefault(target, {})[part] = tensor
    expected = set(model.state_dict())
    unused += sorted(k for k in [*parts, *experts] if k not in expected)  # e.g. a bias the config does not announce
    unused += sorted(k for k in state if k not in expected)
    if unused:
        shown = ", ".join(unused[:5]) + (f" and {len(unused) - 5} more" if len(unused) > 5 else "")
        raise ModelFolderError(
            f"model folder {folder}: the checkpoint has tensors this model code does not use ({shown}); "
            "an unsupported feature, refused rather than loaded without them"
        )
    for target, pieces in parts.items():
        count = 3 if "qkv_proj" in target else 2
        if len(pieces) != count:
            raise ModelFolderError(f"model folder {folder}: incomplete weights for {target}")
        state[target] = torch.cat([pieces[i] for i in range(count)], dim=0)
    for target in list(experts):  # each layer's pieces freed once stacked
        state[target] = stack_experts(target, experts.pop(target), config.num_experts, folder)
    missing = sorted(expected - state.keys())
    if missing:
        shown = ", ".join(missing[:5])
        raise ModelFolderError(f"model folder {folder}: weights missing for {shown}")
    model.load_state_dict(state, strict=False, assign=True)
    positions = max_positions or config.max_position_embeddings
    model.set_max_positions(positions)
    model = model.to(device).eval()
    if quantization is not None:
        quantize_model(model, quantization, quantization_options)
    elif device.type == "cpu" and cpu_packing_available(dtype):
        model.pack_for_cpu()
    return model


def _rank_part(cls: type[CausalLM], config: ModelConfig, shard: Shard, name: str) -> RankSlice:
    """The part of checkpoint tensor `name` that `shard` loads (all of it when the model has no use for it)."""
    if (key := cls.checkpoint_key(name)) is not None:
        return rank_slice(key[0], key[1], config, shard)
    if (expert_key := cls.expert_key(name)) is not None:
        return rank_slice(expert_key[0], expert_key[2], config, shard)
    return RankSlice()
