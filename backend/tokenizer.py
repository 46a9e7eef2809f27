"""A model folder's tokenizer (tokenizer.json through `tokenizers`) and its chat template."""

from __future__ import annotations

import json
from datetime import datetime
from functools import cache, cached_property
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from tritium.backend.model_config import ModelFolderError

GIL_FREE_ENCODE_CHARS = 4096
TOKENIZER_NICE = 10  # serving tokenizes at this nice value: big prompts must not stall running streams


def _token_text(value: Any) -> str | None:
    """The string itself, or an AddedToken object's `content`."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _tojson(value: Any, indent: int | None = None, separators: tuple[str, str] | None = None,
            sort_keys: bool = False) -> str:
    """transformers' `tojson`: unlike jinja's, no HTML escapes of <, > and &, which tool templates must not show."""
    return json.dumps(value, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)


def _template_env() -> ImmutableSandboxedEnvironment:
    """The environment transformers renders chat templates in."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])

    def raise_exception(message: str) -> None:
        raise ValueError(f"chat template: {message}")

    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


# What `Tokenizer.apply_chat_template` passes the template itself: extra variables may not take these names.
RENDER_VARIABLES = ("messages", "tools", "add_generation_prompt", "bos_token", "eos_token")
CHAT_TEMPLATE_KWARGS_FAILED = ("chat_template_kwargs: the model's chat template cannot be rendered with these "
                               "values")


class ChatTemplateKwargsError(ValueError):
    """`chat_template_kwargs` that the chat template cannot take; the message names the field and never quotes
    the template's own exception."""


def _is_json(value: Any, depth: int = 0) -> bool:
    """Whether `value` is what JSON holds: null, a boolean, a number, a string, a list or an object of them."""
    if depth > 64:
        return False
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if isinstance(value, (list, tuple)):
        return all(_is_json(v, depth + 1) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _is_json(v, depth + 1) for k, v in value.items())
    return False


@cache
def _reserved_names() -> frozenset[str]:
    return frozenset(RENDER_VARIABLES) | frozenset(_template_env().globals)


def check_chat_template_kwargs(kwargs: Any) -> dict[str, Any]:
    """`kwargs` if it can be passed to a chat template as extra variables: an object of JSON values whose keys
    are not names the renderer passes itself (`RENDER_VARIABLES`) nor the environment's globals
    (`raise_exception`, `namespace`, ...). Raises ChatTemplateKwargsError naming `chat_template_kwargs`."""
    if not isinstance(kwargs, dict):
        raise ChatTemplateKwargsError(f"chat_template_kwargs must be a JSON object, got {type(kwargs).__name__}")
    reserved = _reserved_names()
    if taken := sorted(repr(k) for k in kwargs if not isinstance(k, str) or k in reserved):
        raise ChatTemplateKwargsError(f"chat_template_kwargs: {', '.join(taken)} may not be set (the renderer "
                                      f"passes {', '.join(sorted(reserved))} itself)")
    if bad := sorted(repr(k) for k, v in kwargs.items() if not _is_json(v)):
        raise ChatTemplateKwargsError(f"chat_template_kwargs: {', '.join(bad)} must hold JSON values")
    return kwargs


class Tokenizer:
    """Encode/decode with the exact fast-tokenizer behaviour transformers uses for the same file."""

    def __init__(self, folder: str | Path) -> None:
        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise ModelFolderError(f"model folder {folder} has no tokenizer.json")
        self._tok = HFTokenizer.from_file(str(path))
        cfg_path = folder / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text(encoding="utf-8")) if cfg_path.is_file() else {}
        template = cfg.get("chat_template")
        template_file = folder / "chat_template.jinja"
        if template is None and template_file.is_file():
            template = template_file.read_text(encoding="utf-8")
        if isinstance(template, list):  # named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        self.chat_template: str | None = template
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.special_ids = {
            i for i, t in self._tok.get_added_tokens_decoder().items() if t.special
        }

    @cached_property
    def max_token_bytes(self) -> int:
        """The most UTF-8 bytes one token's text takes (decodes the whole vocabulary on first use)."""
        texts = self._tok.decode_batch([[i] for i in range(self.vocab_size)], skip_special_tokens=False)
        return max(len(t.encode("utf-8", "surrogatepass")) for t in texts)

    def check_can_fit(self, text: str, max_tokens: int) -> None:
        """Raises ValueError when `text` has more UTF-8 bytes than `max_tokens` tokens can cover."""
        max_bytes = max_tokens * self.max_token_bytes
        if len(text.encode("utf-8", "surrogatepass")) > max_bytes:
            raise ValueError(f"prompt is longer than the model's context of {max_tokens} tokens could hold "
                             f"(more than {max_bytes} bytes)")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """A long text goes through `encode_batch`, which releases the GIL (`encode` holds it)."""
        if len(text) < GIL_FREE_ENCODE_CHARS:
            return self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    @property
    def hf(self) -> HFTokenizer:
        """The tokenizers library's own tokenizer (for its incremental `DecodeStream`)."""
        return self._tok

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def user_turn(self, text: str, chat_template_kwargs: dict[str, Any] | None = None) -> str:
        """`text` as the chat template's user turn, ready for the reply. Raises ValueError without a template,
        ChatTemplateKwargsError when it cannot take `chat_template_kwargs`."""
        return self.apply_chat_template([{"role": "user", "content": text}],
                                        chat_template_kwargs=chat_template_kwargs)

    @cached_property
    def supports_tools(self) -> bool:
        """Whether the chat template takes `tools` (it references the variable)."""
        if not self.chat_template:
            return False
        try:
            return "tools" in jinja2.meta.find_undeclared_variables(_template_env().parse(self.chat_template))
        except jinja2.TemplateError:
            return False

    @cached_property
    def _compiled_template(self) -> jinja2.Template:
        """Raises ValueError when the model has no chat template."""
        if not self.chat_template:
            raise ValueError("this model has no chat template; pass a plain prompt instead")
        return _template_env().from_string(self.chat_template)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None, chat_template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """`tools`: OpenAI's function objects, passed as transformers passes them; `chat_template_kwargs`: extra
        variables of the template (`enable_thinking`), checked by `check_chat_template_kwargs`. Raises ValueError
        when the model has no template or it rejects the messages, ChatTemplateKwargsError when it rejects the
        extra variables (it renders without them); the template may raise anything else on what the messages
        hold."""
        extra = check_chat_template_kwargs(chat_template_kwargs) if chat_template_kwargs is not None else {}
        if not extra:
            return self._render(messages, add_generation_prompt, tools, {})
        try:
            return self._render(messages, add_generation_prompt, tools, extra)
        except Exception as exc:
            try:
                self._render(messages, add_generation_prompt, tools, {})
            except Exception:
                raise  # the messages' fault: the error they get without extra variables
            raise ChatTemplateKwargsError(CHAT_TEMPLATE_KWARGS_FAILED) from exc

    def _render(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
                tools: list[dict[str, Any]] | None, extra: dict[str, Any]) -> str:
        try:
            return self._compiled_template.render(
                **extra,
                messages=messages,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        except jinja2.TemplateError as exc:
            raise ValueError(f"chat template failed: {exc}") from exc
