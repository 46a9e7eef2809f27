"""The part of a Hugging Face `config.json` the Llama-family model needs."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

GEMMA_ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "MixtralForCausalLM")
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                           "Phi3ForCausalLM", *GEMMA_ARCHITECTURES, *MOE_ARCHITECTURES, "GptOssForCausalLM")
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


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # bias on the q/k/v projections
    rope_scaling: dict[str, Any] | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    o_proj_bias: bool = False
    mlp_bias: bool = False
    sliding_window: int | None = None  # the window of the layers `layer_types` marks "sliding_attention"
    layer_types: tuple[str, ...] = ()  # per layer "full_attention" or "sliding_attention" (empty: all full)
    hidden_act: str = "silu"  # the gated MLP's activation: "silu" or "gelu_pytorch_tanh"
    qk_norm: bool = False  # a per-head RMSNorm on q and k before rotary
    query_pre_attn_scalar: float | None = None  # attention scale = this ** -0.5 (None: head_dim ** -0.5)
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    partial_rotary_factor: float = 1.0  # rotary over the first head_dim * this features
    local_rope_theta: float | None = None  # the sliding layers' rotary base, when it differs
    local_rope_scaling: dict[str, Any] | None = None
    num_experts: int = 0  # mixture of experts (0: a dense MLP in every layer)
    num_experts_per_tok: int = 0  # the experts each token runs (top k)
    moe_intermediate_size: int = 0  # one expert's intermediate size
    norm_topk_prob: bool = False  # the top k routing weights renormalized to sum to 1
    decoder_sparse_step: int = 1  # every this-th layer is MoE (Qwen3-MoE)
    mlp_only_layers: tuple[int, ...] = ()  # layers that keep the dense MLP (Qwen3-MoE)
    attention_sinks: bool = False  # a learned sink logit per head in every layer's softmax (gpt-oss)

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer `layer` runs experts, as transformers' Qwen3MoeDecoderLayer decides (Mixtral: every layer)."""
        return (self.num_experts > 0 and (layer + 1) % self.decoder_sparse_step == 0
                and layer not in self.mlp_only_layers)

    @property
    def is_moe(self) -> bool:
        """Whether any layer runs experts."""
        return any(self.is_moe_layer(i) for i in range(self.num_hidden_layers))

    def window_of(self, layer: int) -> int | None:
        """Layer `layer`'s sliding window (None: full attention)."""
        sliding = self.layer_types and self.layer_types[layer] == "sliding_attention"
        return self.sliding_window if sliding else None

    def kv_bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        """Bytes of one KV block (keys and values of `block_size` tokens, every layer) in `dtype`."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * block_size * dtype.itemsize

    @classmethod
    def from_folder(cls, folder: str | Path) -> ModelConfig:
        """Read `config.json` (eos ids from `generation_config.json` when present). Raises ModelFolderError
        when it is missing or names an unsupported architecture or feature (`unsupported_features`)."""
        folder = Path(folder)
        path = folder / "config.json"
        if not path.is_file():
            raise ModelFolderError(f"model folder {folder} has no config.json")
        raw = json.loads(path.read_text(encoding="utf-8"))
        archs = raw.get("architectures") or []
        arch = archs[0] if archs else ""
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ModelFolderError(
                f"{path}: unsupported architecture {arch or '(none)'!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if arch in GEMMA_ARCHITECTURES:
            raw = GEMMA_DEFAULTS[arch] | raw
            unsupported = gemma_unsupported_features(arch, raw)
        elif arch == "GptOssForCausalLM":
            raw = gpt_oss_config(raw)
            unsupported = gpt_oss_unsupported_features(raw)
        else:
            unsupported = unsupported_features(raw)
        if unsupported:
            raise ModelFolderError(f"{path}: unsupported checkpoint feature(s): {'; '.join(unsupported)}")
        heads = raw["num_attention_heads"]
        eos = raw.get("eos_token_id")
        gen_path = folder / "generation_config.json"
        if gen_path.is_file():
            gen = json.loads(gen_path.read_text(encoding="utf-8"))
            eos = gen.get("eos_token_id", eos)
        if eos is None:
            eos_ids: list[int] = []
        else:
            eos_ids = [int(e) for e in eos] if isinstance(eos, list) else [int(eos)]
        rope_params = raw.get("rope_parameters") or {}
        rope_theta = raw.get("rope_theta", rope_params.get("rope_theta", 10000.0))
        rope_scaling = resolved_rope_scaling(raw)
        max_positions = served_context(raw, rope_scaling)
        window, layer_types = sliding_layers(arch, raw)
        # Llama and Qwen3 put attention_bias on q/k/v and o; Qwen2 has q/k/v bias only; Mistral and Phi3 have none.
        biased = ("LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
        attention_bias = arch == "Qwen2ForCausalLM" or (arch in biased and bool(raw.get("attention_bias")))
        qwen3 = arch == "Qwen3ForCausalLM"
        qwen3_moe = arch == "Qwen3MoeForCausalLM"
        config = cls(
            architecture=arch,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim", 128) if qwen3 else raw.get("head_dim") or raw["hidden_size"] // heads,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            rope_scaling=rope_scaling,
            eos_token_ids=eos_ids,
            bos_token_id=raw.get("bos_token_id"),
            o_proj_bias=attention_bias and arch in biased,
            mlp_bias=arch == "LlamaForCausalLM" and bool(raw.get("mlp_bias")),
            sliding_window=window,
            layer_types=layer_types,
            qk_norm=qwen3 or qwen3_moe,
            partial_rotary_factor=rotary_fraction(raw),
        )
        if arch == "GptOssForCausalLM":
            return replace(config, **gpt_oss_fields(raw))
        if arch in MOE_ARCHITECTURES:
            try:
                return replace(config, **moe_fields(arch, raw))
            except ModelFolderError as exc:
                raise ModelFolderError(f"{path}: {exc}") from None
        return replace(config, **gemma_fields(arch, raw)) if arch in GEMMA_ARCHITECTURES else config
