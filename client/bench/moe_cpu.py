"""Mixture-of-experts on this CPU (the torch path: tokens grouped by expert, only the experts they picked read).

Decode: random checkpoints written by transformers at hidden 1024, 8 layers, 16 heads x 64 (4 KV heads): a Mixtral
of 8 experts of intermediate 1024, top 2, against a Mistral whose MLP is the size of two experts (2048), the same
in every other way; the median engine step of `batch` sequences decoding after a 32-token prompt, at each batch
size. The goal: the MoE step within 1.3x of the dense one. Layer: one MoE layer of that shape at each batch size,
its experts stacked (the reference fused_moe: what the engine runs) against each packed for oneDNN. Families: the tiny
MoE families (Qwen3-MoE, Mixtral: hidden 256, 4 layers, 8 experts of 256, top 2) beside the dense model of the same
active size (Qwen3, Mistral with intermediate 512): output tokens / s in-process, 16 requests.
Results: tables on stdout, `moe_cpu.json` in `out_dir`.
"""

from __future__ import annotations

import gc
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tritium.backend import LLM, SamplingParams
from tritium.backend.layers.attention import get_attention_backend
from tritium.backend.layers.linear import CpuPackedLinear
from tritium.backend.layers.moe import FusedMoE, route
from tritium.backend.models.registry import resolve_model
from tritium.client.bench.checkpoints import save_random_model
from tritium.client.bench.families import tokens_per_s
from tritium.client.bench.report import machine_info, write_report
from tritium.client.bench.workload import random_token_prompts
from tritium.kernels.reference import moe_activation

DECODE_SHAPE = {"hidden_size": 1024, "num_hidden_layers": 8, "num_attention_heads": 16, "num_key_value_heads": 4,
                "head_dim": 64, "vocab_size": 49152}
EXPERTS, TOP_K, EXPERT_SIZE = 8, 2, 1024
TINY_SHAPE = {"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 64, "vocab_size": 49152}
TINY_EXPERT_SIZE = 256


def write_checkpoint(kind: str, dest: Path, default: Path, shape: dict[str, int], expert_size: int) -> Path:
    """A random fp32 checkpoint written by transformers: `kind` mixtral / qwen3_moe (EXPERTS experts of
    `expert_size`, top TOP_K), or mistral / qwen3 with an MLP of TOP_K x `expert_size`; the default model's
    tokenizer."""
    import transformers

    common: dict[str, Any] = {**shape, "max_position_embeddings": 4096, "bos_token_id": 1, "eos_token_id": 2,
                              "tie_word_embeddings": True}
    moe = {"num_experts_per_tok": TOP_K}
    configs = {
        "mixtral": lambda: transformers.MixtralConfig(**common, **moe, num_local_experts=EXPERTS,
                                                      intermediate_size=expert_size),
        "mistral": lambda: transformers.MistralConfig(**common, intermediate_size=TOP_K * expert_size),
        "qwen3_moe": lambda: transformers.Qwen3MoeConfig(**common, **moe, num_experts=EXPERTS, norm_topk_prob=True,
                                                         moe_intermediate_size=expert_size,
                                                         intermediate_size=TOP_K * expert_size),
        "qwen3": lambda: transformers.Qwen3Config(**common, intermediate_size=TOP_K * expert_size),
    }
    return save_random_model(configs[kind](), dest, default)


def decode_step_ms(path: Path, batches: list[int], steps: int) -> list[float]:
    """Median ms of an engine step with `batch` sequences decoding (after their 32-token prompts), per batch."""
    llm = LLM(str(path), max_num_seqs=max(batches), max_model_len=256, enable_prefix_caching=False)
    engine = llm.engine
    out = []
    for batch in batches:
        params = SamplingParams(temperature=0, max_tokens=steps + 2, ignore_eos=True)
        for i, prompt in enumerate(random_token_prompts(batch, 32, 32, seed=batch)):
            engine.add_request(f"b{batch}-{i}", prompt_token_ids=prompt, params=params)
        started: set[str] = set()
        while len(started) < batch:  # the prompts, until every sequence has its first token
            started.update(o.request_id for o in engine.step() if o.delta_token_ids)
        times = []
        while engine.has_unfinished_requests():
            t0 = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t0)
        out.append(1000 * statistics.median(times[:steps]))
    del llm
    gc.collect()
    return out


def packed_experts(moe: FusedMoE) -> Callable[[torch.Tensor], torch.Tensor]:
    """`moe` with each expert's projections packed for oneDNN (CpuPackedLinear), tokens grouped by expert as the
    reference fused_moe groups them: the alternative layers/moe.py measured and did not keep."""
    w13 = [CpuPackedLinear(w, None) for w in moe.w13]
    w2 = [CpuPackedLinear(w, None) for w in moe.w2]

    def forward(x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(moe.router(x), moe.top_k, moe.routing, moe.renormalize)
        flat = ids.reshape(-1).long()
        order = flat.argsort(stable=True)
        rows, pair_weights = order // moe.top_k, weights.reshape(-1)[order]
        out = torch.zeros(x.shape, dtype=torch.float32)
        start = 0
        for expert, count in enumerate(torch.bincount(flat, minlength=moe.num_experts).tolist()):
            if count:
                tokens = rows[start : start + count]
                act = moe_activation(w13[expert](x.index_select(0, tokens)).float(), moe.activation).to(x.dtype)
                out.index_add_(0, tokens, w2[expert](act).float() * pair_weights[start : start + count, None])
                start += count
        return out.to(x.dtype)

    return forward


@torch.inference_mode()
def layer_us(batches: list[int], reps: int = 50) -> dict[str, list[float]]:
    """Median microseconds of one MoE layer (DECODE_SHAPE's hidden, EXPERTS x EXPERT_SIZE, top TOP_K) per batch,
    the forms alternating: stacked experts through the reference fused_moe (the engine's CPU path), each expert
    packed for oneDNN, and the dense model's MLP (TOP_K x EXPERT_SIZE, packed)."""
    torch.manual_seed(0)
    hidden = DECODE_SHAPE["hidden_size"]
    moe = FusedMoE(hidden, EXPERT_SIZE, EXPERTS, TOP_K, get_attention_backend("torch", torch.device("cpu")))
    for p in moe.parameters():
        p.data.normal_(0.0, 0.02)
    gate_up = CpuPackedLinear(0.02 * torch.randn(2 * TOP_K * EXPERT_SIZE, hidden), None)
    down = CpuPackedLinear(0.02 * torch.randn(hidden, TOP_K * EXPERT_SIZE), None)

    def dense(x: torch.Tensor) -> torch.Tensor:  # the dense model's MLP, as the engine runs it
        result: torch.Tensor = down(moe_activation(gate_up(x), "silu"))
        return result

    forms = {"stacked": moe, "packed": packed_experts(moe), "dense": dense}
    times: dict[str, list[list[float]]] = {name: [[] for _ in batches] for name in forms}
    inputs = [torch.randn(b, hidden) for b in batches]
    for _ in range(reps):
        for i, x in enumerate(inputs):
            for name, form in forms.items():
                t0 = time.perf_counter()
                form(x)
                times[name][i].append(time.perf_counter() - t0)
    return {name: [1e6 * statistics.median(t[3:]) for t in per_batch] for name, per_batch in times.items()}


def family_tokens_per_s(path: Path, prompts: list[list[int]], output_len: int) -> float:
    """Output tokens / s of the checkpoint at `path` on `prompts` (bench/families.py's measure)."""
    llm = LLM(str(path), max_num_seqs=len(prompts), max_model_len=512)
    rate = tokens_per_s(llm, prompts, output_len)
    del llm
    gc.collect()
    return rate


def run_moe_cpu_benchmark(batches: tuple[int, ...] = (1, 8, 32), steps: int = 16, num_requests: int = 16,
                          output_len: int = 64, out_dir: str | Path = "bench_results") -> dict[str, Any]:
    """Run the three parts, print their tables, write `moe_cpu.json`; returns the JSON dict."""
    default = resolve_model(None)
    work = Path(tempfile.mkdtemp(prefix="tritium-moe-cpu-"))
    try:
        decode: dict[str, list[float]] = {}
        for kind in ("mixtral", "mistral"):
            path = write_checkpoint(kind, work / kind, default, DECODE_SHAPE, EXPERT_SIZE)
            decode[kind] = decode_step_ms(path, list(batches), steps)
            shutil.rmtree(path)
        layer = layer_us(list(batches))
        prompts = random_token_prompts(num_requests, 32, 128)
        families: dict[str, float] = {}
        for kind in ("qwen3_moe", "qwen3", "mixtral", "mistral"):
            path = write_checkpoint(kind, work / f"tiny-{kind}", default, TINY_SHAPE, TINY_EXPERT_SIZE)
            families[kind] = family_tokens_per_s(path, prompts, output_len)
            shutil.rmtree(path)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"decode step, ms (median of {steps}); MoE {EXPERTS} x {EXPERT_SIZE} top {TOP_K} vs dense MLP "
          f"{TOP_K * EXPERT_SIZE}, hidden {DECODE_SHAPE['hidden_size']}, {DECODE_SHAPE['num_hidden_layers']} layers")
    print(f"{'batch':>6} {'mixtral':>9} {'mistral':>9} {'ratio':>7}")
    for i, b in enumerate(batches):
        print(f"{b:6d} {decode['mixtral'][i]:9.2f} {decode['mistral'][i]:9.2f} "
              f"{decode['mixtral'][i] / decode['mistral'][i]:7.2f}")
    print("\none MoE layer, us (median): experts stacked (reference fused_moe, the engine's) vs packed (oneDNN)")
    print(f"{'batch':>6} {'stacked':>9} {'packed':>9} {'dense MLP':>10}")
    for i, b in enumerate(batches):
        print(f"{b:6d} {layer['stacked'][i]:9.1f} {layer['packed'][i]:9.1f} {layer['dense'][i]:10.1f}")
    print(f"\ntiny families, output tokens/s ({num_requests} requests x {output_len})")
    for moe, dense in (("qwen3_moe", "qwen3"), ("mixtral", "mistral")):
        print(f"{moe:10} {families[moe]:8.1f}   {dense:8} {families[dense]:8.1f}   "
              f"ratio {families[moe] / families[dense]:.2f}")
    report = {"machine": machine_info(), "batches": list(batches), "decode_ms": decode, "layer_us": layer,
              "families_tokens_per_s": families, "shape": DECODE_SHAPE, "experts": EXPERTS, "top_k": TOP_K,
              "expert_size": EXPERT_SIZE}
    write_report(out_dir, "moe_cpu", report)
    return report
