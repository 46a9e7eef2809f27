"""Tokenizer folders with chat templates of their own: the default model's tokenizer, another template."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from support.checkpoints import TOKENIZER_FILES

# Qwen3's rule for `enable_thinking`, on a ChatML template: false closes an empty think block in the prompt. It
# raises (with text no client may see) on a non-boolean enable_thinking, and fails on a thinking_budget that
# is not a number (a TypeError inside the template, not a jinja error).
TEMPLATE_SECRET = "SECRET-7c1e template text"
THINKING_TEMPLATE = (
    "{%- if enable_thinking is defined and enable_thinking is not boolean %}"
    "{{- raise_exception('" + TEMPLATE_SECRET + ": enable_thinking must be a boolean') }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- if thinking_budget is defined %}{{- 'budget ' + (thinking_budget + 1) | string + '\\n' }}{%- endif %}"
    "{%- endif %}"
)
NO_THINKING = "<think>\n\n</think>\n\n"


def tokenizer_folder_with_template(dest: Path, tokenizer_from: Path, template: str = THINKING_TEMPLATE) -> Path:
    """`dest` holding `tokenizer_from`'s tokenizer files with `template` as the chat template."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer_from / name, dest / name)
    config_path = dest / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["chat_template"] = template
    config_path.write_text(json.dumps(config), encoding="utf-8")
    return dest
