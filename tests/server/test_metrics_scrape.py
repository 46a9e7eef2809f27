"""A replica's metrics page may be anything: NaN, Inf, cut short, not HTTP at all, or never answered. A failed
scrape means "load unknown" for that round; the router's health loop and the endpoint outlive every one of
them, and an endpoint that cannot read its replica's engine counts the requests it has in flight there
(never a silent 0)."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from tritium.client.cluster import replica_load
from tritium.client.cluster import router as router_module
from tritium.client.cluster.replica_load import EngineLoad, engine_load, parse_samples, vllm_metrics
from tritium.client.cluster.router import Router

from support.serving import fake_repository, start_openai_with, start_serve

GOOD = "\n".join([
    "# TYPE tritium_num_requests_running gauge",
    'tritium_num_requests_running{model="tritium",version="1"} 3',
    'tritium_num_requests_waiting{model="tritium",version="1"} 2',
    'tritium_kv_cache_blocks{model="tritium",version="1"} 100',
    'tritium_kv_cache_used_blocks{model="tritium",version="1"} 40',
    'tritium_engine_healthy{model="tritium",version="1"} 1',
]) + "\n"
BAD_MODES = ["nan", "inf", "cut", "garbage", "hang"]


class FakeMetrics:
    """A metrics port that answers each scrape as `mode` says: "good", "failed" (the engine reports it failed),
    "nan", "inf" (the running gauge), "cut" (a
    body shorter than its Content-Length, then the connection closes), "garbage" (not HTTP), "hang" (no answer)."""

    def __init__(self) -> None:
        self.mode = "good"
        self.scrapes = 0
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}/metrics"
        self._open: list[socket.socket] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        self.scrapes += 1
        mode = self.mode
        try:
            conn.recv(65536)
            page = GOOD
            if mode in ("nan", "inf"):
                page = GOOD.replace("} 3", "} NaN" if mode == "nan" else "} +Inf")
            elif mode == "failed":
                page = GOOD.replace('version="1"} 1', 'version="1"} 0')
            body = page.encode()
            head = f"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: {len(body)}\r\n\r\n".encode()
            if mode == "hang":
                self._open.append(conn)  # held open, never answered
                return
            if mode == "garbage":
                conn.sendall(b"\x00\x01 this is not HTTP\r\n\r\n")
            elif mode == "cut":
                conn.sendall(head.replace(str(len(body)).encode(), str(len(body) + 500).encode()) + body[:40])
            else:
                conn.sendall(head + body)
            conn.close()
        except OSError:
            pass

    def close(self) -> None:
        self._sock.close()
        for conn in self._open:
            conn.close()


@pytest.fixture
def fake() -> Iterator[FakeMetrics]:
    server = FakeMetrics()
    yield server
    server.close()


def test_a_page_with_non_finite_figures_holds_no_load_and_unknown_kv_is_left_out() -> None:
    for bad in ("NaN", "+Inf", "-Inf"):
        text = GOOD.replace("} 2", f"}} {bad}")
        assert len(parse_samples(text)) == 5
        with pytest.raises(ValueError, match=r"tritium_num_requests_waiting is .*, not a count"):
            engine_load(text, "tritium")
    own = EngineLoad.in_flight(streaming=4, not_started=2)
    page = vllm_metrics(own, "tritium")
    assert "vllm:num_requests_running{" in page and 'model_name="tritium"} 4' in page
    assert 'vllm:num_requests_waiting{engine="0",model_name="tritium"} 2' in page
    assert "kv_cache_usage_perc" not in page and "cache_config_info" not in page
    total = engine_load(GOOD, "tritium").add(own)
    assert (total.running, total.waiting, total.kv_cache_usage) == (7, 4, None)


def test_the_health_loop_outlives_every_bad_page(fake: FakeMetrics, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(router_module, "HEALTH_INTERVAL_S", 0.1)
    monkeypatch.setattr(replica_load, "SCRAPE_TIMEOUT_S", 0.3)
    (closed,) = [socket.create_server(("127.0.0.1", 0))]  # a gRPC address nobody answers: never ready
    upstream = f"127.0.0.1:{closed.getsockname()[1]}"
    closed.close()

    async def scenario() -> list[str]:
        seen = []
        router = Router([upstream], metrics_urls=[fake.url])
        fake.mode = "garbage"
        await router.start()  # a bad page at start does not stop it
        replica = router.replicas[0]
        try:
            for mode in [*BAD_MODES, "good"]:
                fake.mode = mode
                before = fake.scrapes
                deadline = time.monotonic() + 5
                while fake.scrapes < before + 2 and time.monotonic() < deadline:  # two rounds of this page
                    await asyncio.sleep(0.05)
                await asyncio.sleep(0.5 if mode == "hang" else 0.2)
                assert router._health_task is not None and not router._health_task.done(), mode
                load = replica.load
                seen.append(f"{mode}: {'unknown' if load is None else (load.running, load.waiting)}")
        finally:
            await router.close()
        return seen

    seen = asyncio.run(scenario())
    assert seen == [f"{mode}: unknown" for mode in BAD_MODES] + ["good: (3, 2)"]


@pytest.mark.slow
def test_the_endpoint_starts_and_serves_through_bad_pages(fake: FakeMetrics, tmp_path: Path) -> None:
    served = start_serve(f"--model-repository={fake_repository(tmp_path / 'repo', ['tritium'])}")
    fake.mode = "hang"
    proc = None
    try:
        proc, base = start_openai_with([served.grpc], f"--upstream-metrics={fake.url}")
        root = base.removesuffix("/v1")
        for mode in [*BAD_MODES, "good"]:
            fake.mode = mode
            time.sleep(2.5)  # two health rounds of this page
            health = requests.get(root + "/health", timeout=10)
            assert health.status_code == 200, (mode, health.text)
            load = requests.get(root + "/get_load", timeout=10).json()
            if mode == "good":
                assert (load["load"], load["kv_cache_usage_perc"]) == (5, 0.4), load
            else:  # unknown: counted from the endpoint's own requests (none), KV left out
                assert load["load"] == 0 and "kv_cache_usage_perc" not in load, (mode, load)
        fake.mode = "failed"  # the engine reports it failed: the replica is down within two rounds
        time.sleep(2.5)
        assert requests.get(root + "/health", timeout=10).status_code == 503
        assert proc.poll() is None
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(10)
        served.stop()
