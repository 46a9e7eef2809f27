"""A replica's engine state, read from its tritonserver's metrics port, and the vLLM-named gauges made of it.

Routers and endpoint pickers (vllm-router, sglang-router, the Gateway API Inference Extension) score a model
server by a few numbers; the OpenAI endpoint serves them from here (`/get_load`, `/metrics`), and its own
router reads the same `EngineLoad` to pick a replica, so every layer sees one truth:

- `vllm:num_requests_running`   <- `tritium_num_requests_running` (sequences in the running batch)
- `vllm:num_requests_waiting`   <- `tritium_num_requests_waiting` (accepted, not running: tokenizing, queued,
                                   preempted)
- `vllm:kv_cache_usage_perc`    <- `tritium_kv_cache_usage_ratio` (0..1, as vLLM's despite the name)
- `vllm:cache_config_info{block_size, num_gpu_blocks}` <- `tritium_kv_cache_block_size`, `tritium_kv_cache_blocks`
- `vllm:lora_requests_info{max_lora="0", running_lora_adapters="", waiting_lora_adapters=""}`: no LoRA yet
- `vllm:prefix_cache_queries_total` / `vllm:prefix_cache_hits_total` <- tritium's prefix-cache token counters

Values are summed over the model's versions (each version is its own engine). The engine pushes them at most
every 0.5 s, so they trail the engine by that much.
"""

from __future__ import annotations

import asyncio
import re
import time
import urllib.request
from dataclasses import dataclass

SCRAPE_TIMEOUT_S = 2.0
_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


@dataclass
class EngineLoad:
    """One replica's engine(s) for one model. `healthy` is False when no engine reports serving."""

    running: int = 0
    waiting: int = 0
    kv_cache_usage: float = 0.0
    kv_blocks: int = 0
    kv_used_blocks: int = 0
    block_size: int = 0
    prefix_hit_tokens: int = 0
    prefix_queried_tokens: int = 0
    engines: int = 0
    healthy: bool = False

    @property
    def requests(self) -> int:
        return self.running + self.waiting

    def add(self, other: EngineLoad) -> EngineLoad:
        """Two replicas' loads as one (what an endpoint in front of both serves)."""
        blocks = self.kv_blocks + other.kv_blocks
        used = self.kv_used_blocks + other.kv_used_blocks
        return EngineLoad(
            running=self.running + other.running, waiting=self.waiting + other.waiting,
            kv_cache_usage=used / blocks if blocks else 0.0, kv_blocks=blocks, kv_used_blocks=used,
            block_size=self.block_size or other.block_size,
            prefix_hit_tokens=self.prefix_hit_tokens + other.prefix_hit_tokens,
            prefix_queried_tokens=self.prefix_queried_tokens + other.prefix_queried_tokens,
            engines=self.engines + other.engines, healthy=self.healthy or other.healthy)


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


_FIELDS = {
    "tritium_num_requests_running": "running",
    "tritium_num_requests_waiting": "waiting",
    "tritium_kv_cache_blocks": "kv_blocks",
    "tritium_kv_cache_used_blocks": "kv_used_blocks",
    "tritium_kv_cache_block_size": "block_size",
    "tritium_prefix_cache_hit_tokens_total": "prefix_hit_tokens",
    "tritium_prefix_cache_queried_tokens_total": "prefix_queried_tokens",
}


def engine_load(metrics_text: str, model: str) -> EngineLoad:
    """The load of `model`'s engines (every version) in a tritonserver's metrics text."""
    load = EngineLoad()
    ratio_sum = 0.0
    for name, labels, value in parse_samples(metrics_text):
        if labels.get("model") != model:
            continue
        if name == "tritium_engine_healthy":
            load.engines += 1
            load.healthy = load.healthy or value == 1
        elif name == "tritium_kv_cache_usage_ratio":
            ratio_sum += value
        elif (field := _FIELDS.get(name)) is not None:
            if field == "block_size":
                load.block_size = int(value)
            else:
                setattr(load, field, getattr(load, field) + int(value))
    if load.kv_blocks:
        load.kv_cache_usage = load.kv_used_blocks / load.kv_blocks
    elif load.engines:
        load.kv_cache_usage = ratio_sum / load.engines
    return load


def fetch_metrics(url: str, timeout: float = SCRAPE_TIMEOUT_S) -> str:
    """GET a metrics page. Raises OSError (ValueError for a malformed URL) when it does not answer."""
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.read().decode("utf-8", "replace")


async def fetch_metrics_async(url: str | None) -> str | None:
    """`fetch_metrics` off the event loop; None without a URL or when the metrics port does not answer."""
    if url is None:
        return None
    try:
        return await asyncio.to_thread(fetch_metrics, url)
    except (OSError, ValueError):
        return None


async def scrape_async(url: str, model: str) -> EngineLoad | None:
    """`model`'s load from a tritonserver's metrics, fetched off the event loop; None when it does not answer."""
    text = await fetch_metrics_async(url)
    return engine_load(text, model) if text is not None else None


def _label_value(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def vllm_metrics(load: EngineLoad, model_name: str) -> str:
    """vLLM's gauges and prefix-cache counters for `load`, in Prometheus text, labelled as vLLM labels them
    (`engine`, `model_name`)."""
    label = f'engine="0",model_name="{_label_value(model_name)}"'
    lines = [
        "# HELP vllm:num_requests_running Requests in the running batch (tritium_num_requests_running).",
        "# TYPE vllm:num_requests_running gauge",
        f"vllm:num_requests_running{{{label}}} {load.running}",
        "# HELP vllm:num_requests_waiting Requests accepted and not running yet (tritium_num_requests_waiting).",
        "# TYPE vllm:num_requests_waiting gauge",
        f"vllm:num_requests_waiting{{{label}}} {load.waiting}",
        "# HELP vllm:kv_cache_usage_perc KV cache usage, 0 to 1 (1 = 100 percent).",
        "# TYPE vllm:kv_cache_usage_perc gauge",
        f"vllm:kv_cache_usage_perc{{{label}}} {load.kv_cache_usage:.6f}",
        "# HELP vllm:cache_config_info The KV cache's configuration.",
        "# TYPE vllm:cache_config_info gauge",
        f'vllm:cache_config_info{{block_size="{load.block_size}",enable_prefix_caching="True",'
        f'num_gpu_blocks="{load.kv_blocks}",{label}}} 1.0',
        "# HELP vllm:lora_requests_info LoRA adapters in use (tritium serves none).",
        "# TYPE vllm:lora_requests_info gauge",
        f'vllm:lora_requests_info{{max_lora="0",running_lora_adapters="",waiting_lora_adapters="",{label}}} '
        f"{time.time():.1f}",  # vLLM's value: when the adapters last changed; readers take the newest series
        "# HELP vllm:prefix_cache_queries_total Prompt tokens looked up in the prefix cache.",
        "# TYPE vllm:prefix_cache_queries_total counter",
        f"vllm:prefix_cache_queries_total{{{label}}} {load.prefix_queried_tokens}",
        "# HELP vllm:prefix_cache_hits_total Prompt tokens found in the prefix cache.",
        "# TYPE vllm:prefix_cache_hits_total counter",
        f"vllm:prefix_cache_hits_total{{{label}}} {load.prefix_hit_tokens}",
    ]
    return "\n".join(lines) + "\n"
