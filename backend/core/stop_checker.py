"""When a request stops: `StopChecker` on token ids, `StopStrings` on the text as it is released."""

from __future__ import annotations

from tritium.backend.core.sequence import Sequence


class StopChecker:
    def __init__(self, eos_token_ids: list[int]) -> None:
        self.eos_token_ids = frozenset(eos_token_ids)

    def check(self, seq: Sequence) -> str | None:
        """After a token is appended: "stop" (EOS unless ignore_eos, or a stop id, once min_tokens are out),
        "length" or None."""
        p = seq.params
        n = seq.num_output_tokens
        token = seq.token_ids[-1]
        if n >= p.min_tokens and ((not p.ignore_eos and token in self.eos_token_ids) or token in p.stop_token_ids):
            return "stop"
        if n >= p.max_tokens:
            return "length"
        return None


class StopStrings:
    """Holds back text that could still become a stop string; releases nothing after one."""

    def __init__(self, stop: list[str], include_stop_str: bool = False) -> None:
        self.stop = [s for s in stop if s]
        self.include_stop_str = include_stop_str
        self.max_len = max((len(s) for s in self.stop), default=0)
        self.held = ""  # the tail not released yet (shorter than the longest stop string)
        self.stopped = False

    def feed(self, text: str) -> str:
        """What of `text` may be released now: once a stop string appears (`stopped`), the text up to it (through
        it with include_stop_str), then nothing."""
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
        """At the end of generation: the held tail."""
        held, self.held = self.held, ""
        return "" if self.stopped else held

    def _possible_start(self, text: str) -> int:
        """Length of the longest tail of `text` that is a proper prefix of a stop string."""
        for n in range(min(self.max_len - 1, len(text)), 0, -1):
            tail = text[-n:]
            if any(s.startswith(tail) for s in self.stop):
                return n
        return 0
