"""`tritium serve` watches `tritium_engine_healthy` on the metrics port and unloads a model whose engine
failed, so that its ready endpoint says not ready; how it reads the metric and starts tritonserver."""

from __future__ import annotations

import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

from tritium.backend.testing.faults import LOOP_FAULT_MARKER_ENV
from tritium.client.triton.launcher import (
    PACKAGE_REPOSITORY,
    EngineHealth,
    ServerOptions,
    TritonInstall,
    TritonServer,
    dependent_ensembles,
    parse_engine_health,
)
from tritium.client.triton.repository import one_model_repository

from support.serving import (
    fake_repository,
    grpc_stream,
    metric_value,
    restricted_keys,
    server_log,
    start_serve,
    wait_for,
)

METRICS = """# HELP tritium_engine_healthy 1 while the engine serves, 0 once it failed
# TYPE tritium_engine_healthy gauge
tritium_engine_healthy{model="tritium",version="1"} 1
tritium_engine_healthy{version="2",model="tritium"} 0
tritium_engine_healthy{model="tritium_ids",version="1"} 0.000000
tritium_engine_healthy_other{model="x",version="1"} 0
tritium_num_requests_running{model="tritium",version="1"} 0
"""


def test_parse_engine_health_reads_every_sample_and_nothing_else() -> None:
    assert parse_engine_health(METRICS) == [
        EngineHealth("tritium", "1", True), EngineHealth("tritium", "2", False),
        EngineHealth("tritium_ids", "1", False),
    ]
    assert parse_engine_health("") == []
    assert parse_engine_health('tritium_engine_healthy{model="a",version="1"} NaN-ish') == []


def test_failed_engines_reports_each_model_once_until_it_serves_again(tmp_path: Path) -> None:
    server = TritonServer(ServerOptions())
    shutil.rmtree(server.runtime_dir)
    samples = parse_engine_health(METRICS)
    server.engine_health = lambda: samples  # type: ignore[method-assign]
    assert server.failed_engines() == [EngineHealth("tritium", "2", False), EngineHealth("tritium_ids", "1", False)]
    assert server.failed_engines() == []  # version 1 still healthy: tritium is not reported twice
    samples = []  # unloaded: its samples are gone
    assert server.failed_engines() == []
    samples = [EngineHealth("tritium", "1", True), EngineHealth("tritium", "2", True)]  # reloaded, serving
    assert server.failed_engines() == []
    samples = [EngineHealth("tritium", "2", False)]
    assert server.failed_engines() == [EngineHealth("tritium", "2", False)]


def test_dependent_ensembles_are_those_with_a_step_running_the_model(tmp_path: Path) -> None:
    assert dependent_ensembles(PACKAGE_REPOSITORY, "tritium_ids") == ["tritium_ensemble"]
    assert dependent_ensembles(PACKAGE_REPOSITORY, "tritium") == []
    assert dependent_ensembles(tmp_path, "tritium_ids") == []


def _command(**options: object) -> list[str]:
    server = TritonServer(ServerOptions(**options))  # type: ignore[arg-type]
    shutil.rmtree(server.runtime_dir)
    return server.command(TritonInstall(Path("tritonserver"), Path("backends"), None, []))


def test_tritonserver_runs_in_explicit_mode_with_separate_keys() -> None:
    cmd = _command()
    assert "--model-control-mode=explicit" in cmd and "--load-model=tritium" in cmd
    assert "--load-model=tritium_ids" in cmd and "--load-model=tritium_embed" not in cmd  # opt-in (--embeddings)
    assert not [a for a in cmd if "restricted" in a]
    cmd = _command(model_control="explicit", load_models=["tritium", "tritium_ids"])
    assert [a for a in cmd if a.startswith("--load-model")] == ["--load-model=tritium", "--load-model=tritium_ids"]
    cmd = _command(api_key="k1", admin_key="k2")
    assert "--http-restricted-api=metadata,inference,model-config,statistics:x-api-key=k1" in cmd
    assert "--grpc-restricted-protocol=model-repository,shared-memory,trace,logging:x-admin-key=k2" in cmd
    # Only an inference key: the admin APIs are closed by a random secret, different for every server.
    secrets = [[a.rsplit("=", 1)[1] for a in _command(api_key="k1") if "x-admin-key" in a] for _ in range(2)]
    assert len(secrets[0]) == 2 and len(set(secrets[0])) == 1 and secrets[0] != secrets[1]
    assert len(secrets[0][0]) >= 32
    cmd = _command(admin_key="k2")  # only an admin key: inference stays open
    assert [a for a in cmd if "restricted" in a and "x-api-key" in a] == []


ADMIN = "admin-0d3e9b"
API = "api-77c1f4"


def fake_infer(base: str, model: str) -> requests.Response:
    body = {"inputs": [{"name": "x", "datatype": "INT32", "shape": [1], "data": [1]}]}
    return requests.post(f"{base}/v2/models/{model}/infer", json=body, headers={"x-api-key": API}, timeout=30)


def model_ready(base: str, model: str) -> bool:
    return requests.get(f"{base}/v2/models/{model}/ready", timeout=5).status_code == 200


@pytest.mark.slow
@pytest.mark.parametrize("admin_key", [ADMIN, None], ids=["admin-key", "launcher-secret"])
def test_serve_unloads_a_model_whose_engine_failed(tmp_path: Path, admin_key: str | None) -> None:
    repo = fake_repository(tmp_path, ["sick", "well"])
    env = {"TRITIUM_API_KEY": API, "TRITIUM_ADMIN_KEY": admin_key or ""}
    served = start_serve(f"--model-repository={repo}", env=env)  # --model-control none: loads both
    try:
        assert model_ready(served.http, "sick") and model_ready(served.http, "well")
        assert fake_infer(served.http, "sick").status_code != 200  # the "engine" fails
        assert wait_for(lambda: not model_ready(served.http, "sick"), 10, 0.2)
        assert model_ready(served.http, "well")

        def states() -> dict[str, str]:
            index = requests.post(f"{served.http}/v2/repository/index", json={}, timeout=10,
                                  headers={"x-admin-key": admin_key or "", "x-api-key": API})
            assert index.status_code == (200 if admin_key else 403)  # the launcher's secret is nobody else's
            return {m["name"]: m.get("state") for m in index.json()} if admin_key else {}

        if admin_key:
            assert wait_for(lambda: states() == {"sick": "UNAVAILABLE", "well": "READY"}, 30), states()
        else:
            states()
        log = server_log(served.server_pid)
        keys = restricted_keys(served.server_pid)
    finally:
        output = served.stop()
    output = "".join(served.output) + output
    assert keys["x-api-key"] == API and keys["x-admin-key"] == (admin_key or keys["x-admin-key"])
    assert all(key not in output and key not in log for key in keys.values())
    assert "ERROR: model sick version 1: the engine failed; unloading it so that it reports not ready" in output
    assert "model well" not in output


def loop_fault_repository(dest: Path, model: Path) -> Path:
    return one_model_repository(dest, {"model": str(model), "request_timeout_s": 120, "kv_cache_bytes": 16 << 20})


def timed_generate(base: str, prompt: str, sampling: dict[str, object], timeout: float) -> tuple[int, str, float]:
    """HTTP generate: (status, body, seconds); status 0 when no answer came within `timeout`."""
    started = time.monotonic()
    try:
        resp = requests.post(f"{base}/v2/models/tritium/generate", json={"text_input": prompt} | sampling,
                             timeout=timeout)
    except requests.Timeout:
        return 0, "no answer", time.monotonic() - started
    return resp.status_code, resp.text, time.monotonic() - started


@pytest.mark.slow
def test_a_failed_engine_loop_errors_at_once_and_the_model_turns_not_ready(tmp_path: Path,
                                                                            tiny_llama_path: Path) -> None:
    """$TRITIUM_TEST_LOOP_FAULT_MARKER makes the engine loop itself fail: the engine answers every request
    with an error and sets tritium_engine_healthy to 0, and `tritium serve` unloads the model."""
    repo = loop_fault_repository(tmp_path, tiny_llama_path)
    pool = ThreadPoolExecutor(1)
    served = start_serve(f"--model-repository={repo}", env={LOOP_FAULT_MARKER_ENV: "BOOM"})
    try:
        assert metric_value(served, "tritium_engine_healthy") == 1
        long = {"max_tokens": 1000, "ignore_eos": True, "temperature": 0}
        before = metric_value(served, "tritium_generation_tokens_total")
        running = pool.submit(lambda: (grpc_stream(served.grpc, "Once upon a time", long), time.monotonic()))
        assert wait_for(lambda: metric_value(served, "tritium_generation_tokens_total") >= before + 5)
        status, body, took = timed_generate(served.http, "BOOM tell me a story", long, 15)
        assert status not in (0, 200) and took < 5, f"the BOOM request: {status} {body} after {took:.1f} s"
        failed_at = time.monotonic()
        victim, victim_ended = running.result(15)
        # The long stream ends with one error as soon as the loop failed, not after its 1000 tokens.
        assert len(victim.errors) == 1 and victim.finals == 0 and len(victim.texts) < 1000, victim.errors
        assert victim_ended < failed_at + 3
        status, body, took = timed_generate(served.http, "Once upon a time", {"max_tokens": 8}, 10)
        assert status not in (0, 200) and took < 2, f"a request after the failure: {status} {body} after {took:.1f} s"
        assert wait_for(lambda: not model_ready(served.http, "tritium"), 10, 0.2)
        log = server_log(served.server_pid)
    finally:
        output = "".join(served.output) + served.stop()
        pool.shutdown(wait=False, cancel_futures=True)
    assert "ERROR: model tritium version 1: the engine failed; unloading it so that it reports not ready" in output
    assert "the engine thread failed" in log
