"""Incremental detokenization on the real default tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest

from tritium.backend.detokenizer import IncrementalDetokenizer
from tritium.backend.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok(default_model_path: Path) -> Tokenizer:
    return Tokenizer(default_model_path)


def stream(tok: Tokenizer, text: str, stop: list[str] | None = None, include: bool = False) -> tuple[list[str], str]:
    prompt = tok.encode("Say:")
    detok = IncrementalDetokenizer(tok, prompt, stop=stop, include_stop_str_in_output=include)
    deltas = []
    for t in tok.encode(text):
        stopped = detok.add_token(t)
        deltas.append(detok.take_delta(stopped))
        if stopped:
            break
    detok.flush()
    deltas.append(detok.take_delta(True))
    return [d for d in deltas if d], detok.text


def test_multibyte_characters_are_never_split(tok: Tokenizer) -> None:
    text = " 日本語のテキスト 🎉🚀 naïve café Ω"
    ids = tok.encode(text)
    assert len(ids) > len(text.split())  # several tokens per character somewhere
    deltas, full = stream(tok, text)
    assert "".join(deltas) == full == text
    assert all("\ufffd" not in d for d in deltas)


def test_leading_space_of_first_token_is_kept(tok: Tokenizer) -> None:
    assert stream(tok, " Paris is big")[1] == " Paris is big"


def test_stop_string_cuts_text_before_it_and_is_never_streamed(tok: Tokenizer) -> None:
    deltas, full = stream(tok, "one two three STOP four five", stop=["STOP"])
    assert full == "one two three "
    assert "".join(deltas) == full


def test_stop_string_included_on_request(tok: Tokenizer) -> None:
    assert stream(tok, "alpha beta gamma", stop=["beta"], include=True)[1] == "alpha beta"


def test_partial_stop_prefix_is_held_then_released(tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok, [], stop=["<END>"])
    ids = tok.encode("hello <EN")
    for t in ids:
        detok.add_token(t)
    assert detok.take_delta(False) == "hello "  # "<EN" could still become "<END>"
    for t in tok.encode("D> no"):
        if detok.add_token(t):
            break
    assert detok.take_delta(False) + detok.take_delta(True) == "" and detok.text == "hello "
