"""A replica's engine state, read from its tritonserver's metrics port, and the vLLM-named gauges made of it.

Routers and endpoint pickers (vllm-router, sglang-router, the Gateway API Inference Extension) score a model
server by a few numbers; the OpenAI endpoint serves them from here (`/get_load`, `/metrics`), and its own
router reads the same `EngineLoad` to pick a replica, so every layer sees one truth:

- `vllm:num_requests_running`   <- `tritium_num_requests_running` (sequences in the running batch)
- `vllm:num_requests_waiting`   <- `tritium_num_requests_waiting` (accepted, not running: tokenizing, queued,
                                   preempted)
- `vllm:kv_cache_usage_perc`    <- `tritium_kv_cache_usage_ratio` (0..1, as vLLM's despite the name)
- `vllm:cache_config_info{block_size, num_gpu_blocks}` <- `tritium_kv_cache_block_size`, `tritium_kv_cache_blocks`
- `vllm:lora_requests_info{max_lora, running_lora_adapters, waiting_lora_adapters}` <- the newest series of
  `tritium_lora_requests_info` (value: when it changed, unix time); over several engines the largest
  `max_lora` and every engine's adapters (`max_lora="0"` and no adapters without LoRA or without metrics)
- `vllm:prefix_cache_queries_total` / `vllm:prefix_cache_hits_total` <- tritium's prefix-cache token counters
- `vllm:spec_decode_num_drafts_total` / `_num_draft_tokens_total` / `_num_accepted_tokens_total` <- tritium's
  `tritium_spec_decode_*` counters of the same names (0 without speculative decoding)

Values are summed over the model's versions (each version is its own engine). The engine pushes them at most
every 0.5 s, so they trail the engine by that much.

A replica whose metrics are unknown (no metrics URL, or the last scrape failed: a dead port, a page cut short,
garbage, NaN) is counted by what the endpoint itself has in flight there (`EngineLoad.in_flight`): requests
that streamed a token are running, the others waiting. Its KV cache figures cannot be known that way: they
are left out (None), never reported as 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import re
import time
import urllib.request
from dataclasses import dataclass, field
from types import MappingProxyType

logger = logging.getLogger(__name__)
SCRAPE_TIMEOUT_S = 2.0  # for the whole page: connecting, headers and body
MAX_METRICS_BYTES = 8 << 20
_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def _names(labels: str) -> frozenset[str]:
    return frozenset(name for name in labels.split(",") if name)


@dataclass(frozen=True)
class LoraInfo:
    """An engine's LoRA state as `tritium_lora_requests_info` says it: device slots (`max_lora`, 0: LoRA off),
    the adapters of running and of waiting requests, and when that last changed (unix time, 0: never said)."""

    max_lora: int = 0
    running: frozenset[str] = frozenset()
    waiting: frozenset[str] = frozenset()
    updated: float = 0.0

    @classmethod
    def from_labels(cls, labels: dict[str, str], value: float) -> LoraInfo:
        """One series of `tritium_lora_requests_info` (labels and value). Raises ValueError for a `max_lora`
        that is no count."""
        return cls(int(labels.get("max_lora", "0")), _names(labels.get("running_lora_adapters", "")),
                   _names(labels.get("waiting_lora_adapters", "")), value)

    def add(self, other: LoraInfo) -> LoraInfo:
        """Two engines' states as one: the larger slot count, both engines' adapters, the later change."""
        return LoraInfo(max(self.max_lora, other.max_lora), self.running | other.running,
                        self.waiting | other.waiting, max(self.updated, other.updated))


@dataclass
class EngineLoad:
    """One replica's engine(s) for one model. `healthy` is False when no engine reports serving. KV figures
    are None when unknown (a load counted from the endpoint's own requests: `in_flight`)."""

    running: int = 0
    waiting: int = 0
    kv_cache_usage: float | None = 0.0
    kv_blocks: int | None = 0
    kv_used_blocks: int | None = 0
    block_size: int = 0
    prefix_hit_tokens: int = 0
    prefix_queried_tokens: int = 0
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    engines: int = 0
    healthy: bool = False
    lora: LoraInfo = field(default_factory=lambda: LoraInfo())

    @classmethod
    def in_flight(cls, streaming: int, not_started: int) -> EngineLoad:
        """What an endpoint knows of a replica whose metrics it cannot read: its own requests there (those
        that streamed a token run; the others wait, as far as it can tell); no KV figures."""
        return cls(running=streaming, waiting=not_started, kv_cache_usage=None, kv_blocks=None,
                   kv_used_blocks=None)

    @property
    def requests(self) -> int:
        """Running plus waiting."""
        return self.running + self.waiting

    def add(self, other: EngineLoad) -> EngineLoad:
        """Two replicas' loads as one (what an endpoint in front of both serves); KV figures only when both
        are known."""
        blocks = used = usage = None
        if self.kv_blocks is not None and other.kv_blocks is not None:
            blocks = self.kv_blocks + other.kv_blocks
            used = (self.kv_used_blocks or 0) + (other.kv_used_blocks or 0)
            usage = used / blocks if blocks else (self.kv_cache_usage or 0.0) + (other.kv_cache_usage or 0.0)
        return EngineLoad(
            running=self.running + other.running, waiting=self.waiting + other.waiting,
            kv_cache_usage=usage, kv_blocks=blocks, kv_used_blocks=used,
            block_size=self.block_size or other.block_size,
            prefix_hit_tokens=self.prefix_hit_tokens + other.prefix_hit_tokens,
            prefix_queried_tokens=self.prefix_queried_tokens + other.prefix_queried_tokens,
            spec_drafts=self.spec_drafts + other.spec_drafts,
            spec_draft_tokens=self.spec_draft_tokens + other.spec_draft_tokens,
            spec_accepted_tokens=self.spec_accepted_tokens + other.spec_accepted_tokens,
            engines=self.engines + other.engines, healthy=self.healthy or other.healthy,
            lora=self.lora.add(other.lora))


def parse_samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    """(name, labels, value) of every sample in a Prometheus text exposition; malformed lines are skipped."""
    out = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if match is None:
            continue
        try:
            value = float(match.group(3))
        except ValueError:
            continue
        out.append((match.group(1), dict(_LABEL.findall(match.group(2) or "")), value))
    return out


_FIELDS = MappingProxyType({
    "tritium_num_requests_running": "running",
    "tritium_num_requests_waiting": "waiting",
    "tritium_kv_cache_blocks": "kv_blocks",
    "tritium_kv_cache_used_blocks": "kv_used_blocks",
    "tritium_kv_cache_block_size": "block_size",
    "tritium_prefix_cache_hit_tokens_total": "prefix_hit_tokens",
    "tritium_prefix_cache_queried_tokens_total": "prefix_queried_tokens",
    "tritium_spec_decode_num_drafts_total": "spec_drafts",
    "tritium_spec_decode_num_draft_tokens_total": "spec_draft_tokens",
    "tritium_spec_decode_num_accepted_tokens_total": "spec_accepted_tokens",
})


def engine_load(metrics_text: str, model: str) -> EngineLoad:
    """The load of `model`'s engines (every version) in a tritonserver's metrics text (`engines` 0 when it
    holds none of them). Raises ValueError when one of its figures is not a finite number (NaN, Inf): such a
    page says nothing reliable about the load."""
    load = EngineLoad()
    ratio_sum = 0.0
    lora: dict[str, LoraInfo] = {}  # version -> its newest series
    for name, labels, value in parse_samples(metrics_text):
        if labels.get("model") != model:
            continue
        if name == "tritium_lora_requests_info":
            version = labels.get("version", "")
            if math.isfinite(value) and (version not in lora or value > lora[version].updated):
                with contextlib.suppress(ValueError):  # a max_lora that is no count: this series says nothing
                    lora[version] = LoraInfo.from_labels(labels, value)
            continue
        if not math.isfinite(value) and (name in _FIELDS or name.startswith("tritium_kv_cache")
                                         or name == "tritium_engine_healthy"):
            raise ValueError(f"{name} is {value}, not a count")
        if name == "tritium_engine_healthy":
            load.engines += 1
            load.healthy = load.healthy or value == 1
        elif name == "tritium_kv_cache_usage_ratio":
            ratio_sum += value
        elif (field := _FIELDS.get(name)) is not None:
            if field == "block_size":
                load.block_size = int(value)
            else:
                setattr(load, field, (getattr(load, field) or 0) + int(value))
    for info in lora.values():
        load.lora = load.lora.add(info)
    if load.kv_blocks:
        load.kv_cache_usage = load.kv_used_blocks / load.kv_blocks
    elif load.engines:
        load.kv_cache_usage = ratio_sum / load.engines
    return load


def fetch_metrics(url: str, timeout: float | None = None) -> str:
    """GET a metrics page within `timeout` (default SCRAPE_TIMEOUT_S) in all: a server that trickles its page is
    cut off. Raises OSError or http.client.HTTPException when it does not answer or its page is cut short or
    not HTTP, ValueError for a malformed URL or a page over MAX_METRICS_BYTES."""
    timeout = SCRAPE_TIMEOUT_S if timeout is None else timeout
    deadline = time.monotonic() + timeout
    with urllib.request.urlopen(url, timeout=timeout) as response:
        parts: list[bytes] = []
        size = 0
        while chunk := response.read1(1 << 16):
            parts.append(chunk)
            size += len(chunk)
            if size > MAX_METRICS_BYTES:
                raise ValueError(f"the metrics page is over {MAX_METRICS_BYTES} bytes")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the metrics page took over {timeout:g} s")
        return b"".join(parts).decode("utf-8", "replace")


async def fetch_metrics_async(url: str | None) -> str | None:
    """`fetch_metrics` off the event loop; None without a URL or when the page cannot be read (whatever went
    wrong: a failed scrape means "unknown" for that round, never an error)."""
    if url is None:
        return None
    try:
        return await asyncio.wait_for(asyncio.to_thread(fetch_metrics, url), SCRAPE_TIMEOUT_S + 1.0)
    except Exception as exc:
        logger.debug("scraping %s failed: %r", url, exc)
        return None


async def scrape_async(url: str, model: str) -> EngineLoad | None:
    """`model`'s load from a tritonserver's metrics, fetched off the event loop; None when it cannot be read or
    holds no engine of `model`."""
    text = await fetch_metrics_async(url)
    if text is None:
        return None
    try:
        load = engine_load(text, model)
    except ValueError as exc:
        logger.debug("the metrics of %s hold no usable load: %s", url, exc)
        return None
    return load if load.engines else None


def _label_value(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def vllm_metrics(load: EngineLoad, model_name: str) -> str:
    """vLLM's gauges and prefix-cache counters for `load`, in Prometheus text, labelled as vLLM labels them
    (`engine`, `model_name`)."""
    label = f'engine="0",model_name="{_label_value(model_name)}"'
    lora = load.lora
    lines = [
        "# HELP vllm:num_requests_running Requests in the running batch (tritium_num_requests_running).",
        "# TYPE vllm:num_requests_running gauge",
        f"vllm:num_requests_running{{{label}}} {load.running}",
        "# HELP vllm:num_requests_waiting Requests accepted and not running yet (tritium_num_requests_waiting).",
        "# TYPE vllm:num_requests_waiting gauge",
        f"vllm:num_requests_waiting{{{label}}} {load.waiting}",
    ]
    if load.kv_cache_usage is not None:  # unknown without the engines' metrics: left out, not 0
        lines += [
            "# HELP vllm:kv_cache_usage_perc KV cache usage, 0 to 1 (1 = 100 percent).",
            "# TYPE vllm:kv_cache_usage_perc gauge",
            f"vllm:kv_cache_usage_perc{{{label}}} {load.kv_cache_usage:.6f}",
            "# HELP vllm:cache_config_info The KV cache's configuration.",
            "# TYPE vllm:cache_config_info gauge",
            f'vllm:cache_config_info{{block_size="{load.block_size}",enable_prefix_caching="True",'
            f'num_gpu_blocks="{load.kv_blocks}",{label}}} 1.0',
        ]
    lines += [
        "# HELP vllm:lora_requests_info LoRA slots and the adapters of running and waiting requests.",
        "# TYPE vllm:lora_requests_info gauge",
        f'vllm:lora_requests_info{{max_lora="{lora.max_lora}",'
        f'running_lora_adapters="{_label_value(",".join(sorted(lora.running)))}",'
        f'waiting_lora_adapters="{_label_value(",".join(sorted(lora.waiting)))}",{label}}} '
        f"{lora.updated or time.time():.3f}",  # vLLM's value: when the adapters last changed; readers take the newest
        "# HELP vllm:prefix_cache_queries_total Prompt tokens looked up in the prefix cache.",
        "# TYPE vllm:prefix_cache_queries_total counter",
        f"vllm:prefix_cache_queries_total{{{label}}} {load.prefix_queried_tokens}",
        "# HELP vllm:prefix_cache_hits_total Prompt tokens found in the prefix cache.",
        "# TYPE vllm:prefix_cache_hits_total counter",
        f"vllm:prefix_cache_hits_total{{{label}}} {load.prefix_hit_tokens}",
        "# HELP vllm:spec_decode_num_drafts_total Speculative verification steps that verified drafts.",
        "# TYPE vllm:spec_decode_num_drafts_total counter",
        f"vllm:spec_decode_num_drafts_total{{{label}}} {load.spec_drafts}",
        "# HELP vllm:spec_decode_num_draft_tokens_total Speculative draft tokens verified.",
        "# TYPE vllm:spec_decode_num_draft_tokens_total counter",
        f"vllm:spec_decode_num_draft_tokens_total{{{label}}} {load.spec_draft_tokens}",
        "# HELP vllm:spec_decode_num_accepted_tokens_total Speculative draft tokens accepted.",
        "# TYPE vllm:spec_decode_num_accepted_tokens_total counter",
        f"vllm:spec_decode_num_accepted_tokens_total{{{label}}} {load.spec_accepted_tokens}",
    ]
    return "\n".join(lines) + "\n"
