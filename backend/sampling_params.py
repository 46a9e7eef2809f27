"""Per-request sampling settings, validated before a request touches the engine."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 256
MAX_SEED = 2**63 - 1
GREEDY_BELOW_TEMPERATURE = 1e-5  # dividing logits by less would overflow them: such a request is greedy
MAX_TEMPERATURE = 100.0
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 100.0  # keep penalized logits finite


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop. Field names and defaults follow vLLM.

    temperature 0 (or anything below 1e-5) means greedy; at most 100. top_k -1 (or 0) disables top-k, and a
    top_k beyond the vocabulary means all of it; top_p 1 and min_p 0 disable theirs. repetition_penalty is
    in [0.01, 100] so that penalized logits stay finite.
    `logprobs=n` returns the sampled token's logprob and the n most likely (raw model distribution).
    Construction raises ValueError naming the field and the rule when a value is invalid.
    """

    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if not isinstance(self.stop, (list, tuple)):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        if not isinstance(self.stop_token_ids, (list, tuple)):
            raise ValueError(f"stop_token_ids must be a list of integers, got {self.stop_token_ids!r}")
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        self._validate()

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> SamplingParams:
        """Build from a JSON-like dict. Raises ValueError for unknown fields or invalid values."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown sampling field(s): {', '.join(unknown)}")
        return cls(**values)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW_TEMPERATURE

    def _validate(self) -> None:
        _int(self, "max_tokens", minimum=1)
        _int(self, "min_tokens", minimum=0)
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        _float(self, "temperature", lo=0.0, hi=MAX_TEMPERATURE, rule=f"in [0, {MAX_TEMPERATURE:g}]")
        _float(self, "top_p", lo=0.0, hi=1.0, lo_open=True, rule="in (0, 1]")
        _int(self, "top_k", minimum=-1)
        _float(self, "min_p", lo=0.0, hi=1.0, rule="in [0, 1]")
        _float(self, "repetition_penalty", lo=MIN_REPETITION_PENALTY, hi=MAX_REPETITION_PENALTY,
               rule=f"in [{MIN_REPETITION_PENALTY:g}, {MAX_REPETITION_PENALTY:g}]")
        _float(self, "presence_penalty", lo=-2.0, hi=2.0, rule="in [-2, 2]")
        _float(self, "frequency_penalty", lo=-2.0, hi=2.0, rule="in [-2, 2]")
        if self.seed is not None:
            _int(self, "seed", minimum=0, maximum=MAX_SEED)
        if self.logprobs is not None:
            _int(self, "logprobs", minimum=0, maximum=MAX_LOGPROBS)
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError("stop must be a string or a list of non-empty strings")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop may hold at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}")
        if any(len(s) > MAX_STOP_STRING_CHARS for s in self.stop):
            raise ValueError(f"each stop string must be at most {MAX_STOP_STRING_CHARS} characters")
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be a list of non-negative integers")
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a boolean, got {getattr(self, name)!r}")


def _int(p: SamplingParams, name: str, minimum: int | None = None, maximum: int | None = None) -> None:
    value = getattr(p, name)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {value}")


def _float(
    p: SamplingParams,
    name: str,
    lo: float | None = None,
    hi: float | None = None,
    lo_open: bool = False,
    rule: str = "",
) -> None:
    value = getattr(p, name)
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ValueError(f"{name} must be a number, got {value!r}")
    try:
        value = float(value)
    except OverflowError:  # an int beyond any float
        raise ValueError(f"{name} must be {rule}, got {value}") from None
    bad = math.isnan(value) or math.isinf(value)
    bad = bad or (lo is not None and (value <= lo if lo_open else value < lo))
    bad = bad or (hi is not None and value > hi)
    if bad:
        raise ValueError(f"{name} must be {rule}, got {value}")
    setattr(p, name, value)
