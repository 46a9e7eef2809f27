"""`tritium bench lora`: what multi-LoRA costs, in one process on the default model (issue 24's goals).

1. Throughput: `num_requests` prompts (workload.synthetic_prompts, ~`input_len` tokens), greedy, ignore_eos,
   `output_len` tokens each, all submitted at once (max_num_seqs = num_requests), run twice on the same engine:
   on the base model alone, and spread round-robin over four rank-16 adapters and the base model. Output tokens
   per second of each over `repeats` pairs of runs in ABBA order (after a warm-up of both), and the ratio
   LoRA mix / base (1.0: adapters cost nothing): the median of the pairs' ratios; also the best run of each
   and their ratio.
2. Load time of a rank-16 adapter targeting all seven modules: `LLM.load_lora` (read + check the PEFT folder
   into host memory), and writing it into a device slot (LoraStacks.write, synchronized on CUDA).
3. Resident memory per adapter: its host bytes, and the device bytes one slot of the stacks takes (the stacks
   hold every slot at max_lora_rank: what a slot costs whatever the adapter's rank).

The adapters are random PEFT folders (`write_random_adapter`, also what the engine tests write) in a temporary
folder. Writes lora.json and lora.png. The figures mean something only on an otherwise idle machine.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from tritium.backend import LLM, SamplingParams
from tritium.backend.lora.adapter import MODULES, module_shapes
from tritium.backend.model_config import ModelConfig
from tritium.backend.models.registry import resolve_model
from tritium.client.bench.report import load_average, machine_info, pyplot, save_figure, write_report
from tritium.client.bench.workload import synthetic_prompts

NUM_ADAPTERS = 4
RANK = 16
_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def peft_key(layer: int, module: str, which: str) -> str:
    """The PEFT name of a LoRA weight (`which`: "A" or "B")."""
    return f"base_model.model.model.layers.{layer}.{_PARENT[module]}.{module}.lora_{which}.weight"


def write_random_adapter(dest: Path, cfg: ModelConfig, rank: int, targets: tuple[str, ...], seed: int,
                         alpha: float = 16.0, use_rslora: bool = False, std: float = 0.15,
                         **config: object) -> Path:
    """A PEFT adapter folder for a model of `cfg`: random A and B (normal, `std`; B is not zero, so it changes
    the outputs) for `targets` in every layer; extra `config` entries go into adapter_config.json as they are.
    Returns `dest`."""
    shapes = module_shapes(cfg)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg.num_hidden_layers):
        for module in targets:
            d_in, d_out = shapes[module]
            tensors[peft_key(layer, module, "A")] = torch.randn(rank, d_in, generator=gen) * std
            tensors[peft_key(layer, module, "B")] = torch.randn(d_out, rank, generator=gen) * std
    dest.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(dest / "adapter_model.safetensors"), metadata={"format": "pt"})
    adapter_config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": list(targets),
                      "use_rslora": use_rslora, "bias": "none", "lora_dropout": 0.0, "task_type": "CAUSAL_LM",
                      **config}
    (dest / "adapter_config.json").write_text(json.dumps(adapter_config), encoding="utf-8")
    return dest


@dataclass
class ThroughputRun:
    mode: str  # "base" or "lora-mix"
    output_tokens: int
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        """Output tokens per second."""
        return self.output_tokens / self.seconds if self.seconds > 0 else 0.0


def _generate(llm: LLM, prompts: list[str], params: SamplingParams, names: list[str | None], mode: str
              ) -> ThroughputRun:
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params, lora_name=names)
    seconds = time.perf_counter() - t0
    return ThroughputRun(mode, sum(len(o.token_ids) for o in outputs), seconds)


def _mix_over_base(pair: list[ThroughputRun]) -> float:
    """The LoRA-mix run's throughput over the base run's, in a pair of one of each (either order)."""
    by_mode = {r.mode: r.tokens_per_s for r in pair}
    return by_mode["lora-mix"] / by_mode["base"] if by_mode["base"] else 0.0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_loads(llm: LLM, folders: dict[str, Path]) -> dict[str, Any]:
    """`load_lora` of each folder (host read) and a write of each into slot 0 (device): seconds per adapter,
    and the median of each."""
    stacks = llm.engine.worker_info.lora_stacks
    assert stacks is not None and llm.engine.lora is not None
    load_s, write_s = [], []
    for name, folder in folders.items():
        t0 = time.perf_counter()
        llm.load_lora(name, folder)
        load_s.append(time.perf_counter() - t0)
    for name in folders:
        adapter = llm.engine.lora.get(name)
        _sync(llm.engine.device)
        t0 = time.perf_counter()
        stacks.write(0, adapter)
        _sync(llm.engine.device)
        write_s.append(time.perf_counter() - t0)
    stacks.clear(0)  # no slot is assigned yet: the manager writes slots as requests take them
    return {"load_s": load_s, "slot_write_s": write_s, "load_s_median": statistics.median(load_s),
            "slot_write_s_median": statistics.median(write_s)}


def resident_memory(llm: LLM, name: str) -> dict[str, int]:
    """Host bytes of adapter `name` and device bytes of one slot of the stacks (all slots / max_loras)."""
    stacks = llm.engine.worker_info.lora_stacks
    assert stacks is not None and llm.engine.lora is not None
    adapter = llm.engine.lora.get(name)
    slot_bytes = (stacks.nbytes + stacks.scaling.nbytes) // stacks.max_loras
    return {"host_bytes": adapter.nbytes, "device_slot_bytes": slot_bytes, "device_stacks_bytes": stacks.nbytes,
            "max_loras": stacks.max_loras, "max_lora_rank": stacks.max_rank}


def plot(report: dict[str, Any], path: Path) -> None:
    """Throughput base vs LoRA mix (left), load and slot-write time (right)."""
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.2))
    tp = report["throughput"]
    bars = left.bar(["base", f"{NUM_ADAPTERS} adapters + base"], [tp["base_tokens_per_s"], tp["lora_tokens_per_s"]],
                    color=["#7f8c8d", "#c0392b"])
    left.bar_label(bars, fmt="%.1f")
    left.set_ylabel("output tokens / s (best run)")
    left.set_title(f"{report['workload']['num_requests']} requests, ratio {tp['ratio']:.2f} (median pair)")
    load = report["load"]
    bars = right.bar(["load_lora", "slot write"], [1e3 * load["load_s_median"], 1e3 * load["slot_write_s_median"]],
                     color="#2980b9")
    right.bar_label(bars, fmt="%.1f ms")
    right.set_title(f"rank-{RANK} adapter, all seven modules")
    save_figure(fig, path, dpi=120)


def run_lora_benchmark(out_dir: str | Path = "bench_results", num_requests: int = 32, output_len: int = 128,
                       input_len: int = 64, repeats: int = 4, model: str | None = None,
                       **engine: Any) -> dict[str, Any]:
    """Run the three measurements (module docstring) on `model` (None: the default one) with extra `engine`
    settings, print them, write `lora.json` and `lora.png` into `out_dir`; returns the JSON dict."""
    path = resolve_model(model)
    cfg = ModelConfig.from_folder(path)
    prompts = synthetic_prompts(num_requests, input_len)
    names: list[str | None] = [f"lora{i}" for i in range(NUM_ADAPTERS)]
    mix = [[*names, None][i % (NUM_ADAPTERS + 1)] for i in range(num_requests)]
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    bar = tqdm(total=3 + 2 * repeats, desc="bench lora", unit="phase")
    with tempfile.TemporaryDirectory(prefix="tritium-bench-lora-") as tmp:
        folders = {str(n): write_random_adapter(Path(tmp) / str(n), cfg, RANK, MODULES, seed=i, std=0.02)
                   for i, n in enumerate(names)}
        settings = {"max_num_seqs": num_requests, "max_num_batched_tokens": max(2048, num_requests * (input_len + 16)),
                    **engine}
        llm = LLM(model, enable_lora=True, max_loras=NUM_ADAPTERS, max_lora_rank=RANK, **settings)
        bar.update(1)
        load = measure_loads(llm, folders)
        memory = resident_memory(llm, str(names[0]))
        bar.update(1)
        warm = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
        llm.generate(prompts, warm, lora_name=[None] * num_requests)
        llm.generate(prompts, warm, lora_name=mix)
        bar.update(1)
        runs: list[ThroughputRun] = []
        for i in range(repeats):  # ABBA: a host slowing down or speeding up over the runs favours neither mode
            for mode in ("base", "lora-mix") if i % 2 == 0 else ("lora-mix", "base"):
                runs.append(_generate(llm, prompts, params, mix if mode == "lora-mix" else [None] * num_requests,
                                      mode))
                bar.update(1)
    bar.close()
    base = max(r.tokens_per_s for r in runs if r.mode == "base")
    lora = max(r.tokens_per_s for r in runs if r.mode == "lora-mix")
    # each repeat's LoRA-mix run against its base run: the spread says how much a shared host moved
    pairs = [_mix_over_base(runs[i : i + 2]) for i in range(0, len(runs), 2)]
    # the headline is the pairs' median: a pair's runs are a minute apart, while the best of each mode may come
    # from a moment the shared host ran faster for one mode only
    median = statistics.median(pairs) if pairs else 0.0
    throughput = {"base_tokens_per_s": base, "lora_tokens_per_s": lora, "ratio": median,
                  "best_of_ratio": lora / base if base else 0.0, "pairwise_ratios": pairs,
                  "median_pairwise_ratio": median,
                  "runs": [asdict(r) | {"tokens_per_s": r.tokens_per_s} for r in runs]}
    print(f"throughput: ratio {median:.3f} (median of the ABBA pairs {', '.join(f'{r:.3f}' for r in pairs)}); "
          f"best of each: base {base:.1f} tok/s, {NUM_ADAPTERS} adapters + base {lora:.1f} tok/s, ratio "
          f"{throughput['best_of_ratio']:.3f}")
    print(f"load (rank {RANK}, all seven modules): load_lora {1e3 * load['load_s_median']:.1f} ms, "
          f"slot write {1e3 * load['slot_write_s_median']:.2f} ms")
    print(f"resident per adapter: host {memory['host_bytes'] / 2**20:.2f} MiB, device slot "
          f"{memory['device_slot_bytes'] / 2**20:.2f} MiB")
    report = {
        "workload": {"model": str(path), "num_requests": num_requests, "output_len": output_len,
                     "input_len": input_len, "repeats": repeats, "adapters": NUM_ADAPTERS, "rank": RANK,
                     "targets": list(MODULES), "mix": "round-robin over the adapters and the base model",
                     "greedy": True, "ignore_eos": True, "engine": {k: str(v) for k, v in settings.items()},
                     "dtype": str(llm.engine.dtype), "device": str(llm.engine.device)},
        "machine": machine_info(load_average=load_average()),
        "throughput": throughput,
        "load": load,
        "memory": memory,
    }
    write_report(out_dir, "lora", report, lambda p: plot(report, p))
    return report
