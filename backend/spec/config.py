"""`speculative_config`, in vLLM's shape: what to draft with and how many tokens.

`{"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": a, "prompt_lookup_max": b}` drafts by
prompt lookup (ngram.py); `{"method": "draft_model", "model": folder, "num_speculative_tokens": k}` with a
smaller model of the same tokenizer (draft_model.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 16
DEFAULT_PROMPT_LOOKUP_MIN = 2
DEFAULT_PROMPT_LOOKUP_MAX = 4
KNOWN_KEYS = frozenset({"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "model"})


@dataclass(frozen=True)
class SpeculativeConfig:
    """Validated speculation settings: `method`, the most draft tokens per step `num_speculative_tokens` and
    the n-gram sizes prompt lookup tries (longest first)."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = DEFAULT_PROMPT_LOOKUP_MIN
    prompt_lookup_max: int = DEFAULT_PROMPT_LOOKUP_MAX
    model: str | None = None  # the draft model's folder (method "draft_model")

    @classmethod
    def parse(cls, raw: Any) -> SpeculativeConfig | None:
        """The config `raw` describes (a dict as in model.json, or a SpeculativeConfig); None for None.
        Raises ValueError naming the field and the rule."""
        if raw is None or isinstance(raw, SpeculativeConfig):
            return raw
        if not isinstance(raw, dict):
            raise ValueError(f"speculative_config must be an object like {{\"method\": \"ngram\", "
                             f"\"num_speculative_tokens\": 3}}, got {raw!r}")
        unknown = sorted(set(raw) - KNOWN_KEYS)
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {', '.join(unknown)}; known: "
                             f"{', '.join(sorted(KNOWN_KEYS))}")
        method = raw.get("method", "ngram")
        if method not in METHODS:
            raise ValueError(f"speculative_config.method must be one of {METHODS}, got {method!r}")
        k = _int(raw, "num_speculative_tokens", None, 1, MAX_SPECULATIVE_TOKENS)
        if method == "draft_model":
            model = raw.get("model")
            if not isinstance(model, str) or not model:
                raise ValueError("speculative_config.model must name the draft model's folder (method "
                                 f"'draft_model'), got {model!r}")
            return cls(method, k, model=model)
        if "model" in raw:
            raise ValueError("speculative_config.model is for method 'draft_model' only")
        low_given, high_given = raw.get("prompt_lookup_min"), raw.get("prompt_lookup_max")
        if low_given is None and high_given is None:
            low_given, high_given = DEFAULT_PROMPT_LOOKUP_MIN, DEFAULT_PROMPT_LOOKUP_MAX
        # One of them alone sets both, as in vLLM.
        low = _int({"prompt_lookup_min": high_given if low_given is None else low_given}, "prompt_lookup_min",
                   None, 1, 64)
        high = _int({"prompt_lookup_max": low_given if high_given is None else high_given}, "prompt_lookup_max",
                    None, 1, 64)
        if low > high:
            raise ValueError(f"speculative_config.prompt_lookup_min ({low}) must be <= prompt_lookup_max ({high})")
        return cls(method, k, low, high)


def _int(raw: dict[str, Any], name: str, default: int | None, low: int, high: int) -> int:
    value = raw.get(name, default)
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise ValueError(f"speculative_config.{name} must be an integer in [{low}, {high}], got {value!r}")
    return value
