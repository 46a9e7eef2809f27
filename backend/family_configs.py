"""How the families beyond the Llama family's settings read their `config.json`, as transformers reads them:
Qwen3-MoE and Mixtral (experts), gpt-oss (sinks, experts, MXFP4), Gemma 2 and 3 (model_config.py calls these)."""

from __future__ import annotations

from typing import Any

from tritium.backend.config_readers import ModelFolderError, rope_type, unsupported_features


def moe_fields(arch: str, raw: dict[str, Any]) -> dict[str, Any]:
    """The ModelConfig MoE fields of a Qwen3-MoE or Mixtral config, as transformers reads them. Raises
    ModelFolderError naming a setting this code does not run."""
    qwen3 = arch == "Qwen3MoeForCausalLM"
    experts = int(raw.get("num_experts", raw.get("num_local_experts", 128 if qwen3 else 8)))
    fields: dict[str, Any] = {
        "num_experts": experts,
        "num_experts_per_tok": int(raw.get("num_experts_per_tok", 8 if qwen3 else 2)),
        "moe_intermediate_size": int(raw.get("moe_intermediate_size", 768)) if qwen3 else int(raw["intermediate_size"]),
        "norm_topk_prob": bool(raw.get("norm_topk_prob", False)) if qwen3 else True,  # Mixtral always renormalizes
        "decoder_sparse_step": int(raw.get("decoder_sparse_step", 1)) if qwen3 else 1,
        "mlp_only_layers": tuple(int(i) for i in (raw.get("mlp_only_layers") or ())) if qwen3 else (),
    }
    problems = []
    if experts > 0 and not 0 < fields["num_experts_per_tok"] <= experts:
        problems.append(f"num_experts_per_tok {fields['num_experts_per_tok']} (supported: 1..{experts})")
    if fields["decoder_sparse_step"] < 1:
        problems.append(f"decoder_sparse_step {fields['decoder_sparse_step']} (supported: 1 or more)")
    if not qwen3 and experts < 1:
        problems.append(f"num_local_experts {experts} (supported: 1 or more)")
    for key in ("shared_expert_intermediate_size", "moe_shared_expert_intermediate_size", "n_shared_experts"):
        if raw.get(key):
            problems.append(f"{key} {raw[key]} (shared experts are not supported)")
    if problems:
        raise ModelFolderError(f"unsupported MoE setting(s): {'; '.join(problems)}")
    return fields


# transformers' GptOssConfig defaults for what a gpt-oss config.json may leave out (gpt-oss-20b's sizes)
GPT_OSS_DEFAULTS: dict[str, Any] = {
    "vocab_size": 201088, "hidden_size": 2880, "intermediate_size": 2880, "num_hidden_layers": 36, "head_dim": 64,
    "num_attention_heads": 64, "num_key_value_heads": 8, "num_local_experts": 128, "num_experts_per_tok": 4,
    "sliding_window": 128, "rms_norm_eps": 1e-5, "max_position_embeddings": 131072, "attention_bias": True,
    "tie_word_embeddings": False, "swiglu_limit": 7.0, "swiglu_alpha": 1.702,
}
GPT_OSS_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096, "rope_theta": 150000.0}
# The clamped SwiGLU's settings that fused_moe's "swiglu_oai" activation computes (kernels/interface.py)
GPT_OSS_SWIGLU = {"swiglu_limit": 7.0, "swiglu_alpha": 1.702}


def gpt_oss_config(raw: dict[str, Any]) -> dict[str, Any]:
    """A gpt-oss `config.json` with transformers' defaults filled in: sizes, layer types (sliding first, then
    alternating), yarn rope parameters and a rope base of 150000."""
    raw = GPT_OSS_DEFAULTS | raw
    if raw.get("layer_types") is None:
        raw["layer_types"] = ["sliding_attention" if (i + 1) % 2 else "full_attention"
                              for i in range(int(raw["num_hidden_layers"]))]
    if not (raw.get("rope_scaling") or raw.get("rope_parameters")):
        raw["rope_parameters"] = dict(GPT_OSS_ROPE)
    params = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
    if "rope_theta" not in raw and "rope_theta" not in params:
        raw["rope_theta"] = GPT_OSS_ROPE["rope_theta"]
    return raw


def is_mxfp4(raw: dict[str, Any]) -> bool:
    """Whether a config's weights are MXFP4-quantized (gpt-oss's experts; dequantized at load)."""
    quant = raw.get("quantization_config")
    return isinstance(quant, dict) and quant.get("quant_method") == "mxfp4"


def gpt_oss_unsupported_features(raw: dict[str, Any]) -> list[str]:
    """unsupported_features for a gpt-oss config (defaults filled in): its MXFP4 experts are taken, hidden_act is
    not read (transformers' gpt-oss ignores it), the clamped SwiGLU's settings must be the ones fused_moe computes."""
    skip = ("hidden_act", "quantization_config") if is_mxfp4(raw) else ("hidden_act",)
    found = unsupported_features({k: v for k, v in raw.items() if k not in skip})
    for key, value in GPT_OSS_SWIGLU.items():
        if float(raw[key]) != value:
            found.append(f"{key} {raw[key]} (supported: {value}, what the swiglu_oai experts compute)")
    experts, top_k = int(raw["num_local_experts"]), int(raw["num_experts_per_tok"])
    if not 0 < top_k <= experts:
        found.append(f"num_experts_per_tok {top_k} (supported: 1..{experts}, the num_local_experts)")
    return found


def gpt_oss_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """The ModelConfig fields a gpt-oss config sets beyond the Llama family's: biases on q/k/v and o, sinks, experts
    (intermediate_size is each expert's)."""
    bias = bool(raw["attention_bias"])
    return {"attention_bias": bias, "o_proj_bias": bias, "attention_sinks": True,
            "num_experts": int(raw["num_local_experts"]), "num_experts_per_tok": int(raw["num_experts_per_tok"]),
            "moe_intermediate_size": int(raw["intermediate_size"])}


# transformers' defaults for what a Gemma config.json may leave out, where they differ from the Llama family's
GEMMA_DEFAULTS: dict[str, dict[str, Any]] = {
    arch: {"head_dim": 256, "num_key_value_heads": 4, "rms_norm_eps": 1e-6, "max_position_embeddings": positions,
           "tie_word_embeddings": True, "bos_token_id": 2, "eos_token_id": 1, "hidden_activation": "gelu_pytorch_tanh",
           "query_pre_attn_scalar": 256, "sliding_window": 4096, "attn_logit_softcapping": attn_cap,
           "final_logit_softcapping": final_cap}
    for arch, positions, attn_cap, final_cap in (("Gemma2ForCausalLM", 8192, 50.0, 30.0),
                                                 ("Gemma3ForCausalLM", 131072, None, None))
}
GEMMA_ACTIVATIONS = ("gelu_pytorch_tanh",)
GEMMA_ROPE_TYPES = ("default", "linear")
# What Gemma configs say their own way: not for unsupported_features' Llama-family rules.
_GEMMA_OWN_KEYS = ("hidden_act", "hidden_activation", "attn_logit_softcapping", "final_logit_softcapping",
                   "rope_scaling", "rope_parameters")


def gemma3_rope(raw: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Gemma 3's rope parameters (full layers, sliding layers) from either config shape: 5.x `rope_parameters` keyed
    by layer type, or the older `rope_theta` + `rope_scaling` (full layers) and `rope_local_base_freq`."""
    params = raw.get("rope_parameters") or {}
    full = {"rope_type": "default", **(params.get("full_attention") or {})}
    full.update(raw.get("rope_scaling") or {})
    full.setdefault("rope_theta", raw.get("rope_theta", 1_000_000.0))
    local = {"rope_type": "default", **(params.get("sliding_attention") or {})}
    local.setdefault("rope_theta", raw.get("rope_local_base_freq", 10_000.0))
    return full, local


def gemma_unsupported_features(arch: str, raw: dict[str, Any]) -> list[str]:
    """unsupported_features for a Gemma 2 / Gemma 3 config (transformers' defaults merged into `raw`)."""
    found = unsupported_features({k: v for k, v in raw.items() if k not in _GEMMA_OWN_KEYS})
    if (act := raw["hidden_activation"]) not in GEMMA_ACTIVATIONS:
        found.append(f"hidden_activation {act!r} (supported: {', '.join(GEMMA_ACTIVATIONS)})")
    if raw.get("use_bidirectional_attention"):
        found.append("use_bidirectional_attention true (supported: causal attention)")
    if raw.get("attention_bias"):
        found.append("attention_bias true (supported: false)")
    ropes = {"rope": raw.get("rope_scaling") or raw.get("rope_parameters")}
    if arch == "Gemma3ForCausalLM":
        if raw["attn_logit_softcapping"] is not None:  # transformers' Gemma 3 reads it but never applies it
            found.append(f"attn_logit_softcapping {raw['attn_logit_softcapping']} (Gemma 3 applies none)")
        ropes = dict(zip(("full_attention rope", "sliding_attention rope"), gemma3_rope(raw), strict=True))
    for name, params in ropes.items():
        if (kind := rope_type(params)) not in GEMMA_ROPE_TYPES:
            found.append(f"{name} type {kind!r} (supported: {', '.join(GEMMA_ROPE_TYPES)})")
    return found


def gemma_fields(arch: str, raw: dict[str, Any]) -> dict[str, Any]:
    """The ModelConfig fields a Gemma config sets beyond the Llama family's, and Gemma 3's rotary bases."""
    fields: dict[str, Any] = {
        "hidden_act": raw["hidden_activation"],
        "query_pre_attn_scalar": float(raw["query_pre_attn_scalar"]),
        "attn_logit_softcapping": float(raw["attn_logit_softcapping"]) if raw["attn_logit_softcapping"] else None,
        "final_logit_softcapping": float(raw["final_logit_softcapping"]) if raw["final_logit_softcapping"] else None,
    }
    if arch == "Gemma3ForCausalLM":
        full, local = gemma3_rope(raw)
        fields |= {
            "qk_norm": True,
            "rope_theta": float(full["rope_theta"]),
            "rope_scaling": full if rope_type(full) != "default" else None,
            "local_rope_theta": float(local["rope_theta"]),
            "local_rope_scaling": local if rope_type(local) != "default" else None,
        }
    return fields
