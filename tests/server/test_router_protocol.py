"""Production routers (vllm-router 0.1.17, sglang-router 0.3.2) in front of real tritium replicas.

A replica is one `tritium serve` (a tritonserver on the tiny Llama) and one `tritium openai` in front of it;
each test starts its router as a subprocess on free loopback ports and talks to it over plain HTTP (and the
official `openai` client). Proven, from the replicas' own tritonserver metrics:

- round_robin spreads different completions over both replicas, every one answered (both routers);
- vllm-router's cache_aware sends completions sharing a long prefix to one replica, whose prefix cache then
  serves that prefix (the other replica's hit counter does not move);
- streamed completions and chat completions pass through the router as JSON data lines ending in
  `data: [DONE]`, with the same text as the non-streamed answer (both routers);
- when a replica dies mid-stream (its tritonserver process group and its endpoint SIGKILLed, as a dying pod),
  the client's stream ends cut (no `[DONE]`, no finish_reason) and the next requests are all answered by the
  survivor within seconds (both routers).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai
import pytest
import requests

from tritium.client.triton.launcher import clean_stale
from tritium.client.triton.repository import one_model_repository

from support.serving import Served, free_ports, metric_value, start_openai_with, start_serve, wait_for, wait_until_idle

pytestmark = pytest.mark.slow

# The fast-failover flags our guide documents for both routers: a dead worker is dropped after one failed
# health probe (every 1 s) or one failed request (breaker), a refused request is retried at once on the other
# worker, and workers are polled every second at startup (the default waits 30 s between startup probes).
ROUTER_FLAGS = [
    "--health-check-interval-secs", "1", "--health-failure-threshold", "1", "--health-check-timeout-secs", "1",
    "--cb-failure-threshold", "1", "--cb-timeout-duration-secs", "2",
    "--retry-max-retries", "3", "--retry-initial-backoff-ms", "10",
    "--worker-startup-timeout-secs", "30", "--worker-startup-check-interval", "1",
]
KINDS = ["vllm", "sglang"]
E2E = "tritium_e2e_request_latency_seconds_count"
HITS = "tritium_prefix_cache_hit_tokens_total"
RUNNING = "tritium_num_requests_running"
BLOCK = 16  # the engine's KV block: the prefix cache hits whole blocks
CONTEXT = 1024  # the tiny Llama's max_position_embeddings (the engine's max_model_len)
# ~330 tokens of ordinary text shared by the cache_aware prompts
PREFIX = (
    "The old lighthouse stood at the edge of the cliff, its white paint peeling after decades of salt and wind. "
    "Every evening the keeper climbed the spiral stairs, one hundred and twelve of them, to light the lamp that "
    "warned the fishing boats away from the rocks below. He had done this for thirty years, through storms that "
    "shook the glass and calm nights when the sea lay flat as a mirror under the stars. The villagers brought "
    "him bread and news on Sundays, and he told them about the ships he had seen pass, the whales that sometimes "
    "surfaced near the point, and the strange green light that once hovered over the water for an hour before "
    "vanishing. Nobody believed that story, but they liked to hear it anyway. In the winter the keeper mended "
    "nets for the fishermen and carved small wooden birds that he gave to the children of the village. His "
    "daughter wrote to him from the city every month, asking him to come and live with her, but he always "
    "answered that the lamp needed him and the sea would be lonely without someone to watch it. One autumn a "
    "young engineer arrived with plans to replace the lamp with an automatic beacon that would need no keeper at "
    "all. The keeper showed him the stairs, the lens, the logbooks filled with careful handwriting, and the "
    "engineer listened politely and took notes. When the beacon was finally installed the following spring, the "
    "keeper moved into a small cottage at the foot of the hill, but he still walked up to the cliff each evening "
    "to watch the light come on by itself, and he still wrote the weather in his logbook before going to bed. "
)


@dataclass
class Replica:
    """One tritonserver and the OpenAI endpoint in front of it."""

    served: Served
    endpoint: subprocess.Popen[str]
    url: str  # the endpoint's root URL (what a router's --worker-urls take)
    killed: bool = False

    def e2e(self) -> float:
        return metric_value(self.served, E2E)


@dataclass
class Router:
    kind: str
    process: subprocess.Popen[bytes]
    url: str
    log: Path
    workers: list[str] = field(default_factory=list)

    def tail(self, lines: int = 40) -> str:
        text = self.log.read_text(errors="replace").splitlines()
        return f"--- {self.kind}-router log tail ---\n" + "\n".join(text[-lines:])

    def stop(self) -> None:
        terminate(self.process, 3)


def terminate(process: subprocess.Popen[Any], timeout: float) -> None:
    """SIGTERM `process`, SIGKILL it if it is still there after `timeout` seconds."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def tiny_repository(dest: Path, model: Path) -> Path:
    return one_model_repository(dest, {"model": str(model), "kv_cache_bytes": 16 << 20, "request_timeout_s": 120})


def start_replica(repo: Path, tokenizer: Path) -> Replica:
    served = start_serve(f"--model-repository={repo}", "--model-control=explicit", "--load-model=tritium")
    try:
        endpoint, url = start_openai_with([served.grpc], f"--upstream-metrics={served.metrics}",
                                          f"--tokenizer={tokenizer}", "--expose-model-path")  # sglang-router
    except BaseException:
        served.stop()
        raise
    return Replica(served, endpoint, url.removesuffix("/v1"))


def start_pair(repo: Path, tokenizer: Path) -> list[Replica]:
    """Two replicas of one repository, started side by side."""
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(start_replica, repo, tokenizer) for _ in range(2)]
    errors = [f.exception() for f in futures if f.exception() is not None]
    if errors:
        for f in futures:
            if f.exception() is None:
                stop_replica(f.result())
        raise errors[0]  # type: ignore[misc]
    return [f.result() for f in futures]


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes of process group `pgid`."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            stat = (proc / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            found.append(int(proc.name))
    return found


def kill_replica(replica: Replica) -> None:
    """What a dying pod looks like: tritonserver's whole process group (it and its stubs), its launcher and
    the OpenAI endpoint, all SIGKILLed."""
    replica.killed = True
    os.killpg(replica.served.server_pid, signal.SIGKILL)
    replica.served.process.kill()
    replica.endpoint.kill()
    replica.endpoint.wait(10)
    replica.served.process.wait(10)


def stop_replica(replica: Replica) -> None:
    terminate(replica.endpoint, 10)
    replica.served.stop()
    if replica.killed:  # nobody cleaned up after it: its shm segments are stale now
        assert wait_for(lambda: not group_members(replica.served.server_pid), 10), "orphans of the killed replica"
        for seg in Path("/dev/shm").glob(f"tritium_{replica.served.server_pid}_*"):
            seg.unlink(missing_ok=True)
        clean_stale()
    assert not replica.served.leftovers(), replica.served.leftovers()


def start_router(kind: str, workers: list[Replica], policy: str, log: Path, *extra: str,
                 timeout: float = 60.0) -> Router:
    """Start `kind`-router on free loopback ports; return once it answers completions through every worker."""
    port, prometheus = free_ports(2)
    urls = [w.url for w in workers]
    common = ["--worker-urls", *urls, "--policy", policy, "--host", "127.0.0.1", "--port", str(port),
              "--prometheus-port", str(prometheus), *ROUTER_FLAGS, *extra]
    if kind == "vllm":
        cmd = [str(Path(sys.executable).parent / "vllm-router"), *common]
    else:
        cmd = [sys.executable, "-m", "sglang_router.launch_router", *common]
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    router = Router(kind, proc, f"http://127.0.0.1:{port}", log, urls)

    def ready() -> bool:
        if proc.poll() is not None:
            return True
        try:
            if kind == "sglang":  # workers register in the background, after the HTTP server is up
                listed = requests.get(router.url + "/workers", timeout=2).json()
                listed = listed.get("workers", listed) if isinstance(listed, dict) else listed
                if sum(bool(w.get("is_healthy")) for w in listed) < len(urls):
                    return False
            body = {"model": "tritium", "prompt": "Hello", "max_tokens": 1}
            return requests.post(router.url + "/v1/completions", json=body, timeout=10).status_code == 200
        except (requests.RequestException, ValueError):
            return False

    if not wait_for(ready, timeout, 0.5) or proc.poll() is not None:
        router.stop()
        raise RuntimeError(f"{kind}-router did not come up\n{router.tail()}")
    for w in workers:
        assert wait_until_idle(w.served, 30)
    return router


def sse(resp: requests.Response) -> tuple[list[Any], bool]:
    """The JSON payloads of a stream's data lines, and whether it ended with `data: [DONE]`."""
    events: list[Any] = []
    done = False
    for line in resp.iter_lines(decode_unicode=True):
        if not line:
            continue
        assert line.startswith("data: ") and not done, f"unexpected line {line!r} (done={done})"
        if line == "data: [DONE]":
            done = True
        else:
            events.append(json.loads(line[len("data: "):]))
    return events, done


# ---------------------------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory, tiny_llama_path: Path) -> Iterator[list[Replica]]:
    replicas = start_pair(tiny_repository(tmp_path_factory.mktemp("router-repo"), tiny_llama_path),
                          tiny_llama_path)
    yield replicas
    for r in replicas:
        stop_replica(r)


@pytest.fixture(scope="module", params=KINDS)
def router(request: pytest.FixtureRequest, pair: list[Replica],
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Router]:
    kind: str = request.param
    r = start_router(kind, pair, "round_robin", tmp_path_factory.mktemp("router") / f"{kind}.log")
    yield r
    r.stop()


@pytest.fixture(scope="module")
def cache_router(pair: list[Replica], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Router]:
    r = start_router("vllm", pair, "cache_aware", tmp_path_factory.mktemp("router") / "vllm-cache.log")
    yield r
    r.stop()


# ------------------------------------------------------------------------------------------------- tests

def test_round_robin_spreads_completions_over_both_replicas(router: Router, pair: list[Replica],
                                                           tiny_llama_path: Path) -> None:
    before = [r.e2e() for r in pair]
    for i in range(8):
        body = {"model": "tritium", "prompt": f"Request number {i}: tell me about the sea", "max_tokens": 6}
        resp = requests.post(router.url + "/v1/completions", json=body, timeout=60)
        assert resp.status_code == 200, f"{resp.status_code} {resp.text}\n{router.tail()}"
        assert resp.json()["choices"][0]["text"], resp.text

    def served() -> list[float]:
        return [r.e2e() - b for r, b in zip(pair, before, strict=True)]

    assert wait_for(lambda: sum(served()) == 8, 10), f"{served()}\n{router.tail()}"
    assert all(n >= 1 for n in served()), f"one replica served everything: {served()}\n{router.tail()}"
    if router.kind == "sglang":  # /server_info names the local model folder: the tokenizer never comes from the hub
        log = re.sub(r"\x1b\[[0-9;]*m", "", router.log.read_text(errors="replace"))
        assert "huggingface" not in log.lower(), router.tail()
        assert f"from source: {tiny_llama_path}\n" in log and "Successfully registered tokenizer" in log, router.tail()


def test_cache_aware_keeps_a_shared_prefix_on_one_replica(cache_router: Router, pair: list[Replica],
                                                          tiny_llama_path: Path) -> None:
    k = 6
    prefix_tokens = requests.post(pair[0].url + "/tokenize", json={"prompt": PREFIX}, timeout=10).json()["count"]
    assert prefix_tokens >= 300
    hits_before = [metric_value(r.served, HITS) for r in pair]
    e2e_before = [r.e2e() for r in pair]
    for i in range(k):
        body = {"model": "tritium", "prompt": PREFIX + f"Question {i}: what happened next?", "max_tokens": 4}
        resp = requests.post(cache_router.url + "/v1/completions", json=body, timeout=60)
        assert resp.status_code == 200, f"{resp.text}\n{cache_router.tail()}"
    for i in range(3):  # a second prefix group may go anywhere: nothing is asserted about it
        body = {"model": "tritium", "prompt": f"A recipe for soup, version {i}: first, take", "max_tokens": 4}
        assert requests.post(cache_router.url + "/v1/completions", json=body, timeout=60).status_code == 200

    def deltas() -> tuple[list[float], list[float]]:
        return ([metric_value(r.served, HITS) - b for r, b in zip(pair, hits_before, strict=True)],
                [r.e2e() - b for r, b in zip(pair, e2e_before, strict=True)])

    assert wait_for(lambda: sum(deltas()[1]) == k + 3, 10), f"{deltas()}\n{cache_router.tail()}"
    hits, _ = deltas()
    expected = (k - 1) * (prefix_tokens // BLOCK * BLOCK) * 0.9
    home = max(range(2), key=lambda i: hits[i])
    assert hits[home] >= expected, f"hits {hits}, expected >= {expected} on one replica\n{cache_router.tail()}"
    assert hits[1 - home] == 0, f"the prefix reached both replicas: hits {hits}\n{cache_router.tail()}"


def test_streams_end_with_done_and_match_the_non_streamed_text(router: Router) -> None:
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0, timeout=60)
    prompt = "Once upon a time, in a small village,"
    completion = {"model": "tritium", "prompt": prompt, "max_tokens": 12, "temperature": 0}
    expected = client.completions.create(**completion).choices[0].text
    with requests.post(router.url + "/v1/completions", json=completion | {"stream": True}, stream=True,
                       timeout=60) as resp:
        assert resp.status_code == 200, f"{resp.text}\n{router.tail()}"
        events, done = sse(resp)
    assert done, f"no data: [DONE]\n{router.tail()}"
    assert "".join(c["text"] for e in events for c in e["choices"]) == expected

    messages = [{"role": "user", "content": "Tell me a short story about a cat."}]
    chat = {"model": "tritium", "messages": messages, "max_tokens": 12, "temperature": 0}
    reply = client.chat.completions.create(**chat).choices[0].message.content
    with requests.post(router.url + "/v1/chat/completions", json=chat | {"stream": True}, stream=True,
                       timeout=60) as resp:
        assert resp.status_code == 200, f"{resp.text}\n{router.tail()}"
        events, done = sse(resp)
    assert done, f"no data: [DONE]\n{router.tail()}"
    assert "".join(c["delta"].get("content") or "" for e in events for c in e["choices"]) == reply
    assert events[-1]["choices"][0]["finish_reason"] == "length" or \
        any(c.get("finish_reason") == "length" for e in events for c in e["choices"])


@dataclass
class StreamRecord:
    lines: list[str] = field(default_factory=list)
    error: BaseException | None = None
    status: int = 0
    ended_at: float = 0.0


def read_stream(url: str, body: dict[str, Any], record: StreamRecord) -> None:
    try:
        with requests.post(url, json=body, stream=True, timeout=(5, 60)) as resp:
            record.status = resp.status_code
            for line in resp.iter_lines(decode_unicode=True):
                if line:
                    record.lines.append(line)
    except requests.RequestException as exc:
        record.error = exc
    finally:
        record.ended_at = time.monotonic()


@pytest.mark.parametrize("kind", KINDS)
def test_a_replica_killed_mid_stream_cuts_that_stream_and_the_survivor_serves_the_rest(
        kind: str, tmp_path: Path, tiny_llama_path: Path) -> None:
    replicas = start_pair(tiny_repository(tmp_path / "repo", tiny_llama_path), tiny_llama_path)
    router: Router | None = None
    try:
        router = start_router(kind, replicas, "round_robin", tmp_path / f"{kind}.log")
        prompt = "Once upon a time, in a small village,"
        body = {"model": "tritium", "prompt": prompt, "max_tokens": CONTEXT - 32, "ignore_eos": True,
                "stream": True}
        record = StreamRecord()
        reader = threading.Thread(target=read_stream, args=(router.url + "/v1/completions", body, record),
                                  daemon=True)
        reader.start()
        assert wait_for(lambda: len(record.lines) >= 3 and any(metric_value(r.served, RUNNING) > 0
                                                               for r in replicas), 30), router.tail()
        victim = next(r for r in replicas if metric_value(r.served, RUNNING) > 0)
        survivor = next(r for r in replicas if r is not victim)
        before = survivor.e2e()
        assert not record.ended_at, f"the stream ended before the kill: {record.lines[-3:]}"
        killed_at = time.monotonic()
        kill_replica(victim)
        reader.join(30)
        assert not reader.is_alive(), f"the cut stream did not end within 30 s\n{router.tail()}"
        assert record.status == 200
        assert "data: [DONE]" not in record.lines, f"the cut stream looks complete\n{router.tail()}"
        chunks = [json.loads(line[6:]) for line in record.lines if line.startswith("data: {")]
        assert chunks and all(c.get("finish_reason") is None for e in chunks for c in e.get("choices", [])), \
            record.lines[-3:]
        cut_after = record.ended_at - killed_at

        client = openai.OpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0, timeout=30)
        started = time.monotonic()
        for i in range(6):
            text = client.completions.create(model="tritium", prompt=f"After the storm, number {i},",
                                             max_tokens=4).choices[0].text
            assert text, f"request {i} got no text\n{router.tail()}"
        elapsed = time.monotonic() - started
        assert elapsed < 10, f"6 requests took {elapsed:.1f} s after the kill\n{router.tail()}"
        assert wait_for(lambda: survivor.e2e() - before == 6, 10), f"{survivor.e2e() - before}\n{router.tail()}"
        print(f"{kind}: stream cut {cut_after:.2f} s after the kill ({record.error!r}, {len(record.lines)} lines);"
              f" 6 requests in {elapsed:.2f} s")
    finally:
        if router is not None:
            router.stop()
        for r in replicas:
            stop_replica(r)
