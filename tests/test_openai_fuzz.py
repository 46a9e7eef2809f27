"""Schemathesis against `tritium openai` in front of a real tritonserver: no generated request may get a 5xx.

The tritonserver serves a tiny random Llama (256-token context), so the requests that pass validation
generate quickly on a CPU.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
from serve_helpers import Served, start_openai, start_serve
from test_openai import KEY

from tritium.client.triton_server import PACKAGE_REPOSITORY

pytestmark = pytest.mark.slow

# Mostly the served model id, so that most requests get past the 404 for an unknown model.
SCHEMATHESIS_CONFIG = """
[dictionaries.models]
values = ["tritium"]

[parameters]
"body.model" = { dictionary = "models", probability = 0.9 }
"""


@pytest.fixture(scope="module")
def tiny_triton(tiny_llama_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    repo = tmp_path_factory.mktemp("model-repository")
    shutil.copytree(PACKAGE_REPOSITORY / "tritium", repo / "tritium", ignore=shutil.ignore_patterns("__pycache__"))
    settings = {"model": str(tiny_llama_path), "kv_cache_bytes": 16 << 20, "max_model_len": 256,
                "request_timeout_s": 60}
    (repo / "tritium" / "1" / "model.json").write_text(json.dumps(settings))
    served = start_serve(f"--model-repository={repo}", "--model-control=explicit", "--load-model=tritium")
    yield served
    served.stop()


def test_no_generated_request_gets_a_server_error(tiny_triton: Served, tiny_llama_path: Path,
                                                   tmp_path: Path) -> None:
    proc, base = start_openai([tiny_triton.grpc], api_key=KEY, tokenizer=str(tiny_llama_path))
    try:
        config = tmp_path / "schemathesis.toml"
        config.write_text(SCHEMATHESIS_CONFIG)
        cmd = [sys.executable, "-m", "schemathesis.cli", f"--config-file={config}", "run",
               base.removesuffix("/v1") + "/openapi.json", "--checks=not_a_server_error",
               f"--header=Authorization: Bearer {KEY}", "--max-examples=100", "--seed=1",
               "--generation-database=none", "--request-timeout=120", "--no-color"]
        result = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stdout + result.stderr
        body = {"model": "tritium", "prompt": "Hello", "max_tokens": 2}
        resp = requests.post(base + "/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
        assert resp.status_code == 200 and resp.json()["choices"][0]["finish_reason"] in ("length", "stop")
    finally:
        proc.terminate()
        proc.wait(10)
