"""Generic readers of a Hugging Face `config.json` as transformers reads it: rope settings and the context they
serve, sliding layers, and the features the Llama-family code would get wrong (model_config.py assembles them)."""

from __future__ import annotations

from typing import Any

GEMMA_ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "MixtralForCausalLM")
SUPPORTED_ACTIVATIONS = ("silu", "swish")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")  # every rotary (Gemma 3's two included)
# A model with one rotary table (layers/rotary.py) takes these too; Phi3 takes default and longrope only.
ROPE_TYPES = (*SUPPORTED_ROPE_TYPES, "yarn", "longrope", "dynamic")
PHI3_ROPE_TYPES = ("default", "longrope")
LENGTH_DEPENDENT_ROPE_TYPES = ("longrope", "dynamic")  # a token's rotation depends on its sequence's length too


class ModelFolderError(ValueError):
    """A model folder that cannot be loaded; the message names the missing file or unsupported feature."""


def rope_type(rope_scaling: dict[str, Any] | None) -> str:
    scaling = rope_scaling or {}
    return str(scaling.get("rope_type", scaling.get("type", "default")))


def checkpoint_rope_type(raw: dict[str, Any]) -> str:
    """The rope type of a `config.json` as transformers reads it (its Phi3Config reads "su" and "yarn" as longrope)."""
    kind = rope_type(raw.get("rope_scaling") or raw.get("rope_parameters"))
    phi3 = (raw.get("architectures") or [""])[0] == "Phi3ForCausalLM"
    return "longrope" if phi3 and kind in ("su", "yarn") else kind


def resolved_rope_scaling(raw: dict[str, Any]) -> dict[str, Any] | None:
    """A `config.json`'s rope scaling (None: default) with what transformers derives filled in: the rope type, the
    original context (`original_max_position_embeddings`, for dynamic NTK the config's max_position_embeddings) and
    yarn's and longrope's factor when absent."""
    kind = checkpoint_rope_type(raw)
    if kind == "default":
        return None
    params = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
    scaling = {**params, "rope_type": kind}
    positions = int(raw.get("max_position_embeddings", 2048))
    if kind == "dynamic":
        scaling["original_max_position_embeddings"] = positions
    elif kind in ("llama3", "yarn", "longrope"):
        # A config field of that name wins over the rope settings' own (transformers' Phi3Config has one, 4096).
        phi3 = (raw.get("architectures") or [""])[0] == "Phi3ForCausalLM"
        top = raw.get("original_max_position_embeddings", 4096 if phi3 else None)
        original = top or params.get("original_max_position_embeddings")
        scaling["original_max_position_embeddings"] = int(original or positions)
    if kind in ("yarn", "longrope") and scaling.get("factor") is None:
        scaling["factor"] = positions / scaling["original_max_position_embeddings"]
    return scaling


def served_context(raw: dict[str, Any], scaling: dict[str, Any] | None) -> int:
    """The context the engine serves: max_position_embeddings, or what yarn (the original context x factor) and
    dynamic NTK (max_position_embeddings x factor) extend it to, as vLLM does."""
    positions = int(raw.get("max_position_embeddings", 2048))
    kind = rope_type(scaling)
    if kind == "yarn":
        assert scaling is not None
        return max(positions, int(scaling["original_max_position_embeddings"] * scaling["factor"]))
    if kind == "dynamic":
        assert scaling is not None
        return max(positions, int(positions * scaling["factor"]))
    return positions


def unsupported_features(raw: dict[str, Any]) -> list[str]:
    """The settings of a `config.json` that this model code would get wrong, each named with its value."""
    found = []
    act = raw.get("hidden_act", raw.get("hidden_activation", "silu"))
    if act not in SUPPORTED_ACTIVATIONS:
        found.append(f"hidden_act {act!r} (supported: silu)")
    rope_params = raw.get("rope_scaling") or raw.get("rope_parameters")
    phi3 = (raw.get("architectures") or [""])[0] == "Phi3ForCausalLM"
    supported = PHI3_ROPE_TYPES if phi3 else ROPE_TYPES
    if (kind := checkpoint_rope_type(raw)) not in supported:
        found.append(f"rope_scaling type {kind!r} (supported: {', '.join(supported)})")
    partial = raw.get("partial_rotary_factor", (rope_params or {}).get("partial_rotary_factor", 1.0))
    if partial is not None and float(partial) != 1.0 and not phi3:
        found.append(f"partial_rotary_factor {partial} (supported: 1.0; Phi3ForCausalLM: any)")
    if kind == "longrope":
        head_dim = raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]
        pairs = int(head_dim * float(rotary_fraction(raw))) // 2
        for key in ("short_factor", "long_factor"):
            if len(factors := (rope_params or {}).get(key) or []) != pairs:
                found.append(f"rope_scaling {key} of {len(factors)} values (the rotary dim needs {pairs})")
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if raw.get(key):
            found.append(f"{key} {raw[key]}")
    if quant := raw.get("quantization_config"):
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else quant
        found.append(f"quantization_config ({method}); load an unquantized checkpoint")
    return found


def rotary_fraction(raw: dict[str, Any]) -> float:
    """The share of each head's features that rotates (partial_rotary_factor; the rope settings' own wins)."""
    params = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
    return float(params.get("partial_rotary_factor") or raw.get("partial_rotary_factor") or 1.0)


def sliding_layers(arch: str, raw: dict[str, Any]) -> tuple[int | None, tuple[str, ...]]:
    """(the sliding window, per-layer attention types) as transformers reads them for `arch`."""
    layers = int(raw["num_hidden_layers"])
    window = raw.get("sliding_window")
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM") and not raw.get("use_sliding_window"):
        window = None
    if not window:
        return None, ()
    types = raw.get("layer_types")
    if types is None and arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        first = int(raw.get("max_window_layers", 28))
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
    if types is None and arch in GEMMA_ARCHITECTURES:  # every pattern-th layer full, the others sliding
        every = 2 if arch == "Gemma2ForCausalLM" else int(raw.get("sliding_window_pattern", 6))
        types = ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(layers)]
    if types is None:
        types = ["sliding_attention"] * layers
    if len(types) != layers or any(t not in ("full_attention", "sliding_attention") for t in types):
        raise ModelFolderError(f"layer_types {types!r}: one of full_attention / sliding_attention per layer")
    return int(window), tuple(types)
