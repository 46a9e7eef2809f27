"""Schemathesis against `tritium openai` in front of a real tritonserver: no generated request may get a 5xx,
on any route of its OpenAPI schema, with strings that hold lone surrogates and control characters (a hook
adds them to the generated bodies: hypothesis leaves surrogates out of its text).

The tritonserver serves a tiny random Llama (256-token context), so the requests that pass validation
generate quickly on a CPU.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from tritium.client.triton.repository import write_model

from support.serving import API_KEY as KEY
from support.serving import Served, start_openai, start_serve

pytestmark = pytest.mark.slow

# Mostly the served model id, so that most requests get past the 404 for an unknown model.
SCHEMATHESIS_CONFIG = """
[dictionaries.models]
values = ["tritium"]

[parameters]
"body.model" = { dictionary = "models", probability = 0.9 }
"""
# Loaded by schemathesis ($SCHEMATHESIS_HOOKS): about a third of the strings in each body get a lone surrogate,
# a NUL, an escape sequence or a line separator (JSON carries them escaped, as a client may send them).
ODD_STRINGS_HOOK = """
import json
import random

import schemathesis

ODD = ["\\ud800", "\\x00", "\\x1b[31m", "\\udfff\\ud83d", "\\u0085\\u2028", "\\x7f\\x08"]


def oddify(value, rng):
    if isinstance(value, str):
        return value + rng.choice(ODD) if rng.random() < 0.35 else value
    if isinstance(value, list):
        return [oddify(v, rng) for v in value]
    if isinstance(value, dict):
        return {k: oddify(v, rng) for k, v in value.items()}
    return value


@schemathesis.hook
def map_body(context, body):
    rng = random.Random(json.dumps(body, sort_keys=True, default=str))
    return oddify(body, rng)
"""


@pytest.fixture(scope="module")
def tiny_triton(tiny_llama_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    repo = tmp_path_factory.mktemp("model-repository")
    write_model(repo, {"model": str(tiny_llama_path), "kv_cache_bytes": 16 << 20, "max_model_len": 256,
                       "request_timeout_s": 60})
    served = start_serve(f"--model-repository={repo}", "--model-control=explicit", "--load-model=tritium")
    yield served
    served.stop()


def test_no_generated_request_gets_a_server_error(tiny_triton: Served, tiny_llama_path: Path,
                                                   tmp_path: Path) -> None:
    proc, base = start_openai([tiny_triton.grpc], api_key=KEY, tokenizer=str(tiny_llama_path))
    try:
        config = tmp_path / "schemathesis.toml"
        config.write_text(SCHEMATHESIS_CONFIG)
        hooks = tmp_path / "odd_strings.py"
        hooks.write_text(ODD_STRINGS_HOOK)
        routes = requests.get(base.removesuffix("/v1") + "/openapi.json", timeout=10).json()["paths"]
        assert {"/tokenize", "/detokenize", "/v1/completions/render", "/v1/chat/completions/render", "/health",
                "/get_load", "/model_info", "/metrics", "/v1/chat/completions", "/v1/completions"} <= set(routes)
        cmd = [sys.executable, "-m", "schemathesis.cli", f"--config-file={config}", "run",
               base.removesuffix("/v1") + "/openapi.json", "--checks=not_a_server_error",
               f"--header=Authorization: Bearer {KEY}", "--max-examples=100", "--seed=1",
               "--generation-database=none", "--request-timeout=120", "--no-color"]
        env = dict(os.environ, SCHEMATHESIS_HOOKS=str(hooks))
        result = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env)
        assert result.returncode == 0, result.stdout + result.stderr
        body = {"model": "tritium", "prompt": "Hello", "max_tokens": 2}
        resp = requests.post(base + "/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
        assert resp.status_code == 200 and resp.json()["choices"][0]["finish_reason"] in ("length", "stop")
    finally:
        proc.terminate()
        proc.wait(10)
