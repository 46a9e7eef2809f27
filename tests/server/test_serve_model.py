"""`tritium serve --model FOLDER` on a real tritonserver: a tiny random Qwen3 checkpoint served by name answers over
HTTP and through the OpenAI endpoint, whose model id follows it; a folder that cannot load fails `tritium serve`
with the loader's message before any tritonserver starts."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import requests

from tritium.backend import LLM, SamplingParams
from tritium.client.triton.served_model import ServedModel, read_served_model

from support.checkpoints import save_tiny
from support.serving import Served, http_generate, start_openai_with, start_serve

pytestmark = pytest.mark.slow
PROMPT = "Once upon a time, in a small village,"
TOKENS = 8


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory, default_model_path: Path) -> Path:
    return save_tiny("qwen3", tmp_path_factory.mktemp("models") / "tiny-qwen3", default_model_path)


@pytest.fixture(scope="module")
def expected(tiny: Path) -> str:
    """PROMPT's greedy continuation by the tiny model in this process."""
    llm = LLM(str(tiny), kv_cache_bytes=16 << 20, max_model_len=256)
    text = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True))[0].text
    del llm
    gc.collect()
    return text


@pytest.fixture(scope="module")
def triton(tiny: Path, expected: str) -> Iterator[Served]:
    served = start_serve(f"--model={tiny}", "--model-control=explicit", "--load-model=tritium")
    yield served
    served.stop()


def test_the_served_model_answers_over_http_and_says_what_it_is(triton: Served, tiny: Path, expected: str) -> None:
    assert "serving the model as 'tiny-qwen3'" in "".join(triton.output)
    reply = http_generate(triton.http, {"text_input": PROMPT, "max_tokens": TOKENS, "temperature": 0,
                                        "ignore_eos": True, "exclude_input_in_output": True})
    assert reply.status_code == 200, reply.text
    assert reply.json()["text_output"] == expected
    for url in (triton.http, triton.grpc):
        assert read_served_model(url) == ServedModel("tiny-qwen3", str(tiny.resolve()))


def test_generate_streams_from_the_served_model(triton: Served, expected: str) -> None:
    out = subprocess.run([sys.executable, "-m", "tritium.client.cli", "generate", "--url", triton.http,
                          "--temperature=0", f"--max-tokens={TOKENS}", PROMPT],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout == expected + "\n"


def test_the_openai_model_id_follows_the_served_model(triton: Served, tiny: Path, expected: str) -> None:
    proc, base = start_openai_with([triton.grpc], "--expose-model-path")
    try:
        client = openai.OpenAI(base_url=base, api_key="unused", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["tiny-qwen3"]
        info = requests.get(base.removesuffix("/v1") + "/model_info", timeout=5).json()
        assert info["served_model_name"] == "tiny-qwen3" and info["model_path"] == str(tiny.resolve())
        for name in ("tiny-qwen3", "tritium"):  # the Triton model's name is still accepted
            out = client.completions.create(model=name, prompt=PROMPT, max_tokens=TOKENS, temperature=0,
                                            extra_body={"ignore_eos": True})
            assert out.model == name and out.choices[0].text == expected
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPT, max_tokens=1)
    finally:
        proc.terminate()
        proc.wait(10)


def test_a_folder_that_cannot_load_fails_serve_before_tritonserver(tmp_path: Path, tiny: Path) -> None:
    bad = tmp_path / "gpt2"
    bad.mkdir()
    config = json.loads((tiny / "config.json").read_text()) | {"architectures": ["GPT2LMHeadModel"]}
    (bad / "config.json").write_text(json.dumps(config))
    out = subprocess.run([sys.executable, "-m", "tritium.client.cli", "serve", f"--model={bad}"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert out.stderr.startswith(f"error: --model {bad}: {bad / 'config.json'}: unsupported architecture "
                                 "'GPT2LMHeadModel'"), out.stderr
    assert "starting tritonserver" not in out.stdout and "Traceback" not in out.stderr
