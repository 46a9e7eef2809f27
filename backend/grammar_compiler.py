"""Compile a request's `StructuredOutput` into an llguidance matcher for this engine's tokenizer, with a cache.

Compiling happens off the engine thread (the serving loop's tokenizer thread calls `compile`), with a time
limit; the engine takes a copy of the cached matcher when it admits the request. A constraint llguidance
cannot enforce fails here with a ValueError naming what it refused ("Unimplemented keys: [\"not\"]"), and
that verdict is cached too, so a client repeating a bad schema costs nothing.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

import llguidance
from llguidance.gbnf_to_lark import any_to_lark

from tritium.backend.structured_output import StructuredOutput
from tritium.backend.tokenizer import Tokenizer

DEFAULT_COMPILE_TIMEOUT_S = 10.0
DEFAULT_CACHE_SIZE = 1024


@dataclass
class CompileStats:
    """What `compile` did, cumulatively (the benchmark and the metrics read it)."""

    compiled: int = 0
    cache_hits: int = 0
    compile_s: float = 0.0


class GrammarCompiler:
    """Matchers for one tokenizer. Thread-safe: any thread may compile; matchers it returns are the caller's."""

    def __init__(self, tokenizer: Tokenizer, eos_token_ids: list[int], timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S,
                 cache_size: int = DEFAULT_CACHE_SIZE) -> None:
        self.timeout_s = timeout_s
        self.cache_size = cache_size
        self.stats = CompileStats()
        self._tokenizer_json = tokenizer.hf.to_str()
        self._eos = list(eos_token_ids)
        self._lock = threading.Lock()
        self._cache: OrderedDict[StructuredOutput, llguidance.LLMatcher | str] = OrderedDict()
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="tritium-grammar")

    @property
    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's view of the vocabulary (~0.5 s to build for 49k tokens: built at the first use)."""
        with self._lock:
            if self._ll_tokenizer is None:
                self._ll_tokenizer = llguidance.LLTokenizer(self._tokenizer_json, eos_token=self._eos)
            return self._ll_tokenizer

    @property
    def vocab_size(self) -> int:
        return self.ll_tokenizer.vocab_size

    def compile(self, spec: StructuredOutput) -> llguidance.LLMatcher:
        """A fresh matcher for `spec` at its start. Raises ValueError naming what cannot be enforced or the
        time limit that was exceeded."""
        with self._lock:
            cached = self._cache.get(spec)
            if cached is not None:
                self._cache.move_to_end(spec)
                self.stats.cache_hits += 1
        if cached is None:
            t0 = time.perf_counter()
            cached = self._compile_within_limit(spec)
            with self._lock:
                self.stats.compiled += 1
                self.stats.compile_s += time.perf_counter() - t0
                self._cache[spec] = cached
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
        if isinstance(cached, str):
            raise ValueError(cached)
        return cached.deep_copy()

    def _compile_within_limit(self, spec: StructuredOutput) -> llguidance.LLMatcher | str:
        """The compiled matcher, or the error message saying why there is none."""
        tokenizer = self.ll_tokenizer
        job = self._pool.submit(_compile, tokenizer, spec)
        try:
            return job.result(timeout=self.timeout_s)
        except FutureTimeout:  # the compile goes on in its thread; llguidance's own limits end it
            return (f"structured_output.{spec.kind} did not compile within {self.timeout_s:g} s; simplify it")


def _compile(tokenizer: llguidance.LLTokenizer, spec: StructuredOutput) -> llguidance.LLMatcher | str:
    kind, source = spec.lark_or_json_grammar()
    try:
        if kind == "json":
            grammar = llguidance.LLMatcher.grammar_from_json_schema(source, defaults=spec.json_options())
        elif kind == "regex":
            grammar = llguidance.LLMatcher.grammar_from_regex(source)
        else:
            grammar = llguidance.LLMatcher.grammar_from_lark(any_to_lark(source))
    except Exception as exc:  # a malformed GBNF grammar, a schema llguidance cannot read
        return f"structured_output.{spec.kind} is not valid: {_summary(str(exc))}"
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
    if matcher.is_error():
        return f"structured_output.{spec.kind} cannot be enforced: {_summary(matcher.get_error())}"
    return matcher


def _summary(message: str, limit: int = 400) -> str:
    """llguidance's message on one line: its indented lines (an excerpt of the source, a caret under the
    spot) are left out."""
    lines = [line.strip() for line in message.splitlines() if line.strip() and not line[0].isspace()]
    text = " ".join(lines) or "unknown error"
    return text if len(text) <= limit else text[: limit - 3] + "..."
