"""Parse and validate Triton requests (docs/serving.md#the-models): pure functions over numpy arrays and dicts,
raising ValueError naming the field and the rule. The sampling fields follow `SAMPLING_FIELDS`."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from tritium.backend.sampling_params import SAMPLING_FIELDS, SamplingParams
from tritium.backend.tokenizer import check_chat_template_kwargs

MAX_PROMPT_BYTES = 1 << 20  # 1 MiB of UTF-8: longer prompts are refused before tokenization
# vLLM's other names of `structured_output`, as Triton's vLLM backend takes them.
STRUCTURED_OUTPUT_ALIASES = ("structured_outputs", "guided_decoding")
FLAG_INPUTS = ("stream", "exclude_input_in_output", "return_finish_reason", "return_num_input_tokens",
               "return_num_output_tokens", "return_num_cached_tokens", "return_logprobs", "apply_chat_template")
CHAT_TEMPLATE_KWARGS = "chat_template_kwargs"  # an input or a request parameter, with apply_chat_template


@dataclass
class EngineRequest:
    """What a Triton request becomes a Job with; a text prompt is tokenized on the loop's tokenizer thread."""

    params: SamplingParams
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    lora_name: str | None = None  # the LoRA adapter to run on (None: the base model)


@dataclass
class TextRequest(EngineRequest):
    """The text model's request; with `apply_chat_template` the model renders `prompt` as the user turn."""

    stream: bool = False
    exclude_input_in_output: bool = False
    return_finish_reason: bool = False
    return_num_input_tokens: bool = False
    return_num_output_tokens: bool = False
    return_num_cached_tokens: bool = False
    return_logprobs: bool = False
    apply_chat_template: bool = False
    chat_template_kwargs: dict[str, Any] | None = None  # extra variables of the chat template


def _as_bool(name: str, value: Any) -> bool:
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
        return value.lower() in ("true", "1")
    if isinstance(value, (int, np.integer)) and value in (0, 1):
        return bool(value)
    raise ValueError(f"{name} must be a boolean, got {value!r}")


def coerce_field(name: str, value: Any) -> Any:
    """`value` coerced to field `name`'s declared type: numbers may come as strings (genai-perf sends them so)
    or numpy scalars, lists as JSON text. What cannot be coerced is returned as is, for SamplingParams to refuse."""
    spec = SAMPLING_FIELDS[name]
    if isinstance(value, np.generic):
        value = value.item()
    if spec.type is bool:
        return _as_bool(name, value)
    if spec.type is int and isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            raise ValueError(f"{name} must be an integer, got {value!r}") from None
    if spec.type is int and isinstance(value, float) and value.is_integer() and math.isfinite(value):
        return int(value)
    if spec.type is float and isinstance(value, str):
        try:
            return float(value.strip())
        except ValueError:
            raise ValueError(f"{name} must be a number, got {value!r}") from None
    if spec.type is list and isinstance(value, str):
        text = value.strip()
        if text.startswith("["):
            try:
                return json.loads(text)
            except json.JSONDecodeError:
                raise ValueError(f"{name} must be a list or a JSON list, got {value!r}") from None
        if spec.item is str:
            return [value]
        raise ValueError(f"{name} must be a list or a JSON list, got {value!r}")
    return value


def sampling_from_dict(raw: dict[str, Any], strict: bool = True) -> SamplingParams:
    """Raises ValueError naming the field, and for unknown keys when `strict` (else they are left out)."""
    raw = _resolve_aliases(raw)
    unknown = sorted(set(raw) - set(SAMPLING_FIELDS))
    if unknown and strict:
        raise ValueError(f"unknown sampling field(s): {', '.join(unknown)}")
    values = {k: coerce_field(k, v) for k, v in raw.items() if k in SAMPLING_FIELDS and v is not None}
    return SamplingParams.from_dict(values)


def _resolve_aliases(raw: dict[str, Any]) -> dict[str, Any]:
    """`raw` with `structured_outputs` / `guided_decoding` renamed to `structured_output` (only one may be set)."""
    named = [k for k in ("structured_output", *STRUCTURED_OUTPUT_ALIASES) if raw.get(k) is not None]
    if len(named) > 1:
        raise ValueError(f"set only one of {', '.join(named)}")
    if not named or named[0] == "structured_output":
        return raw
    out = {k: v for k, v in raw.items() if k not in STRUCTURED_OUTPUT_ALIASES}
    out["structured_output"] = raw[named[0]]
    return out


def parse_sampling_json(text: str) -> dict[str, Any]:
    """The `sampling_parameters` JSON object; raises ValueError when `text` is not one."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"sampling_parameters must be a JSON object: {exc.msg} at position {exc.pos}") from None
    except RecursionError:
        raise ValueError("sampling_parameters is nested too deeply") from None
    if not isinstance(value, dict):
        raise ValueError(f"sampling_parameters must be a JSON object, got {type(value).__name__}")
    return value


def scalar(name: str, array: npt.NDArray[Any] | None) -> Any:
    """The single element of an input tensor (shape [1] or [1, 1]), or None when absent."""
    if array is None:
        return None
    if array.size != 1:
        raise ValueError(f"{name} must hold exactly one element, got shape {list(array.shape)}")
    return array.reshape(-1)[0]


def decode_text(name: str, value: Any) -> str:
    """Raises ValueError for invalid UTF-8, a text over MAX_PROMPT_BYTES or a type other than bytes and str."""
    if isinstance(value, bytes):
        if len(value) > MAX_PROMPT_BYTES:
            raise ValueError(f"{name} is {len(value)} bytes; the limit is {MAX_PROMPT_BYTES} bytes")
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(f"{name} is not valid UTF-8 (byte {exc.start})") from None
    if isinstance(value, str):
        if len(value.encode("utf-8")) > MAX_PROMPT_BYTES:
            raise ValueError(f"{name} is longer than the limit of {MAX_PROMPT_BYTES} bytes")
        return value
    raise ValueError(f"{name} must be a string (BYTES tensor), got {type(value).__name__}")


def parse_lora_name(value: Any) -> str | None:
    """None for null; raises ValueError unless it is a non-empty string (or bytes)."""
    if value is None:
        return None
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, bytes):
        value = decode_text("lora_name", value)
    if not isinstance(value, str) or not value:
        raise ValueError(f"lora_name must be a non-empty string (a loaded LoRA adapter's name), got {value!r}")
    return value


def read_flag(name: str, inputs: dict[str, npt.NDArray[Any] | None]) -> bool:
    """A boolean input tensor's value; False when absent. Raises ValueError naming it."""
    value = scalar(name, inputs.get(name))
    return False if value is None else _as_bool(name, value)


def parse_chat_template_kwargs(value: Any) -> dict[str, Any] | None:
    """`chat_template_kwargs`: a JSON object (as text, from an input tensor or a request parameter) whose keys
    become variables of the chat template; None for null. Raises ValueError naming it."""
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, (bytes, str)):
        text = decode_text(CHAT_TEMPLATE_KWARGS, value)
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{CHAT_TEMPLATE_KWARGS} must be a JSON object: {exc.msg} at position {exc.pos}"
                             ) from None
        except RecursionError:
            raise ValueError(f"{CHAT_TEMPLATE_KWARGS} is nested too deeply") from None
    return None if value is None else check_chat_template_kwargs(value)


def parse_text_request(inputs: dict[str, npt.NDArray[Any] | None], parameters: dict[str, Any]) -> TextRequest:
    """`inputs`: None where absent. Sampling fields and `lora_name` come from `sampling_parameters` (JSON) and
    the request parameters, which win; the flags and `chat_template_kwargs` (JSON, only with
    `apply_chat_template`) from their inputs and the request parameters, which win. Raises ValueError naming the
    field and the rule."""
    raw_text = scalar("text_input", inputs.get("text_input"))
    if raw_text is None:
        raise ValueError("text_input is required")
    prompt = decode_text("text_input", raw_text)
    if not prompt:
        raise ValueError("text_input must not be empty")
    sampling: dict[str, Any] = {}
    raw_sampling = scalar("sampling_parameters", inputs.get("sampling_parameters"))
    if raw_sampling is not None:
        sampling.update(parse_sampling_json(decode_text("sampling_parameters", raw_sampling)))
    lora_name = parse_lora_name(sampling.pop("lora_name", None))
    flags = {name: _as_bool(name, v) for name in FLAG_INPUTS if (v := scalar(name, inputs.get(name))) is not None}
    template_kwargs = parse_chat_template_kwargs(scalar(CHAT_TEMPLATE_KWARGS, inputs.get(CHAT_TEMPLATE_KWARGS)))
    for key, value in parameters.items():
        if key.startswith("triton_"):
            continue  # client/transport settings such as triton_enable_empty_final_response
        if key in FLAG_INPUTS:
            flags[key] = _as_bool(key, value)
        elif key == CHAT_TEMPLATE_KWARGS:
            template_kwargs = parse_chat_template_kwargs(value)
        elif key == "lora_name":
            lora_name = parse_lora_name(value)
        elif key in SAMPLING_FIELDS or key in STRUCTURED_OUTPUT_ALIASES:
            sampling[key] = value
        else:
            raise ValueError(f"unknown request parameter {key!r}")
    flags.setdefault("exclude_input_in_output", flags.get("apply_chat_template", False))  # a chat reply alone
    if template_kwargs is not None and not flags.get("apply_chat_template", False):
        raise ValueError(f"{CHAT_TEMPLATE_KWARGS} is only used with apply_chat_template")
    # A text request has no token ids; naming that leaves `flags` only the boolean fields to fill.
    return TextRequest(prompt=prompt, prompt_token_ids=None, params=sampling_from_dict(sampling), lora_name=lora_name,
                       chat_template_kwargs=template_kwargs, **flags)
