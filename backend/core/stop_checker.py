"""When a request stops: EOS, stop token ids, min_tokens and max_tokens (`StopChecker`, on token ids), and
stop strings (`StopStrings`, on the text as it is released)."""

from __future__ import annotations

from tritium.backend.core.sequence import Sequence


class StopChecker:
    def __init__(self, eos_token_ids: list[int]) -> None:
        self.eos_token_ids = frozenset(eos_token_ids)

    def check(self, seq: Sequence) -> str | None:
        """After a token was appended to `seq`: "stop" (EOS unless ignore_eos, or a stop token id, once
        min_tokens are out; the sampler bans them before), "length" (max_tokens reached) or None."""
        p = seq.params
        n = seq.num_output_tokens
        token = seq.token_ids[-1]
        if n >= p.min_tokens and ((not p.ignore_eos and token in self.eos_token_ids) or token in p.stop_token_ids):
            return "stop"
        if n >= p.max_tokens:
            return "length"
        return None


class StopStrings:
    """Finds stop strings in a request's text as it grows. Text that could still become a stop string is
    held back from the stream; text after a stop string is never released."""

    def __init__(self, stop: list[str], include_stop_str: bool = False) -> None:
        self.stop = [s for s in stop if s]
        self.include_stop_str = include_stop_str
        self.max_len = max((len(s) for s in self.stop), default=0)
        self.held = ""  # the tail not released yet (shorter than the longest stop string)
        self.stopped = False

    def feed(self, text: str) -> str:
        """Add newly decoded `text`; returns what may be released now. After a stop string appears
        (`stopped`), returns the text up to it (or through it with include_stop_str) and then nothing."""
        if self.stopped or not text:
            return ""
        window = self.held + text
        # The stop string that is complete first when the text is read a character at a time (the earliest end;
        # at the same end, the longest): the same verdict whatever the pieces the text arrives in.
        hits = [(i + len(s), i, s) for s in self.stop if (i := window.find(s)) >= 0]
        if hits:
            _, i, s = min(hits)
            self.stopped = True
            self.held = ""
            return window[: i + len(s)] if self.include_stop_str else window[:i]
        keep = self._possible_start(window)
        self.held = window[len(window) - keep:] if keep else ""
        return window[: len(window) - keep]

    def flush(self) -> str:
        """At the end of generation: the held tail (it never became a stop string)."""
        held, self.held = self.held, ""
        return "" if self.stopped else held

    def _possible_start(self, text: str) -> int:
        """Length of the longest tail of `text` that is a proper prefix of a stop string."""
        for n in range(min(self.max_len - 1, len(text)), 0, -1):
            tail = text[-n:]
            if any(s.startswith(tail) for s in self.stop):
                return n
        return 0
