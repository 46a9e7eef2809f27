"""Incremental detokenization and stop strings on the real default tokenizer."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tritium.backend.core.stop_checker import StopStrings
from tritium.backend.detokenizer import IncrementalDetokenizer
from tritium.backend.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok(default_model_path: Path) -> Tokenizer:
    return Tokenizer(default_model_path)


def stream(tok: Tokenizer, text: str, stop: list[str] | None = None, include: bool = False) -> tuple[list[str], str]:
    """The deltas a request generating `text` would stream, and its whole text (as the output processor does)."""
    detok = IncrementalDetokenizer(tok, tok.encode("Say:"))
    matcher = StopStrings(stop or [], include)
    deltas = []
    for t in tok.encode(text, add_special_tokens=False):
        deltas.append(matcher.feed(detok.add_token(t)))
        if matcher.stopped:
            break
    else:
        deltas.append(matcher.feed(detok.flush()) + matcher.flush())
    return [d for d in deltas if d], "".join(deltas)


def test_multibyte_characters_are_never_split(tok: Tokenizer) -> None:
    text = " 日本語のテキスト 🎉🚀 naïve café Ω"
    ids = tok.encode(text)
    assert len(ids) > len(text.split())  # several tokens per character somewhere
    deltas, full = stream(tok, text)
    assert full == text
    assert all("\ufffd" not in d for d in deltas)


def test_leading_space_of_first_token_is_kept(tok: Tokenizer) -> None:
    assert stream(tok, " Paris is big")[1] == " Paris is big"


def test_random_tokens_stream_exactly_what_a_whole_decode_gives(tok: Tokenizer) -> None:
    """Byte tokens out of order (what a random model emits) included: the streamed text plus the final flush
    equals decoding all the tokens at once."""
    rng = random.Random(0)
    for _ in range(50):
        ids = [rng.choice([rng.randrange(0, 300), rng.randrange(0, tok.vocab_size)]) for _ in range(60)]
        detok = IncrementalDetokenizer(tok, [])
        text = "".join(detok.add_token(t) for t in ids) + detok.flush()
        assert text == tok.decode(ids)


def test_stop_string_cuts_text_before_it_and_is_never_streamed(tok: Tokenizer) -> None:
    deltas, full = stream(tok, "one two three STOP four five", stop=["STOP"])
    assert full == "one two three "
    assert "STOP" not in "".join(deltas)


def test_stop_string_included_on_request(tok: Tokenizer) -> None:
    assert stream(tok, "alpha beta gamma", stop=["beta"], include=True)[1] == "alpha beta"


def test_partial_stop_prefix_is_held_then_released() -> None:
    matcher = StopStrings(["<END>"])
    assert matcher.feed("hello <EN") == "hello "  # "<EN" could still become "<END>": held
    assert matcher.feed("") == ""  # asking again while held sends nothing
    # "<ENT" can no longer be "<END>": released while generation goes on, not only at the end.
    assert matcher.feed("TER the room") == "<ENTER the room"
    assert not matcher.stopped and matcher.flush() == ""


def test_partial_stop_prefix_that_completes_is_never_released() -> None:
    matcher = StopStrings(["<END>"])
    assert matcher.feed("hello <EN") == "hello "
    assert matcher.feed("D> no") == "" and matcher.stopped
    assert matcher.feed("more") == "" and matcher.flush() == ""


def test_stop_string_spanning_many_pieces(tok: Tokenizer) -> None:
    full = stream(tok, "a b c d e f g", stop=[" d e f"])[1]
    assert full == "a b c"
