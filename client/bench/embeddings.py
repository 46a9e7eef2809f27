"""Embeddings per second: tritium in process (LLMEngine.embed) vs transformers' AutoModel encoding the same texts
(padded batches, last-token pooling, fp32), at batch 1 and batch `batch`; optionally through `/v1/embeddings` of a
`tritium serve --embeddings` + `tritium openai` started here. Results: a table on stdout and `embeddings.json`."""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from tritium.backend.models.registry import resolve_model
from tritium.client.bench.report import machine_info, write_report

WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "tritium", "pools", "hidden",
         "states", "into", "one", "vector", "for", "each", "sentence", "of", "this", "embedding", "benchmark"]


def texts(n: int, min_words: int = 8, max_words: int = 48) -> list[str]:
    """`n` deterministic texts of varied lengths."""
    out = []
    for i in range(n):
        words = min_words + (i * 7) % (max_words - min_words + 1)
        out.append(" ".join(WORDS[(i + j) % len(WORDS)] for j in range(words)))
    return out


def rate(run: Callable[[list[str]], object], items: list[str], batch: int, repeats: int) -> float:
    """Embeddings per second of `run` over `items` in batches of `batch` (best of `repeats`, after a warm-up)."""
    run(items[:batch])
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for i in range(0, len(items), batch):
            run(items[i : i + batch])
        best = min(best, time.perf_counter() - t0)
    return len(items) / best


def transformers_encoder(path: str) -> Callable[[list[str]], object]:
    import torch
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    tok.padding_side = "left"  # the last row is each text's last token
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model = AutoModel.from_pretrained(path, dtype=torch.float32).eval()

    def encode(batch: list[str]) -> object:
        with torch.inference_mode():
            enc = tok(batch, return_tensors="pt", padding=True)
            hidden = model(**enc).last_hidden_state[:, -1]
            return torch.nn.functional.normalize(hidden, dim=-1)

    return encode


def endpoint_rate(items: list[str], batch: int, repeats: int) -> float:
    """Through `/v1/embeddings` of a server and endpoint started here (the default model)."""
    import openai
    import requests

    from tritium.client.triton.launcher import free_ports

    http, grpc, metrics, port = free_ports(4)
    serve = subprocess.Popen([sys.executable, "-m", "tritium.client.cli", "serve", f"--http-port={http}",
                              f"--grpc-port={grpc}", f"--metrics-port={metrics}", "--model-control=explicit",
                              "--load-model=tritium", "--load-model=tritium_embed"],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    endpoint = None
    try:
        assert serve.stdout is not None
        for line in serve.stdout:
            if "tritium is serving" in line:
                break
        endpoint = subprocess.Popen([sys.executable, "-m", "tritium.client.cli", "openai", f"--port={port}",
                                     f"--upstream=127.0.0.1:{grpc}"], stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL)
        base = f"http://127.0.0.1:{port}"
        for _ in range(300):
            try:
                if requests.get(base + "/health", timeout=1).status_code == 200:
                    break
            except requests.RequestException:
                pass
            time.sleep(0.2)
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
        return rate(lambda b: client.embeddings.create(model="tritium", input=b), items, batch, repeats)
    finally:
        for proc in (endpoint, serve):
            if proc is not None:
                proc.terminate()
                proc.wait(60)


def run_embeddings_benchmark(model: str | None = None, num_texts: int = 256, batch: int = 32, repeats: int = 3,
                             endpoint: bool = False, out_dir: str = "bench-results") -> dict[str, Any]:
    from tritium.backend import LLM

    path = str(resolve_model(model))
    items = texts(num_texts)
    before = machine_info()["loadavg_after"]
    llm = LLM(path, device="cpu", dtype="float32", max_model_len=512, kv_cache_bytes=256 << 20,
              max_num_batched_tokens=2048)
    ours = llm.tokenizer

    def tritium(batch_items: list[str]) -> object:
        return llm.engine.embed([ours.encode(t) for t in batch_items])

    figures: dict[str, float] = {}
    for b in (1, batch):
        figures[f"tritium_batch_{b}"] = rate(tritium, items if b > 1 else items[:64], b, repeats)
    llm.shutdown()
    hf = transformers_encoder(path)
    for b in (1, batch):
        figures[f"transformers_batch_{b}"] = rate(hf, items if b > 1 else items[:64], b, repeats)
    if endpoint:
        figures[f"endpoint_batch_{batch}"] = endpoint_rate(items, batch, repeats)
    ratio = {f"ratio_batch_{b}": figures[f"tritium_batch_{b}"] / figures[f"transformers_batch_{b}"]
             for b in (1, batch)}
    print(f"embeddings / s ({path}, {num_texts} texts of 8-48 words, best of {repeats}):")
    for name, value in figures.items():
        print(f"  {name:28s} {value:9.1f}")
    for name, value in ratio.items():
        print(f"  {name:28s} {value:9.2f}x")
    report = {"model": path, "num_texts": num_texts, "batch": batch, "repeats": repeats,
              "embeddings_per_s": figures, **ratio,
              "median_tokens": statistics.median(len(ours.encode(t)) for t in items),
              "machine": machine_info(loadavg_before=before)}
    write_report(out_dir, "embeddings", report)
    return report
