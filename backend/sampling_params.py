"""Per-request sampling settings. `SamplingParams`' fields (type, default, bounds) are the one declaration the
validation here, the Triton parsers and the OpenAI request models follow (`SAMPLING_FIELDS`; see
docs/architecture.md#serving-and-the-openai-endpoint)."""

from __future__ import annotations

import builtins
import math
import types
import typing
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from tritium.backend.structured_output.constraint import StructuredOutput

MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 256
MAX_SEED = 2**63 - 1
MAX_PRIORITY = 2**31 - 1  # a request's priority is in [-MAX_PRIORITY, MAX_PRIORITY] (an INT32 input)
GREEDY_BELOW_TEMPERATURE = 1e-5  # dividing logits by less would overflow them: such a request is greedy
MAX_TEMPERATURE = 100.0
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 100.0  # keep penalized logits finite


def _bounds(ge: float | None = None, gt: float | None = None, le: float | None = None) -> dict[str, float]:
    """A field's bounds, kept in its metadata (the names pydantic's Field takes)."""
    return {k: v for k, v in (("ge", ge), ("gt", gt), ("le", le)) if v is not None}


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop, with vLLM's names and defaults (docs/python.md#sampling-parameters).
    Construction raises ValueError naming the field and the rule. A new field needs only its type and bounds."""

    max_tokens: int = field(default=16, metadata=_bounds(ge=1))
    min_tokens: int = field(default=0, metadata=_bounds(ge=0))
    temperature: float = field(default=1.0, metadata=_bounds(ge=0.0, le=MAX_TEMPERATURE))
    top_p: float = field(default=1.0, metadata=_bounds(gt=0.0, le=1.0))
    top_k: int = field(default=-1, metadata=_bounds(ge=-1))
    min_p: float = field(default=0.0, metadata=_bounds(ge=0.0, le=1.0))
    repetition_penalty: float = field(default=1.0, metadata=_bounds(ge=MIN_REPETITION_PENALTY,
                                                                    le=MAX_REPETITION_PENALTY))
    presence_penalty: float = field(default=0.0, metadata=_bounds(ge=-2.0, le=2.0))
    frequency_penalty: float = field(default=0.0, metadata=_bounds(ge=-2.0, le=2.0))
    seed: int | None = field(default=None, metadata=_bounds(ge=0, le=MAX_SEED))
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = field(default=None, metadata=_bounds(ge=0, le=MAX_LOGPROBS))
    skip_special_tokens: bool = True
    structured_output: StructuredOutput | None = None  # or its dict / JSON text (StructuredOutput.from_value)
    priority: int = field(default=0, metadata=_bounds(ge=-MAX_PRIORITY, le=MAX_PRIORITY))

    def __post_init__(self) -> None:
        if self.structured_output is not None:
            self.structured_output = StructuredOutput.from_value(self.structured_output)
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
        """Whether this request takes the most likely token (a temperature below GREEDY_BELOW_TEMPERATURE)."""
        return self.temperature < GREEDY_BELOW_TEMPERATURE

    def _validate(self) -> None:
        for spec in SAMPLING_FIELDS.values():  # types and bounds, in declaration order
            value = getattr(self, spec.name)
            if spec.optional and value is None:
                continue
            if spec.type is int:
                _int(self, spec.name, minimum=spec.bounds.get("ge"), maximum=spec.bounds.get("le"))
            elif spec.type is float:
                _float(self, spec.name, lo=spec.bounds.get("ge", spec.bounds.get("gt")), hi=spec.bounds.get("le"),
                       lo_open="gt" in spec.bounds, rule=spec.rule)
            elif spec.type is bool and not isinstance(value, bool):
                raise ValueError(f"{spec.name} must be a boolean, got {value!r}")
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError("stop must be a string or a list of non-empty strings")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop may hold at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}")
        if any(len(s) > MAX_STOP_STRING_CHARS for s in self.stop):
            raise ValueError(f"each stop string must be at most {MAX_STOP_STRING_CHARS} characters")
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be a list of non-negative integers")


@dataclass(frozen=True)
class SamplingField:
    """One field of SamplingParams as the parsers see it."""

    name: str
    type: builtins.type  # int, float, bool, str, list or StructuredOutput
    item: builtins.type | None  # a list's element type (`type` above shadows the builtin in this class body)
    optional: bool  # None is allowed (and means "not set")
    default: Any
    bounds: dict[str, float]  # ge / gt / le

    @property
    def rule(self) -> str:
        """The bounds in words, as error messages say them: "in (0, 1]", ">= 1", "a finite number"."""
        lo_key = "gt" if "gt" in self.bounds else "ge"
        lo, hi = self.bounds.get(lo_key), self.bounds.get("le")
        if lo is not None and hi is not None:
            return f"in {'(' if lo_key == 'gt' else '['}{_num(lo)}, {_num(hi)}]"
        if lo is not None:
            return f"{'>' if lo_key == 'gt' else '>='} {_num(lo)}"
        return f"<= {_num(hi)}" if hi is not None else "a finite number"


def _num(value: float) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def _describe(cls: type) -> dict[str, SamplingField]:
    hints = typing.get_type_hints(cls)
    described = {}
    for f in fields(cls):
        hint, optional = hints[f.name], False
        if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
            members = [a for a in typing.get_args(hint) if a is not type(None)]
            optional = len(members) < len(typing.get_args(hint))
            if len(members) != 1:
                raise TypeError(f"SamplingParams.{f.name}: a union of several types ({hint}) cannot be parsed")
            hint = members[0]
        origin = typing.get_origin(hint) or hint
        item = typing.get_args(hint)[0] if origin is list else None
        if origin not in (int, float, bool, str, list, StructuredOutput):
            raise TypeError(f"SamplingParams.{f.name}: the parsers know int, float, bool, str, list and "
                            f"StructuredOutput, not {hint}")
        if f.default is not MISSING:
            default = f.default
        elif f.default_factory is not MISSING:
            default = f.default_factory()
        else:
            raise TypeError(f"SamplingParams.{f.name}: a field needs a default")
        described[f.name] = SamplingField(f.name, origin, item, optional, default, dict(f.metadata))
    return described


SAMPLING_FIELDS: dict[str, SamplingField] = _describe(SamplingParams)


def _int(p: SamplingParams, name: str, minimum: float | None = None, maximum: float | None = None) -> None:
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
