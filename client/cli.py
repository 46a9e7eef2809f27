"""The `tritium` command: models, generate, bench."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def cmd_models(args: argparse.Namespace) -> int:
    from tritium.backend.models.registry import ensure_default_model, list_models

    if args.prepare:
        ensure_default_model(progress=True)
    for entry in list_models():
        state = "ready" if entry.ready else "not converted yet (converted on first use)"
        print(f"{entry.name}\n  path:   {entry.path}\n  status: {state}\n  source: {entry.source}")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from tritium.backend import EngineConfig, LLMEngine, SamplingParams

    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, seed=args.seed, stop=args.stop or [],
    )
    engine = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, attention_backend=args.attention_backend))
    if args.chat:
        text = engine.tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}])
        engine.add_request("cli", None, params, prompt_token_ids=engine.tokenizer.encode(text, False))
    else:
        engine.add_request("cli", args.prompt, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            sys.stdout.write(out.delta_text)
            sys.stdout.flush()
            if out.finished:
                sys.stdout.write("\n")
                if out.error:
                    print(f"error: {out.error}", file=sys.stderr)
                    return 1
    return 0


def cmd_bench_offline(args: argparse.Namespace) -> int:
    from tritium.client.bench_offline import run_offline_benchmark

    run_offline_benchmark(
        num_requests=args.num_requests, output_len=args.output_len, min_prompt=args.min_prompt,
        max_prompt=args.max_prompt, skip_transformers=args.skip_transformers, out_dir=args.out_dir,
        max_num_seqs=args.max_num_seqs,
    )
    return 0


def cmd_bench_kernels(args: argparse.Namespace) -> int:
    from tritium.client.bench_kernels import run_kernel_benchmark

    run_kernel_benchmark(out_dir=args.out_dir, smoke=args.smoke)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tritium", description="tritium LLM inference engine")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("models", help="list available models and where their folders are")
    p.add_argument("--prepare", action="store_true", help="convert the embedded default model if needed")
    p.set_defaults(func=cmd_models)

    p = sub.add_parser("generate", help="generate text in-process, streaming to the terminal")
    p.add_argument("prompt")
    p.add_argument("--model", default=None, help="model folder (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton"])
    p.set_defaults(func=cmd_generate)

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    p = bench.add_parser("offline", help="offline throughput: tritium vs transformers")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--min-prompt", type=int, default=32)
    p.add_argument("--max-prompt", type=int, default=256)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--skip-transformers", action="store_true")
    p.add_argument("--out-dir", default="bench_results")
    p.set_defaults(func=cmd_bench_offline)
    p = bench.add_parser("kernels", help="Triton kernels vs torch SDPA / paged gather (CUDA)")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU interpreter, to test the script")
    p.add_argument("--out-dir", default="bench_results")
    p.set_defaults(func=cmd_bench_kernels)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except (ValueError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
