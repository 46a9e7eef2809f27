"""Compile a request's `StructuredOutput` into an llguidance matcher on the compiler's own threads, with a cache
bounded by bytes (docs/architecture.md#structured-output). The time limit counts the compile's CPU time, so a
constraint is refused for what it costs, not for how busy the host is."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tritium.backend.config import DEFAULT_GRAMMAR_CACHE_BYTES
from tritium.backend.structured_output.constraint import StructuredOutput
from tritium.backend.tokenizer import Tokenizer

if TYPE_CHECKING:
    import llguidance

logger = logging.getLogger(__name__)
DEFAULT_COMPILE_TIMEOUT_S = 10.0
COMPILE_WORKERS = 2
MAX_WAIT_FACTOR = 6  # however busy the host, a request waits at most this many time limits for its compile
MIN_RECHECK_S = 0.25  # a request's timer, rearmed while its compile may go on, waits at least this long
COMPILE_NICE = 15  # below the tokenizer thread's 10: tokenizing a prompt is quicker and more urgent
MATCHER_BYTES_PER_SOURCE_BYTE = 256
MATCHER_BASE_BYTES = 64 << 10
LLGUIDANCE_MISSING = ("structured_output needs the llguidance package, which is not installed "
                      "(pip install llguidance); unconstrained requests do not need it")

# (the matcher, None) or (None, why there is none)
Compiled = tuple["llguidance.LLMatcher | None", "str | None"]
CompileCallback = Callable[["llguidance.LLMatcher | None", "str | None"], None]


@dataclass
class CompileStats:
    """Cumulative counts (the benchmark and the metrics read them)."""

    compiled: int = 0
    cache_hits: int = 0
    compile_s: float = 0.0
    timeouts: int = 0
    evictions: int = 0


@dataclass
class _Entry:
    value: llguidance.LLMatcher | str  # the matcher at its start, or why the constraint cannot be enforced
    charge: int  # bytes counted against the cache's bound


def estimated_bytes(spec: StructuredOutput) -> int:
    """A compiled matcher's charge against the cache (an upper bound of measured sizes)."""
    return MATCHER_BASE_BYTES + MATCHER_BYTES_PER_SOURCE_BYTE * spec.source_bytes


class TimedCallback:
    """A request's callback, called once: with the compile's result (`answer`), or refused once the compile used
    `timeout_s` of CPU (`cpu_used`; None: not started) or MAX_WAIT_FACTOR times that passed on `clock`."""

    def __init__(self, timeout_s: float, spec: StructuredOutput, callback: CompileCallback, stats: CompileStats,
                 cpu_used: Callable[[], float | None], clock: Callable[[], float]) -> None:
        self.timeout_s = timeout_s
        self.spec = spec
        self.stats = stats
        self._cpu_used = cpu_used
        self._clock = clock
        self._started = clock()
        self._lock = threading.Lock()
        # self -> timer -> self is a reference cycle; emptying `_pending` on the first call lets the callback
        # (and the request it captures) go at once instead of at the next garbage collection.
        self._pending = [callback]
        self._timer: threading.Timer | None = None
        self._arm(timeout_s)

    def answer(self, matcher: llguidance.LLMatcher | None, error: str | None) -> None:
        callback = self._take()
        if callback is not None:
            callback(matcher, error)

    def check(self) -> bool:
        """Refuse the request if its compile is over the limit now. Returns whether it has been answered."""
        used, waited = self._cpu_used(), self._clock() - self._started
        if waited < MAX_WAIT_FACTOR * self.timeout_s and (used is None or used < self.timeout_s):
            with self._lock:
                return not self._pending
        callback = self._take()
        if callback is not None:
            self.stats.timeouts += 1
            callback(None, f"structured_output.{self.spec.kind} did not compile within {self.timeout_s:g} s; "
                           "simplify it")
        return True

    def _take(self) -> CompileCallback | None:
        with self._lock:
            if not self._pending:
                return None
            callback = self._pending.pop()
            timer, self._timer = self._timer, None
        if timer is not None:
            timer.cancel()
        return callback

    def _arm(self, delay_s: float) -> None:
        timer = threading.Timer(delay_s, self._expired)
        timer.daemon = True
        with self._lock:
            if not self._pending:
                return
            self._timer = timer
        timer.start()

    def _expired(self) -> None:
        if not self.check():  # not started, or the host is busy: it had less CPU than the limit
            self._arm(max(self.timeout_s - (self._cpu_used() or 0.0), MIN_RECHECK_S))


class GrammarCompiler:
    """Matchers for one tokenizer. Thread-safe: any thread may compile; matchers it returns are the caller's."""

    def __init__(self, tokenizer: Tokenizer, eos_token_ids: list[int], timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S,
                 cache_bytes: int = DEFAULT_GRAMMAR_CACHE_BYTES, clock: Callable[[], float] = time.monotonic) -> None:
        self.timeout_s = timeout_s
        self.cache_bytes = cache_bytes
        self.clock = clock
        self.stats = CompileStats()
        self._tokenizer_json = tokenizer.hf.to_str()
        self._eos = list(eos_token_ids)
        self._lock = threading.Lock()
        self._cache: OrderedDict[StructuredOutput, _Entry] = OrderedDict()
        self._cached_bytes = 0
        self._compiling: dict[StructuredOutput, list[TimedCallback]] = {}  # waiters of compiles under way
        self._running: dict[StructuredOutput, tuple[int, float]] = {}  # a running compile's CPU clock and start
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._pool = ThreadPoolExecutor(COMPILE_WORKERS, thread_name_prefix="tritium-grammar",
                                        initializer=_lower_priority)

    @property
    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's view of the vocabulary, built at the first use (it is slow to build)."""
        import llguidance

        with self._lock:
            if self._ll_tokenizer is None:
                self._ll_tokenizer = llguidance.LLTokenizer(self._tokenizer_json, eos_token=self._eos)
            return self._ll_tokenizer

    @property
    def vocab_size(self) -> int:
        return int(self.ll_tokenizer.vocab_size)

    @property
    def cached_bytes(self) -> int:
        """What the cached entries are charged, in all (at most `cache_bytes`)."""
        return self._cached_bytes

    def __len__(self) -> int:
        return len(self._cache)

    def compile(self, spec: StructuredOutput) -> llguidance.LLMatcher:
        """A fresh matcher, waiting for the compile. Raises ValueError naming what cannot be enforced or the
        time limit exceeded."""
        done = threading.Event()
        result: list[Compiled] = []

        def finished(matcher: llguidance.LLMatcher | None, error: str | None) -> None:
            result.append((matcher, error))
            done.set()

        self.submit(spec, finished)
        done.wait()
        matcher, error = result[0]
        if matcher is None:
            raise ValueError(error)
        return matcher

    def submit(self, spec: StructuredOutput, callback: CompileCallback) -> None:
        """Call `callback(matcher, None)` or `callback(None, why)` exactly once: at once on a cache hit, else from
        a compile or timer thread. Never raises; the callback must not raise."""
        if not llguidance_available():
            callback(None, LLGUIDANCE_MISSING)
            return
        with self._lock:
            entry = self._cache.get(spec)
            if entry is not None:
                self._cache.move_to_end(spec)
                self.stats.cache_hits += 1
            elif spec in self._compiling:  # the same constraint is being compiled: wait for that compile
                self._compiling[spec].append(self._timed(spec, callback))
                return
            else:
                self._compiling[spec] = [self._timed(spec, callback)]
        if entry is not None:
            _answer(callback, entry.value)
            return
        self._pool.submit(self._compile_and_answer, spec)

    def _compile_and_answer(self, spec: StructuredOutput) -> None:
        t0 = self.clock()
        try:
            tokenizer = self.ll_tokenizer  # built once per engine: not counted against a request's limit
            cpu_clock = _thread_cpu_clock()
            if cpu_clock is not None:
                with self._lock:
                    self._running[spec] = (cpu_clock, time.clock_gettime(cpu_clock))
            value = _compile(tokenizer, spec)
        except Exception as exc:  # llguidance failed in a way it does not report as a grammar error
            value = f"structured_output.{spec.kind} could not be compiled: {_summary(str(exc))}"
        with self._lock:
            self._running.pop(spec, None)
            self.stats.compiled += 1
            self.stats.compile_s += self.clock() - t0
            self._store(spec, value)
            waiters = self._compiling.pop(spec, [])
        for waiter in waiters:
            _answer(waiter.answer, value)

    def check_time_limits(self) -> None:
        """Refuse now every waiting request whose compile is over the limit (their timers do it too)."""
        with self._lock:
            waiters = [waiter for waiting in self._compiling.values() for waiter in waiting]
        for waiter in waiters:
            waiter.check()

    def compile_cpu_s(self, spec: StructuredOutput) -> float | None:
        """CPU seconds `spec`'s compile has used; None while it waits for a thread, or where threads have no CPU
        clock (then only the wall-clock cap applies)."""
        with self._lock:
            running = self._running.get(spec)
        if running is None:
            return None
        clock, start = running
        try:
            return time.clock_gettime(clock) - start
        except OSError:  # the thread finished meanwhile
            return None

    def _timed(self, spec: StructuredOutput, callback: CompileCallback) -> TimedCallback:
        return TimedCallback(self.timeout_s, spec, callback, self.stats, lambda: self.compile_cpu_s(spec), self.clock)

    def _store(self, spec: StructuredOutput, value: llguidance.LLMatcher | str) -> None:
        """The caller holds the lock."""
        charge = len(value) + spec.source_bytes if isinstance(value, str) else estimated_bytes(spec)
        if charge > self.cache_bytes:
            return
        old = self._cache.pop(spec, None)
        if old is not None:
            self._cached_bytes -= old.charge
        self._cache[spec] = _Entry(value, charge)
        self._cached_bytes += charge
        while self._cached_bytes > self.cache_bytes:
            _, evicted = self._cache.popitem(last=False)
            self._cached_bytes -= evicted.charge
            self.stats.evictions += 1


def llguidance_available() -> bool:
    """Whether llguidance imports (imported only once a request is constrained)."""
    try:
        import llguidance  # noqa: F401
    except ImportError:
        return False
    return True


def _lower_priority() -> None:
    try:  # Linux: a thread's own nice value (raising it needs no privilege)
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), COMPILE_NICE)
    except (OSError, AttributeError):
        logger.warning("could not lower the grammar compiler threads' priority")


def _answer(callback: CompileCallback, value: llguidance.LLMatcher | str) -> None:
    if isinstance(value, str):
        callback(None, value)
    else:
        callback(value.deep_copy(), None)


def _thread_cpu_clock() -> int | None:
    try:
        return time.pthread_getcpuclockid(threading.get_ident())
    except (AttributeError, OSError):
        return None


def _compile(tokenizer: llguidance.LLTokenizer, spec: StructuredOutput) -> llguidance.LLMatcher | str:
    import llguidance
    from llguidance.gbnf_to_lark import any_to_lark

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
    """llguidance's message on one line, without its indented lines (a source excerpt with a caret)."""
    lines = [line.strip() for line in message.splitlines() if line.strip() and not line[0].isspace()]
    text = " ".join(lines) or "unknown error"
    return text if len(text) <= limit else text[: limit - 3] + "..."
