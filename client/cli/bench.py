"""`tritium bench ...`: each benchmark's options, and a thin adapter onto its library function in client/bench/.

SCENARIOS, at the end, is the table the subcommands are registered from (in `tritium bench --help` order): each
scenario's name, help, the function that adds its options and the one it runs. Every adapter imports its benchmark
only when it runs, so `tritium --help` stays fast. `tritium bench aiperf` is forwarded whole to
client/bench/aiperf.py, which declares its own options (`add_arguments(parser)`) and runs (`run(args) -> int`); that
module is imported only when the subcommand runs.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tritium.client.cli import options

AIPERF_MODULE = "tritium.client.bench.aiperf"
FORWARDED = "forwarded_args"  # the Namespace attribute that carries a forwarding subcommand's arguments


@dataclass(frozen=True)
class Scenario:
    """A `tritium bench` subcommand. `forwards`: it declares no options; everything after its name (--help too)
    reaches `run` in the Namespace's FORWARDED attribute."""

    name: str
    help: str
    add_options: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    forwards: bool = False


def add_parser(subparsers: Any) -> None:
    """Register `bench` and a subcommand for each of SCENARIOS on the top-level subparsers."""
    bench = subparsers.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    for scenario in SCENARIOS:
        p = bench.add_parser(scenario.name, help=scenario.help, add_help=not scenario.forwards)
        scenario.add_options(p)
        p.set_defaults(func=scenario.run, **({FORWARDED: []} if scenario.forwards else {}))


def offline_options(p: argparse.ArgumentParser) -> None:
    """`tritium bench offline`'s options."""
    options.num_requests(p, 32)
    options.output_len(p, 128)
    p.add_argument("--min-prompt", type=int, default=32)
    p.add_argument("--max-prompt", type=int, default=256)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--skip-transformers", action="store_true")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="tritium's dtype (auto: float32 on a CPU, bfloat16 on CUDA)")
    options.quantization(p, help="tritium's weight-only quantization (int4: CPU only)")
    options.out_dir(p)


def run_offline(args: argparse.Namespace) -> int:
    """bench/offline.py; returns 0."""
    from tritium.client.bench.offline import run_offline_benchmark

    run_offline_benchmark(num_requests=args.num_requests, output_len=args.output_len, min_prompt=args.min_prompt,
                          max_prompt=args.max_prompt, skip_transformers=args.skip_transformers,
                          out_dir=args.out_dir, max_num_seqs=args.max_num_seqs, dtype=args.dtype,
                          quantization=args.quantization)
    return 0


def lora_options(p: argparse.ArgumentParser) -> None:
    """`tritium bench lora`'s options."""
    options.num_requests(p, 32, help="requests submitted at once, round-robin over 4 adapters and the base model")
    options.output_len(p, 128)
    p.add_argument("--input-len", type=int, default=64, help="prompt tokens (about)")
    p.add_argument("--repeats", type=int, default=4,
                   help="base / LoRA-mix run pairs, in ABBA order; the best of each and the pairs' median ratio")
    options.out_dir(p)


def run_lora(args: argparse.Namespace) -> int:
    """bench/lora.py; returns 0."""
    from tritium.client.bench.lora import run_lora_benchmark

    run_lora_benchmark(out_dir=args.out_dir, num_requests=args.num_requests, output_len=args.output_len,
                       input_len=args.input_len, repeats=args.repeats)
    return 0


def spec_options(p: argparse.ArgumentParser) -> None:
    """`tritium bench spec`'s options."""
    options.num_requests(p, 4, help="requests per workload, one at a time")
    options.output_len(p, 128)
    p.add_argument("--repeats", type=int, default=2, help="runs of each workload and engine, alternating; the best")
    p.add_argument("--num-speculative-tokens", type=int, default=4, help="k: draft tokens per step at most")
    draft = p.add_mutually_exclusive_group()
    draft.add_argument("--draft-model", default=None, metavar="FOLDER",
                       help="also speculate with this draft model (same tokenizer as the target)")
    draft.add_argument("--draft-layers", type=int, default=None, metavar="N",
                       help="also speculate with a draft made of the target's first N layers (written to --out-dir)")
    options.smoke(p, help="one request of 8 tokens, one repeat: checks the script")
    options.out_dir(p)


def run_spec(args: argparse.Namespace) -> int:
    """bench/spec.py; returns 0."""
    from tritium.client.bench.spec import run_spec_benchmark

    run_spec_benchmark(out_dir=args.out_dir, num_requests=args.num_requests, output_len=args.output_len,
                       repeats=args.repeats, num_speculative_tokens=args.num_speculative_tokens, smoke=args.smoke,
                       draft_model=args.draft_model, draft_layers=args.draft_layers)
    return 0


def families_options(p: argparse.ArgumentParser) -> None:
    """`tritium bench families`' options."""
    options.num_requests(p, 16)
    options.output_len(p, 64)
    p.add_argument("--window", type=int, default=512, help="the windowed Mistral's sliding_window")
    p.add_argument("--contexts", type=int, nargs="+", default=[512, 1024, 2048, 4096],
                   help="prompt lengths the decode time is measured after")
    options.out_dir(p)


def run_families(args: argparse.Namespace) -> int:
    """bench/families.py; returns 0."""
    from tritium.client.bench.families import run_families_benchmark

    run_families_benchmark(num_requests=args.num_requests, output_len=args.output_len, window=args.window,
                           contexts=tuple(args.contexts), out_dir=args.out_dir)
    return 0


def embeddings_options(p: argparse.ArgumentParser) -> None:
    """`tritium bench embeddings`' options."""
    options.model(p, help="the model (default: the embedded default)")
    p.add_argument("--num-texts", type=int, default=256, help="texts embedded per run")
    p.add_argument("--batch", type=int, default=32, help="the batched run's batch size (batch 1 is run too)")
    p.add_argument("--repeats", type=int, default=3, help="runs per figure (the best is kept)")
    p.add_argument("--endpoint", action="store_true",
                   help="also through /v1/embeddings of a tritium serve + tritium openai started here")
    options.out_dir(p)


def run_embeddings(args: argparse.Namespace) -> int:
    """bench/embeddings.py; returns 0."""
    from tritium.client.bench.embeddings import run_embeddings_benchmark

    run_embeddings_benchmark(model=args.model, num_texts=args.num_texts, batch=args.batch, repeats=args.repeats,
                             endpoint=args.endpoint, out_dir=args.out_dir)
    return 0


def moe_cpu_options(p: argparse.ArgumentParser) -> None:
    """`tritium bench moe-cpu`'s options."""
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32], help="decode batch sizes")
    p.add_argument("--steps", type=int, default=16, help="decode steps timed per batch size (their median)")
    options.num_requests(p, 16, help="requests of the tiny families' tokens/s run")
    options.output_len(p, 64)
    options.out_dir(p)


def run_moe_cpu(args: argparse.Namespace) -> int:
    """bench/moe_cpu.py; returns 0."""
    from tritium.client.bench.moe_cpu import run_moe_cpu_benchmark

    run_moe_cpu_benchmark(batches=tuple(args.batches), steps=args.steps, num_requests=args.num_requests,
                          output_len=args.output_len, out_dir=args.out_dir)
    return 0


def tp_options(p: argparse.ArgumentParser) -> None:
    """`tritium bench tp`'s options."""
    p.add_argument("--ranks", type=int, default=2, help="tensor-parallel ranks against one rank")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 32], help="decode batch sizes")
    p.add_argument("--steps", type=int, default=24, help="decode steps timed per run (their median)")
    p.add_argument("--repeats", type=int, default=2, help="runs per setup, alternating with the other setup")
    p.add_argument("--shapes", nargs="+", default=["default-size", "tiny"], choices=["default-size", "tiny"],
                   help="the models")
    options.out_dir(p)


def run_tp(args: argparse.Namespace) -> int:
    """bench/tensor_parallel.py; returns 0."""
    from tritium.client.bench.tensor_parallel import run_tensor_parallel_benchmark

    run_tensor_parallel_benchmark(ranks=args.ranks, batches=tuple(args.batches), steps=args.steps,
                                  repeats=args.repeats, shapes=tuple(args.shapes), out_dir=args.out_dir)
    return 0


def structured_options(p: argparse.ArgumentParser) -> None:
    """`tritium bench structured`'s options."""
    options.num_requests(p, 32, help="requests submitted at once")
    options.output_len(p, 256, help="max_tokens of every request")
    p.add_argument("--repeats", type=int, default=3, help="constrained / unconstrained runs, alternating")
    options.smoke(p, help="few requests and tokens, one repeat: checks the script")
    options.out_dir(p)


def run_structured(args: argparse.Namespace) -> int:
    """bench/structured.py; returns 0."""
    from tritium.client.bench.structured import run_structured_benchmark

    run_structured_benchmark(out_dir=args.out_dir, num_requests=args.num_requests, output_len=args.output_len,
                             repeats=args.repeats, smoke=args.smoke)
    return 0


def grammar_load_options(p: argparse.ArgumentParser) -> None:
    """`tritium bench grammar-load`'s options."""
    p.add_argument("--num-schemas", type=int, default=1000, help="distinct schemas compiled (memory)")
    p.add_argument("--kib", type=int, default=100, help="size of each of them")
    p.add_argument("--sample-every", type=int, default=50, help="RSS sampled every this many schemas")
    p.add_argument("--num-large", type=int, default=10, help="large schemas queued before an unconstrained request")
    p.add_argument("--large-kib", type=int, default=120, help="size of each of those")
    options.out_dir(p)


def run_grammar_load(args: argparse.Namespace) -> int:
    """bench/grammar_load.py; returns 0."""
    from tritium.client.bench.grammar_load import run_grammar_load_benchmark

    run_grammar_load_benchmark(num_schemas=args.num_schemas, kib=args.kib, num_large=args.num_large,
                               large_kib=args.large_kib, sample_every=args.sample_every, out_dir=args.out_dir)
    return 0


def kernels_options(p: argparse.ArgumentParser) -> None:
    """`tritium bench kernels`'s options."""
    options.smoke(p, help="tiny shapes on the CPU interpreter, to test the script")
    options.out_dir(p)


def run_kernels(args: argparse.Namespace) -> int:
    """bench/kernels.py; returns 0. Raises RuntimeError without CUDA (unless --smoke)."""
    from tritium.client.bench.kernels import run_kernel_benchmark

    run_kernel_benchmark(out_dir=args.out_dir, smoke=args.smoke)
    return 0


def run_moe(args: argparse.Namespace) -> int:
    """bench/moe.py (the same options as `bench kernels`); returns 0. Raises RuntimeError without CUDA (unless
    --smoke)."""
    from tritium.client.bench.moe import run_moe_benchmark

    run_moe_benchmark(out_dir=args.out_dir, smoke=args.smoke)
    return 0


def overhead_options(p: argparse.ArgumentParser) -> None:
    """`tritium bench overhead`'s options."""
    options.out_dir(p)
    p.add_argument("--quick", action="store_true", help="few requests, short outputs: checks the script itself")
    p.add_argument("--skip-tiny", action="store_true", help="leave out the tiny-model scenarios")
    p.add_argument("--skip-default", action="store_true", help="leave out the default-model scenarios")
    p.add_argument("--tiny-model", default=None, help="an existing tiny checkpoint folder (else one is written)")
    options.num_requests(p, None, help="requests in every scenario (default: per scenario: tiny 128 at c=64, "
                         "16 at c=1; default 64 at c=32, 4 at c=1)")
    options.output_len(p, None, help="output tokens per request (default 128; 16 with --quick)")


def run_overhead(args: argparse.Namespace) -> int:
    """bench/overhead.py; returns 1 when a request failed, else 0."""
    from tritium.client.bench.overhead import has_errors, run_overhead_benchmark

    report = run_overhead_benchmark(out_dir=args.out_dir, quick=args.quick, skip_tiny=args.skip_tiny,
                                    skip_default=args.skip_default, tiny_model=args.tiny_model,
                                    num_requests=args.num_requests, output_len=args.output_len)
    return 1 if has_errors(report) else 0


def serve_options(p: argparse.ArgumentParser) -> None:
    """`tritium bench serve`'s options."""
    options.url(p, help="gRPC host:port (triton) or base URL .../v1 (openai)")
    p.add_argument("--backend", choices=["triton", "openai"], default="triton")
    options.model(p, default="tritium", help="the served model's name")
    options.concurrency(p, [1, 8, 32], help="closed-loop sweep", sweep=True)
    p.add_argument("--request-rate", type=float, nargs="+", help="open-loop Poisson rates (req/s) instead")
    options.num_requests(p, 64)
    p.add_argument("--input-len", type=int, default=128)
    options.output_len(p, 64)
    options.api_key(p)
    options.out_dir(p)


def run_serve(args: argparse.Namespace) -> int:
    """bench/serve.py; returns 1 when a request failed, else 0."""
    from tritium.client.bench.serve import has_errors, run_serve_benchmark

    report = run_serve_benchmark(
        url=args.url, backend=args.backend, model=args.model, concurrency=args.concurrency,
        request_rates=args.request_rate, num_requests=args.num_requests, input_len=args.input_len,
        output_len=args.output_len, api_key=args.api_key or None, out_dir=args.out_dir,
    )
    return 1 if has_errors(report) else 0


def interference_options(p: argparse.ArgumentParser) -> None:
    """`tritium bench interference`'s options."""
    options.url(p, help="gRPC host:port of the server")
    p.add_argument("--http-url", default="http://127.0.0.1:8000", help="its HTTP address (big prompts go there)")
    p.add_argument("--streams", type=int, default=16)
    options.output_len(p, 64)
    p.add_argument("--big-prompt-kib", type=int, default=500)
    options.out_dir(p)


def run_interference(args: argparse.Namespace) -> int:
    """bench/interference.py; returns 0. Raises RuntimeError when a stream fails."""
    from tritium.client.bench.interference import run_interference_benchmark

    run_interference_benchmark(args.url, args.http_url, streams=args.streams, output_len=args.output_len,
                               big_prompt_kib=args.big_prompt_kib, out_dir=args.out_dir)
    return 0


def cluster_options(p: argparse.ArgumentParser) -> None:
    """`tritium bench cluster`'s options."""
    options.model(p, help="model folder (default: the default model)")
    options.concurrency(p, 16, help="requests in flight (closed loop)")
    options.num_requests(p, 64, help="requests per setup")
    options.output_len(p, 32, help="output tokens per request (ignore_eos)")
    p.add_argument("--prefix-tokens", type=int, default=256, help="tokens of each group's shared prefix")
    p.add_argument("--groups", type=int, default=4, help="prefix groups (requests cycle through them)")
    options.out_dir(p, flag="--out", help="folder for cluster.json and cluster.png")
    p.add_argument("--skip-vllm-router", action="store_true", help="leave out setup c (noted in the report)")


def run_cluster(args: argparse.Namespace) -> int:
    """bench/cluster.py; returns 1 when a request failed, else 0. Raises RuntimeError when the cluster does not
    start (or vllm-router is missing without --skip-vllm-router)."""
    from tritium.client.bench.cluster import has_errors, run_cluster_benchmark

    report = run_cluster_benchmark(
        out_dir=args.out, model=args.model, concurrency=args.concurrency, num_requests=args.num_requests,
        output_len=args.output_len, prefix_tokens=args.prefix_tokens, groups=args.groups,
        skip_vllm_router=args.skip_vllm_router,
    )
    return 1 if has_errors(report) else 0


def priority_options(p: argparse.ArgumentParser) -> None:
    """`tritium bench priority`'s options."""
    options.model(p, help="model folder (default: the default model)")
    options.num_requests(p, 400)
    p.add_argument("--input-len", type=int, default=256, help="prompt tokens per request")
    options.output_len(p, 128, help="output tokens per request (ignore_eos)")
    p.add_argument("--request-rate", type=float, default=32.0, help="Poisson arrivals per second (0: all at once)")
    p.add_argument("--high-fraction", type=float, default=0.1, help="share of high-priority requests")
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2,
                   help="runs of each policy, alternating in ABBA order; each policy's runs pooled")
    options.smoke(p, help="a few short requests: checks the script")
    options.out_dir(p)


def run_priority(args: argparse.Namespace) -> int:
    """bench/priority.py; returns 0. Raises RuntimeError when a request fails."""
    from tritium.client.bench.priority import run_priority_benchmark

    if args.smoke:
        run_priority_benchmark(num_requests=12, input_len=16, output_len=4, request_rate=0, max_num_seqs=4,
                               model=args.model, out_dir=args.out_dir)
        return 0
    run_priority_benchmark(num_requests=args.num_requests, input_len=args.input_len, output_len=args.output_len,
                           request_rate=args.request_rate, high_fraction=args.high_fraction,
                           max_num_seqs=args.max_num_seqs, model=args.model, out_dir=args.out_dir,
                           repeats=args.repeats)
    return 0


def no_options(p: argparse.ArgumentParser) -> None:
    """None: a forwarding scenario's module declares its own (on the parser run_aiperf builds)."""


def run_aiperf(args: argparse.Namespace) -> int:
    """client/bench/aiperf.py with the forwarded arguments; returns its exit status, or 2 when that module
    cannot be imported."""
    try:
        module = importlib.import_module(AIPERF_MODULE)
    except ImportError as exc:
        print(f"error: tritium bench aiperf needs {AIPERF_MODULE}: {exc}", file=sys.stderr)
        return 2
    description = (module.__doc__ or "").strip().splitlines()[:1]
    parser = argparse.ArgumentParser(prog="tritium bench aiperf", description=description[0] if description else None)
    module.add_arguments(parser)
    return int(module.run(parser.parse_args(getattr(args, FORWARDED))))


SCENARIOS = (
    Scenario("offline", "offline throughput: tritium vs transformers", offline_options, run_offline),
    Scenario("structured", "JSON-schema constrained decoding: throughput, compile and mask times", structured_options,
             run_structured),
    Scenario("grammar-load", "memory of many large schemas; wait of a request behind large compiles",
             grammar_load_options, run_grammar_load),
    Scenario("kernels", "Triton kernels vs torch SDPA / paged gather (CUDA)", kernels_options, run_kernels),
    Scenario("moe", "the fused MoE kernel vs the per-expert loop, batch 1-512; its tile sweep (CUDA)", kernels_options,
             run_moe),
    Scenario("overhead", "served / in-process ratios (throughput, ITL) on the tiny and default models",
             overhead_options, run_overhead),
    Scenario("serve", "TTFT / ITL / throughput against a running server (genai-perf metrics)", serve_options,
             run_serve),
    Scenario("interference", "ITL of running streams alone vs while big prompts arrive", interference_options,
             run_interference),
    Scenario("cluster", "1 replica vs 2 behind tritium's router vs 2 behind vllm-router (cache_aware), "
             "shared-prefix prompts, on this machine", cluster_options, run_cluster),
    Scenario("priority", "request priority: TTFT of 10%% high-priority requests vs the rest, and throughput vs fcfs, "
             "under an open-loop load (in-process)", priority_options, run_priority),
    Scenario("lora", "multi-LoRA: throughput with 4 adapters + base vs base, load time, memory", lora_options,
             run_lora),
    Scenario("families", "Qwen3, Phi-3, Gemma 2/3 beside Llama of the same size (load, tok/s); decode vs context "
             "with and without a sliding window", families_options, run_families),
    Scenario("tp", "tensor parallelism on this host: decode step and tok/s at N ranks vs 1 rank with the same "
             "threads, the collectives' share, memory per rank", tp_options, run_tp),
    Scenario("moe-cpu", "MoE on this CPU: decode step vs a dense model of two experts' MLP (batch 1-32), packed vs "
             "stacked experts, tiny MoE families' tok/s", moe_cpu_options, run_moe_cpu),
    Scenario("spec", "one stream with and without speculative decoding (n-gram, a draft model): ITL, acceptance",
             spec_options, run_spec),
    Scenario("embeddings", "embeddings / s in process vs transformers (batch 1 and 32), optionally through "
             "/v1/embeddings", embeddings_options, run_embeddings),
    Scenario("aiperf", "AIPerf (NVIDIA's genai-perf successor) against a tritium server "
             "(options: tritium bench aiperf --help)", no_options, run_aiperf, forwards=True),
)
