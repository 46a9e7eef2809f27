"""What a request's output must match (`SamplingParams.structured_output`, in vLLM's shapes: docs/structured-output.md),
and its grammar for llguidance. Whether it can be enforced is known only once compiled (compiler.py)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # a TypedDict of llguidance's stubs only

KINDS = ("json", "json_object", "regex", "choice", "grammar")
# vLLM's options: `backend` names a library (tritium always uses llguidance), `disable_fallback` asks for no
# fallback to another library (there is none): both change nothing here.
IGNORED_OPTIONS = ("backend", "disable_fallback")
MAX_SOURCE_CHARS = 1 << 20  # a schema, regex or grammar longer than this is refused before compiling
# llguidance 1.9.1 masks and parses disagree on a literal whose UTF-8 starts with F1 or F2 (planes 4-11, which
# Unicode leaves unassigned): the mask allows a byte the parser then refuses. Such constraints are refused.
UNWRITABLE = re.compile("[\U00040000-\U000BFFFF]")


@dataclass(frozen=True)
class StructuredOutput:
    """One constraint. `json`: the schema as compact JSON text in its own key order (llguidance writes properties
    in that order; a schema sent again shares the compiled grammar)."""

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    whitespace_pattern: str | None = None
    any_whitespace: bool = False

    @classmethod
    def from_value(cls, value: Any) -> StructuredOutput:
        """From a dict (or its JSON text) in vLLM's shape. Raises ValueError naming the key and the rule."""
        if isinstance(value, StructuredOutput):
            return value
        value = _parsed(value, "structured_output must be a JSON object such as {\"json\": {...}}")
        if not isinstance(value, dict):
            raise ValueError(f"structured_output must be an object, got {type(value).__name__}")
        unknown = sorted(set(value) - {*KINDS, *IGNORED_OPTIONS, "whitespace_pattern", "disable_any_whitespace"})
        if unknown:
            raise ValueError(f"structured_output: unsupported key(s) {', '.join(unknown)}; supported: "
                             f"{', '.join(KINDS)} (one of them), whitespace_pattern, disable_any_whitespace")
        given = [k for k in KINDS if value.get(k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_output must set exactly one of {', '.join(KINDS)}; got "
                             f"{', '.join(given) or 'none'}")
        kind = given[0]
        fields: dict[str, Any] = {kind: _source(kind, value[kind])}
        if (pattern := value.get("whitespace_pattern")) is not None:
            fields["whitespace_pattern"] = _text("whitespace_pattern", pattern)
        if (compact := value.get("disable_any_whitespace")) is not None:
            if not isinstance(compact, bool):
                raise ValueError("structured_output.disable_any_whitespace must be a boolean")
            fields["any_whitespace"] = not compact
        return cls(**fields)

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def to_dict(self) -> dict[str, Any]:
        """The request's shape again (what `from_value` takes)."""
        out: dict[str, Any] = {self.kind: json.loads(self.json) if self.json is not None else getattr(self, self.kind)}
        if self.choice is not None:
            out["choice"] = list(self.choice)
        if self.whitespace_pattern is not None:
            out["whitespace_pattern"] = self.whitespace_pattern
        if self.any_whitespace:
            out["disable_any_whitespace"] = False
        return out

    def lark_or_json_grammar(self) -> tuple[str, str]:
        """(kind, source) for the compiler: "json" with a schema's text, "regex", or "lark" with a grammar."""
        if self.json is not None or self.json_object:
            return "json", self.json if self.json is not None else '{"type":"object"}'
        if self.regex is not None:
            return "regex", self.regex
        if self.choice is not None:  # a Lark rule of JSON-quoted literals (characters beyond the BMP as they are:
            # llguidance reads a \ud83d\ude00 escape pair as two lone surrogates, not one character)
            return "lark", "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in self.choice)
        assert self.grammar is not None
        return "lark", self.grammar

    @property
    def source_bytes(self) -> int:
        """The size of what is compiled (the schema's JSON text, the regex, the grammar), in UTF-8 bytes."""
        return len(self.lark_or_json_grammar()[1].encode("utf-8", "surrogatepass"))

    def json_options(self) -> JsonCompileOptions:
        flexible = self.any_whitespace or self.whitespace_pattern is not None
        options: JsonCompileOptions = {"whitespace_flexible": flexible}
        if self.whitespace_pattern is not None:
            options["whitespace_pattern"] = self.whitespace_pattern
        return options


def _parsed(value: Any, error: str) -> Any:
    """`value`, or what its JSON text holds when it is a string; ValueError(`error`) when that is not JSON."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except (json.JSONDecodeError, RecursionError):
        raise ValueError(error) from None


def _text(name: str, value: Any, characters: str | None = None) -> str:
    """`value` when it is a usable source; `characters`: its characters when `value` escapes them (JSON)."""
    if not isinstance(value, str) or not value:
        raise ValueError(f"structured_output.{name} must be a non-empty string")
    if len(value) > MAX_SOURCE_CHARS:
        raise ValueError(f"structured_output.{name} is longer than {MAX_SOURCE_CHARS} characters")
    if (bad := UNWRITABLE.search(characters if characters is not None else value)) is not None:
        raise ValueError(f"structured_output.{name} holds U+{ord(bad.group()):X}: characters U+40000-U+BFFFF "
                         "(unassigned planes 4-11) cannot be enforced")
    return value


def _source(kind: str, value: Any) -> Any:
    if kind == "json_object":
        if value is not True:
            raise ValueError("structured_output.json_object must be true")
        return True
    if kind == "json":
        value = _parsed(value, "structured_output.json must be a JSON schema (an object, or its JSON text)")
        if not isinstance(value, (dict, bool)):
            raise ValueError("structured_output.json must be a JSON schema (an object)")
        try:
            text = json.dumps(value, separators=(",", ":"))  # key order kept: properties come out in it
            characters = json.dumps(value, ensure_ascii=False)
        except (ValueError, RecursionError):
            raise ValueError("structured_output.json is nested too deeply") from None
        return _text("json", text, characters)
    if kind == "choice":
        if not isinstance(value, (list, tuple)) or not value:
            raise ValueError("structured_output.choice must be a non-empty list of strings")
        if not all(isinstance(c, str) and c for c in value):
            raise ValueError("structured_output.choice must hold non-empty strings")
        _text("choice", "".join(value))
        return tuple(value)
    return _text(kind, value)
