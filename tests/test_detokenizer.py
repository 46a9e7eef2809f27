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


def _stop_prefix_len(text: str, stop: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `stop` (what must be held)."""
    return max((n for n in range(1, len(stop)) if text.endswith(stop[:n])), default=0)


def test_partial_stop_prefix_is_held_then_released(tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok, [], stop=["<END>"])
    emitted = ""
    for t in tok.encode("hello <EN"):
        assert not detok.add_token(t)
        emitted += detok.take_delta(False)
        assert emitted == detok.text[: len(detok.text) - _stop_prefix_len(detok.text, "<END>")]
    assert detok.text == "hello <EN" and emitted == "hello "  # "<EN" could still become "<END>": held
    assert detok.take_delta(False) == ""  # asking again while held sends nothing
    for t in tok.encode("TER the room"):
        assert not detok.add_token(t)
        delta = detok.take_delta(False)
        assert "<EN" not in emitted or "<EN" not in delta  # released once, never twice
        emitted += delta
    # "<ENT" can no longer be "<END>": released while generation goes on, not only at the end.
    assert detok.text == emitted == "hello <ENTER the room"
    assert detok.take_delta(True) == ""


def test_partial_stop_prefix_that_completes_is_never_released(tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok, [], stop=["<END>"])
    for t in tok.encode("hello <EN"):
        detok.add_token(t)
    assert detok.take_delta(False) == "hello "
    for t in tok.encode("D> no"):
        if detok.add_token(t):
            break
    assert detok.take_delta(False) + detok.take_delta(True) == "" and detok.text == "hello "
