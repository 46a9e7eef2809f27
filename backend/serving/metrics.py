"""tritium's metrics on Triton's metrics port (docs/operating.md#metrics). Every metric call is a round trip to
the server process, so observations are gathered and pushed every FLUSH_INTERVAL_S and when idle."""

from __future__ import annotations

import threading
import time
from collections import Counter
from typing import TYPE_CHECKING, Any

from tritium.backend.outputs import RequestOutput
from tritium.backend.serving.jobs import Job

if TYPE_CHECKING:
    from tritium.backend.engine import LLMEngine

FLUSH_INTERVAL_S = 0.5
LATENCY_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]


class EngineMetrics:
    """The LoopObserver of a served model; its metrics are labelled with the model name and version."""

    def __init__(self, pb_utils: Any, model: str, version: str, engine: LLMEngine) -> None:
        family = pb_utils.MetricFamily
        labels = {"model": model, "version": version}
        self._families: list[Any] = []  # a family must outlive its metrics

        def metric(name: str, description: str, kind: Any, **kwargs: Any) -> Any:
            self._families.append(family(name=name, description=description, kind=kind))
            return self._families[-1].Metric(labels=labels, **kwargs)

        hist, counter, gauge = family.HISTOGRAM, family.COUNTER, family.GAUGE
        self.ttft = metric("tritium_time_to_first_token_seconds", "Time to first token", hist,
                           buckets=LATENCY_BUCKETS)
        self.itl = metric("tritium_inter_token_latency_seconds", "Time between streamed tokens", hist,
                          buckets=LATENCY_BUCKETS)
        self.e2e = metric("tritium_e2e_request_latency_seconds", "Request latency, arrival to final token", hist,
                          buckets=LATENCY_BUCKETS)
        self.prompt_tokens = metric("tritium_prompt_tokens_total", "Prompt tokens of finished requests", counter)
        self.generation_tokens = metric("tritium_generation_tokens_total", "Generated tokens", counter)
        self.running = metric("tritium_num_requests_running", "Requests in the running batch", gauge)
        self.waiting = metric("tritium_num_requests_waiting", "Requests accepted and waiting for a seat in the "
                              "running batch (being tokenized, queued, or preempted)", gauge)
        self.kv_usage = metric("tritium_kv_cache_usage_ratio", "Fraction of KV cache blocks in use", gauge)
        self.kv_used_blocks = metric("tritium_kv_cache_used_blocks", "KV cache blocks in use", gauge)
        self.kv_blocks = metric("tritium_kv_cache_blocks", "KV cache blocks in all", gauge)
        self.kv_block_size = metric("tritium_kv_cache_block_size", "Tokens per KV cache block", gauge)
        self.kv_blocks.set(engine.block_manager.num_blocks)
        self.kv_block_size.set(engine.block_manager.block_size)
        self.preemptions = metric("tritium_num_preemptions_total",
                                  "Sequences preempted (for lack of KV blocks, or for a higher-priority request)",
                                  counter)
        self.prefix_hits = metric("tritium_prefix_cache_hit_tokens_total", "Prompt tokens served from the prefix "
                                  "cache", counter)
        self.prefix_queries = metric("tritium_prefix_cache_queried_tokens_total", "Prompt tokens looked up in the "
                                     "prefix cache", counter)
        self.spec_drafts = metric("tritium_spec_decode_num_draft_tokens_total", "Speculative draft tokens "
                                  "verified", counter)
        self.spec_accepted = metric("tritium_spec_decode_num_accepted_tokens_total", "Speculative draft tokens "
                                    "accepted", counter)
        self.spec_steps = metric("tritium_spec_decode_num_drafts_total", "Speculative verification steps that "
                                 "verified drafts", counter)
        self.refused = metric("tritium_num_requests_refused_total", "Requests refused because too many were "
                              "waiting (max_pending_requests)", counter)
        self.engine_healthy = metric("tritium_engine_healthy", "1 while the engine serves, 0 once its thread failed",
                                     gauge)
        self.engine_healthy.set(1)
        self.stream_interval = metric("tritium_stream_interval_tokens", "Tokens a streamed response carries at "
                                      "most now (1 while sending keeps up; see max_stream_interval)", gauge)
        self._labels = labels
        self._lora_info_family = family(
            name="tritium_lora_requests_info", kind=gauge,
            description="LoRA adapters of the running and waiting requests (comma-separated, sorted) and max_lora; "
                        "the value is the unix time of the update: read the newest series")
        self._lora_total_family = family(name="tritium_lora_requests_total", kind=counter,
                                         description="Requests admitted into the engine per LoRA adapter")
        self._families += [self._lora_info_family, self._lora_total_family]
        self._max_lora = str(engine.lora.max_loras if engine.lora is not None else 0)
        self._lora_info: Any = None  # the current series of tritium_lora_requests_info
        self._lora_info_labels: dict[str, str] | None = None
        # Every series made, by labels: the python backend keeps a metric until its family goes, so a label set
        # seen before reuses its series.
        self._lora_info_series: dict[tuple[tuple[str, str], ...], Any] = {}
        self._lora_totals: dict[str, Any] = {}  # adapter name -> its tritium_lora_requests_total series
        self._lora_admitted: Counter[str] = Counter()  # not pushed yet (the engine thread adds, on_step pushes)
        self._lora_lock = threading.Lock()
        self._push_lora_info([], [])
        self._seen_preemptions = 0
        self._seen_hits = 0
        self._seen_queries = 0
        self._seen_spec = (0, 0, 0)  # verification steps with drafts, draft and accepted tokens pushed so far
        self._ttft: list[float] = []
        self._itl: list[float] = []
        self._e2e: list[float] = []
        self._generated = 0
        self._prompt = 0
        self._last_flush = 0.0
        self._engine_failed = False  # then the scheduler's counts mean nothing: running and waiting stay 0
        self._gauges = threading.Lock()  # the engine thread's failure vs the response thread's push

    def on_output(self, job: Job, output: RequestOutput, now: float) -> None:
        new = len(output.delta_token_ids)
        if new:
            if job.first_token_at is None:
                self._ttft.append(now - job.arrival)
                job.first_token_at = now
            elif job.last_token_at is not None:
                self._itl.append((now - job.last_token_at) / new)
            job.last_token_at = now
            self._generated += new
        if output.finished:
            self._e2e.append(now - job.arrival)
            self._prompt += output.num_input_tokens

    def on_admitted(self, job: Job) -> None:
        if job.lora_name is not None:
            with self._lora_lock:
                self._lora_admitted[job.lora_name] += 1

    def on_refused(self) -> None:
        self.refused.increment(1)

    def on_stream_interval(self, interval: int) -> None:
        self.stream_interval.set(interval)

    def on_engine_failed(self) -> None:
        with self._gauges:
            self._engine_failed = True
            self.engine_healthy.set(0)
            self.running.set(0)
            self.waiting.set(0)

    def on_step(self, engine: LLMEngine, now: float, force: bool = False, queued: int = 0) -> None:
        """Push what was gathered, if FLUSH_INTERVAL_S passed since the last push (or `force`). `queued`:
        requests accepted but not in the engine yet, counted as waiting."""
        if not force and now - self._last_flush < FLUSH_INTERVAL_S:
            return
        self._last_flush = now
        # Counters first, then the histograms (a request's e2e observation last), then the gauges: a reader
        # that sees a request's e2e count sees its token counters too.
        if self._generated:
            self.generation_tokens.increment(self._generated)
            self._generated = 0
        if self._prompt:
            self.prompt_tokens.increment(self._prompt)
            self._prompt = 0
        sched, blocks = engine.scheduler, engine.block_manager
        if sched.num_preemptions > self._seen_preemptions:
            self.preemptions.increment(sched.num_preemptions - self._seen_preemptions)
            self._seen_preemptions = sched.num_preemptions
        if blocks.prefix_hit_tokens > self._seen_hits:
            self.prefix_hits.increment(blocks.prefix_hit_tokens - self._seen_hits)
            self._seen_hits = blocks.prefix_hit_tokens
        if blocks.prefix_queried_tokens > self._seen_queries:
            self.prefix_queries.increment(blocks.prefix_queried_tokens - self._seen_queries)
            self._seen_queries = blocks.prefix_queried_tokens
        if (s := engine.spec_totals) is not None:
            spec = s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens
            for metric, now_, seen in zip((self.spec_steps, self.spec_drafts, self.spec_accepted), spec,
                                          self._seen_spec, strict=True):
                if now_ > seen:
                    metric.increment(now_ - seen)
            self._seen_spec = spec
        for values, metric in ((self._ttft, self.ttft), (self._itl, self.itl), (self._e2e, self.e2e)):
            for value in values:
                metric.observe(value)
            values.clear()
        with self._gauges:
            if not self._engine_failed:
                self.running.set(len(sched.running))
                self.waiting.set(len(sched.waiting) + queued)
        self.kv_usage.set(blocks.usage)
        self.kv_used_blocks.set(blocks.num_blocks - blocks.num_free_blocks)
        self._push_lora(sched)

    def _push_lora(self, sched: Any) -> None:
        """Push the admitted-per-adapter counts and, when they changed, the running and waiting adapters."""
        with self._lora_lock:
            admitted, self._lora_admitted = self._lora_admitted, Counter()
        for name, n in admitted.items():
            series = self._lora_totals.get(name)
            if series is None:
                series = self._lora_totals[name] = self._lora_total_family.Metric(
                    labels={**self._labels, "lora_name": name})
            series.increment(n)
        if self._max_lora == "0":
            return
        # Snapshots: the engine thread changes these queues meanwhile (list() of a deque is one C call).
        running, waiting = list(sched.running), list(sched.waiting)
        self._push_lora_info([s.lora.name for s in running if s.lora is not None],
                             [s.lora.name for s in waiting if s.lora is not None])

    def _push_lora_info(self, running: list[str], waiting: list[str]) -> None:
        """When the adapters changed: set the series of the new labels to now (vLLM's vllm:lora_requests_info:
        a reader takes the newest) and the previous one to 0 (the python backend cannot delete a series)."""
        labels = {**self._labels, "max_lora": self._max_lora, "running_lora_adapters": ",".join(sorted(set(running))),
                  "waiting_lora_adapters": ",".join(sorted(set(waiting)))}
        if labels == self._lora_info_labels:
            return
        key = tuple(sorted(labels.items()))
        series = self._lora_info_series.get(key)
        if series is None:
            series = self._lora_info_series[key] = self._lora_info_family.Metric(labels=labels)
        series.set(time.time())
        if self._lora_info is not None:
            self._lora_info.set(0)
        self._lora_info, self._lora_info_labels = series, labels
