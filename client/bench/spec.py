"""`tritium bench spec`: what speculative decoding does to one stream (issue 25's goal), in one process.

Two workloads, each `num_requests` requests run one at a time (one stream), greedy, `output_len` tokens each
(ignore_eos): "repeating" asks the model to repeat a given paragraph (prompt lookup finds the text ahead of it)
and "open" asks for new text (nothing to look up). Each runs on two engines over the same model: without
speculation and with `{"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2,
"prompt_lookup_max": 4}`, alternating, `repeats` times (the best run of each kept), after a warm-up request on
each; with `draft_model` (a folder) or `draft_layers` (N: the first N layers of the target model, written
into `out_dir`, the same tokenizer and head) a third engine speculates with `{"method": "draft_model"}`, same k.
Per run: ITL p50 over the requests (AIPerf's per-request ITL: (last token - first token) / (tokens - 1)),
output tokens per second of the stream, and with speculation the acceptance rate and mean acceptance length
(vLLM's figures, from the requests' `spec_decoding`). The ratio is ITL without / ITL with n-gram speculation
(goal: >= 2 on "repeating", >= 0.95 on "open"); `draft_itl_ratio` the same for the draft model. Writes
spec.json and spec.png. The figures mean something only on an otherwise idle machine.
"""

from __future__ import annotations

import json
import shutil
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tritium.backend import LLM, SamplingParams
from tritium.backend.models.registry import resolve_model
from tritium.client.bench.report import load_average, machine_info, pyplot, save_figure, write_report

PARAGRAPHS = [
    "The river rose slowly through the night, and by morning the low fields along the valley were under water. "
    "Farmers moved their animals to the hills, the school closed for a week, and the old stone bridge, which had "
    "stood for two hundred years, lost one of its arches to the current.",
    "To make the bread, mix the flour, the salt and the yeast in a large bowl, add warm water a little at a time "
    "and knead the dough for ten minutes until it is smooth. Leave it covered in a warm place for an hour, shape "
    "it into a loaf and bake it for forty minutes.",
    "The committee met on Tuesday to review the budget for the coming year. It agreed to repair the library roof, "
    "to buy two new buses for the school routes and to postpone the plan for a swimming pool until the town has "
    "found a second source of funding.",
    "Light from the nearest star other than the sun takes a little over four years to reach the earth. The stars "
    "we see at night are mostly within a few thousand light years, a small part of a galaxy that is about one "
    "hundred thousand light years across.",
]
OPEN_PROMPTS = ["Write a story about a lighthouse keeper who finds a strange map.",
                "Describe a day in the life of a city bus driver.",
                "Explain to a child how rain forms, with an example.",
                "Write a letter from a traveller who has just arrived in a new country."]


def truncated_copy(source: Path, dest: Path, num_layers: int) -> Path:
    """Write the model in `source` cut to its first `num_layers` decoder layers into `dest` (same tokenizer,
    embeddings, final norm and head): a cheap draft model for it. Returns `dest`. Raises ValueError when
    `num_layers` is not less than the model's."""
    from safetensors.torch import load_file, save_file

    config = json.loads((source / "config.json").read_text(encoding="utf-8"))
    if not 0 < num_layers < config["num_hidden_layers"]:
        raise ValueError(f"draft layers must be in 1..{config['num_hidden_layers'] - 1}, got {num_layers}")
    dest.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "special_tokens_map.json"):
        if (source / name).is_file():
            shutil.copy(source / name, dest / name)
    (dest / "config.json").write_text(json.dumps(config | {"num_hidden_layers": num_layers}), encoding="utf-8")
    tensors: dict[str, Any] = {}
    for f in sorted(source.glob("*.safetensors")):
        tensors |= {k: v for k, v in load_file(str(f)).items()
                    if not k.startswith("model.layers.") or int(k.split(".")[2]) < num_layers}
    save_file(tensors, str(dest / "model.safetensors"), metadata={"format": "pt"})
    return dest


def repeating_prompt(paragraph: str) -> str:
    """The repeating workload's prompt for `paragraph`."""
    return f"Repeat the following text exactly.\nText: {paragraph}\nRepeated text: {paragraph}\nRepeated text:"


@dataclass
class Run:
    workload: str  # "repeating" or "open"
    arm: str  # "off" (no speculation), "ngram" or "draft" (a draft model)
    itl_p50_s: float
    tokens_per_s: float
    output_tokens: int
    draft_tokens: int
    accepted_tokens: int
    spec_steps: int

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted tokens (0 without drafts)."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verification step, the bonus token included (1 without steps)."""
        return 1.0 + self.accepted_tokens / self.spec_steps if self.spec_steps else 1.0


def one_stream(llm: LLM, prompts: list[str], params: SamplingParams, workload: str, arm: str) -> Run:
    """Run `prompts` one at a time on `llm`, timing each output as it comes out of `step`."""
    engine = llm.engine
    itls, tokens, busy = [], 0, 0.0
    drafts = accepted = steps = 0
    for i, prompt in enumerate(prompts):
        rid = f"spec-bench-{workload}-{arm}-{time.monotonic_ns()}-{i}"
        engine.add_request(rid, prompt, params)
        first = last = None
        n = 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                now = time.perf_counter()
                if out.request_id != rid or not out.delta_token_ids:
                    continue
                n += len(out.delta_token_ids)
                first = now if first is None else first
                last = now
                if out.finished and out.spec_decoding is not None:
                    s = out.spec_decoding
                    drafts, accepted, steps = drafts + s.num_draft_tokens, accepted + s.num_accepted_tokens, \
                        steps + s.num_spec_steps
        if first is not None and last is not None and n > 1:
            itls.append((last - first) / (n - 1))
            busy += last - first
        tokens += n
    return Run(workload, arm, statistics.median(itls) if itls else 0.0,
               (tokens - len(prompts)) / busy if busy else 0.0, tokens, drafts, accepted, steps)


def plot(report: dict[str, Any], path: Path) -> None:
    """ITL p50 without and with speculation per workload (left), and mean acceptance length (right)."""
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.2))
    names = list(report["results"])
    arms = [a for a in (("off", "no speculation", "#7f8c8d"), ("ngram", "n-gram", "#c0392b"),
                        ("draft", "draft model", "#8e44ad")) if a[0] in report["results"][names[0]]]
    width = 0.8 / len(arms)
    for j, (key, label, color) in enumerate(arms):
        values = [1e3 * report["results"][w][key]["itl_p50_s"] for w in names]
        offset = (j - (len(arms) - 1) / 2) * width
        bars = left.bar([i + offset for i in range(len(names))], values, width, label=label, color=color)
        left.bar_label(bars, fmt="%.1f")
        if key != "off":
            rates = [report["results"][w][key]["mean_acceptance_length"] for w in names]
            bars = right.bar([i + offset for i in range(len(names))], rates, width, label=label, color=color)
            right.bar_label(bars, fmt="%.2f")
    left.set_xticks(range(len(names)), [f"{w}\n(x{report['results'][w]['itl_ratio']:.2f})" for w in names])
    left.set_ylabel("ITL p50 (ms)")
    left.legend()
    right.set_xticks(range(len(names)), names)
    right.legend()
    right.set_ylabel("mean acceptance length")
    right.set_title(f"k = {report['workload']['num_speculative_tokens']}")
    save_figure(fig, path, dpi=120)


def run_spec_benchmark(out_dir: str | Path = "bench_results", num_requests: int = 4, output_len: int = 128,
                       repeats: int = 2, num_speculative_tokens: int = 4, smoke: bool = False,
                       model: str | None = None, draft_model: str | None = None, draft_layers: int | None = None,
                       **engine: Any) -> dict[str, Any]:
    """Run both workloads without and with n-gram speculation, and with `draft_model` / `draft_layers` a draft
    model (module docstring), on `model` (None: the default one) with extra `engine` settings; print, write
    spec.json and spec.png into `out_dir`; returns the JSON dict. `smoke`: one request of 8 tokens, one repeat
    (checks the script; its figures mean nothing). Raises ValueError for a bad `draft_layers`."""
    if smoke:
        num_requests, output_len, repeats = 1, 8, 1
    workloads = {"repeating": [repeating_prompt(PARAGRAPHS[i % len(PARAGRAPHS)]) for i in range(num_requests)],
                 "open": [OPEN_PROMPTS[i % len(OPEN_PROMPTS)] for i in range(num_requests)]}
    spec_config = {"method": "ngram", "num_speculative_tokens": num_speculative_tokens, "prompt_lookup_min": 2,
                   "prompt_lookup_max": 4}
    settings = {"max_num_seqs": 4, "max_model_len": 1024, **engine}
    if draft_layers is not None:
        draft_model = str(truncated_copy(resolve_model(model), Path(out_dir) / f"draft-{draft_layers}-layers",
                                         draft_layers))
    draft_config = {"method": "draft_model", "model": draft_model, "num_speculative_tokens": num_speculative_tokens}
    arms: dict[str, dict[str, Any] | None] = {"off": None, "ngram": spec_config}
    if draft_model is not None:
        arms["draft"] = draft_config
    engines = {key: LLM(model, speculative_config=config, **settings) for key, config in arms.items()}
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    before = load_average()
    for llm in engines.values():  # warm-up
        llm.generate(workloads["repeating"][0], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    runs: list[Run] = []
    for _ in range(repeats):
        for name, prompts in workloads.items():
            for key, llm in engines.items():
                runs.append(one_stream(llm, prompts, params, name, key))
    results: dict[str, Any] = {}
    for name in workloads:
        best = {key: min((r for r in runs if r.workload == name and r.arm == key), key=lambda r: r.itl_p50_s)
                for key in engines}
        off = best["off"]
        results[name] = {key: asdict(r) | {"acceptance_rate": r.acceptance_rate,
                                           "mean_acceptance_length": r.mean_acceptance_length}
                         for key, r in best.items()}
        for key, prefix in (("ngram", ""), ("draft", "draft_")):
            if key not in best:
                continue
            on = best[key]
            results[name][f"{prefix}itl_ratio"] = off.itl_p50_s / on.itl_p50_s if on.itl_p50_s else 0.0
            results[name][f"{prefix}tokens_per_s_ratio"] = on.tokens_per_s / off.tokens_per_s \
                if off.tokens_per_s else 0.0
            print(f"{name}: ITL p50 {1e3 * off.itl_p50_s:.2f} ms -> {1e3 * on.itl_p50_s:.2f} ms with {key} "
                  f"(x{results[name][f'{prefix}itl_ratio']:.2f}), {off.tokens_per_s:.1f} -> {on.tokens_per_s:.1f} "
                  f"tok/s, acceptance {on.acceptance_rate:.2f}, mean acceptance length "
                  f"{on.mean_acceptance_length:.2f}")
    engine0 = engines["off"].engine
    report = {
        "workload": {"model": str(engine0.model_path), "num_requests": num_requests, "output_len": output_len,
                     "repeats": repeats, "num_speculative_tokens": num_speculative_tokens, "streams": 1,
                     "speculative_config": spec_config,
                     "draft_speculative_config": draft_config if draft_model is not None else None,
                     "greedy": True, "ignore_eos": True, "smoke": smoke,
                     "engine": {k: str(v) for k, v in settings.items()}, "dtype": str(engine0.dtype),
                     "device": str(engine0.device)},
        "machine": machine_info(loadavg_before=before),
        "results": results,
        "runs": [asdict(r) for r in runs],
    }
    write_report(out_dir, "spec", report, lambda p: plot(report, p))
    return report
