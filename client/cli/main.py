"""The `tritium` command: models, generate, chat, serve, openai, gpu-check, bench."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tritium.client.triton.launcher import ServerOptions, TritonServer

HEALTH_POLL_S = 1.0  # how often `serve` reads tritium_engine_healthy from the metrics port
# The request `serve` prints for a newcomer to copy: a question the default (instruct) model answers in a
# sentence, through its chat template (a bare question makes it end at once). tests/test_server.py sends it.
EXAMPLE_REQUEST = {"text_input": "What is the capital of France?", "apply_chat_template": True, "max_tokens": 32,
                   "temperature": 0}


def default_repository() -> Path:
    """The checkout's model_repository/ (an editable install), else ./model_repository."""
    from tritium.client.triton.launcher import PACKAGE_REPOSITORY

    return PACKAGE_REPOSITORY if PACKAGE_REPOSITORY.is_dir() else Path("model_repository")


def cmd_models(args: argparse.Namespace) -> int:
    from tritium.backend.models.registry import ensure_default_model, list_models

    if args.prepare:
        ensure_default_model(progress=True)
    for entry in list_models():
        state = "ready" if entry.ready else "not converted yet (converted on first use)"
        print(f"{entry.name}\n  path:   {entry.path}\n  status: {state}\n  source: {entry.source}")
    return 0


def _sampling(args: argparse.Namespace) -> dict:
    values = {"max_tokens": args.max_tokens, "temperature": args.temperature, "top_p": args.top_p,
              "top_k": args.top_k, "stop": args.stop or []}
    if args.seed is not None:
        values["seed"] = args.seed
    return values


def _stream_remote(args: argparse.Namespace, prompt: str) -> str:
    from tritium.client.triton.remote import stream_text

    text = ""
    for delta in stream_text(args.url, prompt, _sampling(args), api_key=args.api_key or None):
        sys.stdout.write(delta)
        sys.stdout.flush()
        text += delta
    sys.stdout.write("\n")
    return text


def _chat_prompt(args: argparse.Namespace, messages: list[dict[str, str]]) -> str:
    from tritium.backend.models.registry import resolve_model
    from tritium.backend.tokenizer import Tokenizer

    return Tokenizer(resolve_model(args.model)).apply_chat_template(messages)


def cmd_generate(args: argparse.Namespace) -> int:
    if not args.local:
        prompt = _chat_prompt(args, [{"role": "user", "content": args.prompt}]) if args.chat else args.prompt
        try:
            _stream_remote(args, prompt)
        except RuntimeError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        return 0
    from tritium.backend import EngineConfig, LLMEngine, SamplingParams

    params = SamplingParams(**_sampling(args))
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


def cmd_chat(args: argparse.Namespace) -> int:
    """A conversation with a running server: one user turn per input line (Ctrl-D ends)."""
    messages: list[dict[str, str]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            sys.stdout.write("> ")
            sys.stdout.flush()
        line = sys.stdin.readline()
        if not line:
            return 0
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line.strip()})
        try:
            reply = _stream_remote(args, _chat_prompt(args, messages))
        except RuntimeError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        messages.append({"role": "assistant", "content": reply})


def _add_client_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default="127.0.0.1:8001",
                   help="server: host:port for gRPC (default 127.0.0.1:8001) or http://host:port for HTTP")
    p.add_argument("--api-key", default=os.environ.get("TRITIUM_API_KEY"), help="default: $TRITIUM_API_KEY")
    p.add_argument("--model", default=None, help="model folder (--local) / tokenizer for the chat template")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", help="stop string (repeatable)")


def cmd_bench_offline(args: argparse.Namespace) -> int:
    from tritium.client.bench.offline import run_offline_benchmark

    run_offline_benchmark(
        num_requests=args.num_requests, output_len=args.output_len, min_prompt=args.min_prompt,
        max_prompt=args.max_prompt, skip_transformers=args.skip_transformers, out_dir=args.out_dir,
        max_num_seqs=args.max_num_seqs,
    )
    return 0


def cmd_bench_structured(args: argparse.Namespace) -> int:
    from tritium.client.bench.structured import run_structured_benchmark

    run_structured_benchmark(out_dir=args.out_dir, num_requests=args.num_requests, output_len=args.output_len,
                             repeats=args.repeats, smoke=args.smoke)
    return 0


def cmd_gpu_check(args: argparse.Namespace) -> int:
    from tritium.client.checks.gpu_check import main as gpu_check_main

    return gpu_check_main(["--out", args.out, *(["--smoke"] if args.smoke else [])])


def cmd_bench_grammar_load(args: argparse.Namespace) -> int:
    from tritium.client.bench.grammar_load import run_grammar_load_benchmark

    run_grammar_load_benchmark(num_schemas=args.num_schemas, kib=args.kib, num_large=args.num_large,
                               large_kib=args.large_kib, sample_every=args.sample_every, out_dir=args.out_dir)
    return 0


def cmd_bench_kernels(args: argparse.Namespace) -> int:
    from tritium.client.bench.kernels import run_kernel_benchmark

    run_kernel_benchmark(out_dir=args.out_dir, smoke=args.smoke)
    return 0


def _add_unsafe_flag(p: argparse.ArgumentParser) -> None:
    from tritium.client.cli.bind_policy import UNSAFE_FLAG

    p.add_argument(UNSAFE_FLAG, action="store_true",
                   help="allow binding a non-loopback --host without --api-key (only on a trusted network)")


def _serve_auth(options: ServerOptions) -> str:
    inference = "x-api-key" if options.api_key else "open"
    admin = ("x-admin-key" if options.admin_key else
             "closed (no --admin-key)" if options.api_key else "open")
    return (f"inference, metadata, model config, statistics: {inference}; model load/unload, logging, trace, "
            f"shared memory: {admin}; health: open")


def _unload_failed_engines(server: TritonServer) -> None:
    """Unload every model whose engine failed, and the ensembles running it, so that their ready endpoints
    say not ready."""
    from tritium.client.triton.launcher import dependent_ensembles

    for failed in server.failed_engines():
        ensembles = dependent_ensembles(server.options.model_repository, failed.model)
        also = f" (and the ensembles using it: {', '.join(ensembles)})" if ensembles else ""
        print(f"ERROR: model {failed.model} version {failed.version}: the engine failed; unloading it{also} so "
              f"that it reports not ready (see the server log: {server.log_path})", file=sys.stderr, flush=True)
        for name in [*ensembles, failed.model]:
            try:
                server.unload_model(name)
            except RuntimeError as exc:
                print(f"ERROR: model {name}: {exc}", file=sys.stderr, flush=True)
            else:
                print(f"model {name} is being unloaded; load it again (POST /v2/repository/models/{name}/load, "
                      "x-admin-key) or restart the server", file=sys.stderr, flush=True)


def cmd_serve(args: argparse.Namespace) -> int:
    import signal
    import threading
    import time

    from tritium.client.cli.bind_policy import open_bind_refusal
    from tritium.client.triton.launcher import ServerOptions, TritonServer

    if (refusal := open_bind_refusal(args.host, bool(args.api_key), args.unsafe_no_auth)) is not None:
        print(f"error: {refusal}", file=sys.stderr)
        return 2
    options = ServerOptions(
        model_repository=Path(args.model_repository).resolve(), host=args.host, http_port=args.http_port,
        grpc_port=args.grpc_port, metrics_port=args.metrics_port, api_key=args.api_key or None,
        admin_key=args.admin_key or None, model_control=args.model_control, load_models=args.load_model or [],
        log_verbose=args.log_verbose,
    )
    server = TritonServer(options)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print(f"starting tritonserver on {options.model_repository} ...", flush=True)
    try:
        server.start()
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    key_header = ' -H "x-api-key: $TRITIUM_API_KEY"' if options.api_key else ""
    print(
        f"tritium is serving\n  HTTP:    {server.http_url}\n  gRPC:    {server.grpc_url}\n"
        f"  metrics: {server.metrics_url}\n  auth:    {_serve_auth(options)}\n\n"
        f"try:\n  curl -s{key_header} {server.http_url}/v2/models/tritium/generate \\\n"
        f"    -d '{json.dumps(EXAMPLE_REQUEST)}'\n"
        "Ctrl-C stops the server.",
        flush=True,
    )
    next_health_check = 0.0
    while not stop.is_set():
        if server.process is not None and server.process.poll() is not None:
            print(f"tritonserver exited with {server.process.returncode}:\n{server.log_tail()}", file=sys.stderr)
            server.stop()
            return 1
        if time.monotonic() >= next_health_check:
            next_health_check = time.monotonic() + HEALTH_POLL_S
            _unload_failed_engines(server)
        stop.wait(0.25)
    print("stopping ...", flush=True)
    server.stop()
    return 0


def cmd_bench_interference(args: argparse.Namespace) -> int:
    from tritium.client.bench.interference import run_interference_benchmark

    run_interference_benchmark(args.url, args.http_url, streams=args.streams, output_len=args.output_len,
                               big_prompt_kib=args.big_prompt_kib, out_dir=args.out_dir)
    return 0


def cmd_bench_overhead(args: argparse.Namespace) -> int:
    from tritium.client.bench.overhead import has_errors, run_overhead_benchmark

    report = run_overhead_benchmark(out_dir=args.out_dir, quick=args.quick, skip_tiny=args.skip_tiny,
                                    skip_default=args.skip_default, tiny_model=args.tiny_model,
                                    num_requests=args.num_requests, output_len=args.output_len)
    return 1 if has_errors(report) else 0


def cmd_openai(args: argparse.Namespace) -> int:
    from tritium.client.cli.bind_policy import open_bind_refusal
    from tritium.client.openai.app import serve_openai

    if (refusal := open_bind_refusal(args.host, bool(args.api_key), args.unsafe_no_auth)) is not None:
        print(f"error: {refusal}", file=sys.stderr)
        return 2
    serve_openai(args.upstream, args.host, args.port, args.api_key or None, args.model, args.tokenizer,
                 max_concurrency=args.max_concurrency, metrics_urls=args.upstream_metrics,
                 expose_model_path=args.expose_model_path)
    return 0


def cmd_bench_serve(args: argparse.Namespace) -> int:
    from tritium.client.bench.serve import run_serve_benchmark

    report = run_serve_benchmark(
        url=args.url, backend=args.backend, model=args.model, concurrency=args.concurrency,
        request_rates=args.request_rate, num_requests=args.num_requests, input_len=args.input_len,
        output_len=args.output_len, api_key=args.api_key or None, out_dir=args.out_dir,
    )
    return 1 if any(r["errors"] for r in report["results"]) else 0


def cmd_bench_cluster(args: argparse.Namespace) -> int:
    from tritium.client.bench.cluster import has_errors, run_cluster_benchmark

    report = run_cluster_benchmark(
        out_dir=args.out, model=args.model, concurrency=args.concurrency, num_requests=args.num_requests,
        output_len=args.output_len, prefix_tokens=args.prefix_tokens, groups=args.groups,
        skip_vllm_router=args.skip_vllm_router,
    )
    return 1 if has_errors(report) else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tritium", description="tritium LLM inference engine")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("models", help="list available models and where their folders are")
    p.add_argument("--prepare", action="store_true", help="convert the embedded default model if needed")
    p.set_defaults(func=cmd_models)

    p = sub.add_parser("generate", help="stream a completion from a running server (or in-process: --local)")
    p.add_argument("prompt")
    _add_client_args(p)
    p.add_argument("--local", action="store_true", help="run the engine in this process instead")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton"])
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("chat", help="chat with a running server, one user turn per line")
    _add_client_args(p)
    p.add_argument("--system", default=None, help="system message")
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("serve", help="serve the model repository with a real tritonserver")
    p.add_argument("--model-repository", default=str(default_repository()))
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--grpc-port", type=int, default=8001)
    p.add_argument("--metrics-port", type=int, default=8002)
    p.add_argument("--api-key", default=os.environ.get("TRITIUM_API_KEY"),
                   help="require this x-api-key for inference, metadata, model config and statistics "
                   "(default: $TRITIUM_API_KEY)")
    p.add_argument("--admin-key", default=os.environ.get("TRITIUM_ADMIN_KEY"),
                   help="require this x-admin-key for model load/unload, logging, trace and shared memory "
                   "(default: $TRITIUM_ADMIN_KEY; with --api-key but no admin key those stay closed)")
    p.add_argument("--model-control", choices=["none", "explicit"], default="none",
                   help="none: load every model at start-up; explicit: only --load-model ones (either way "
                   "a model whose engine fails is unloaded)")
    p.add_argument("--load-model", action="append", help="with --model-control explicit: load this model")
    p.add_argument("--log-verbose", type=int, default=0)
    _add_unsafe_flag(p)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("openai", help="OpenAI-compatible endpoint in front of tritonserver replicas")
    p.add_argument("--upstream", action="append", required=True, help="host:grpc_port of a tritonserver (repeat)")
    p.add_argument("--upstream-metrics", action="append", default=None,
                   help="metrics URL of each --upstream, in the same order (engine load and health, the vllm:* "
                   "gauges; default: http://HOST:8002/metrics for an upstream on port 8001)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=9000)
    p.add_argument("--api-key", default=os.environ.get("TRITIUM_API_KEY"),
                   help="require Authorization: Bearer KEY; also sent to Triton (default: $TRITIUM_API_KEY)")
    p.add_argument("--model", default="tritium", help="Triton model name, also the OpenAI model id")
    p.add_argument("--tokenizer", default=None, help="model folder whose tokenizer/chat template to use")
    p.add_argument("--max-concurrency", type=int, default=256,
                   help="upstream requests in flight (a choice each) beyond which requests get 503 + Retry-After")
    p.add_argument("--expose-model-path", action="store_true",
                   help="name the local model folder in /model_info and /server_info (sglang-router loads the "
                   "tokenizer from there); by default those open routes carry no filesystem path")
    _add_unsafe_flag(p)
    p.set_defaults(func=cmd_openai)

    p = sub.add_parser("gpu-check", help="on a CUDA GPU: kernels, parity, syncs, benchmarks and goals in ~5 minutes")
    p.add_argument("--smoke", action="store_true",
                   help="tiny shapes on the CPU (Triton interpreter): checks the script, not the GPU")
    p.add_argument("--out", default="bench_results/gpu_check", help="results folder (JSON + PNG)")
    p.set_defaults(func=cmd_gpu_check)

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
    p = bench.add_parser("structured", help="JSON-schema constrained decoding: throughput, compile and mask times")
    p.add_argument("--num-requests", type=int, default=32, help="requests submitted at once")
    p.add_argument("--output-len", type=int, default=256, help="max_tokens of every request")
    p.add_argument("--repeats", type=int, default=3, help="constrained / unconstrained runs, alternating")
    p.add_argument("--smoke", action="store_true", help="few requests and tokens, one repeat: checks the script")
    p.add_argument("--out-dir", default="bench_results")
    p.set_defaults(func=cmd_bench_structured)
    p = bench.add_parser("grammar-load", help="memory of many large schemas; wait of a request behind large compiles")
    p.add_argument("--num-schemas", type=int, default=1000, help="distinct schemas compiled (memory)")
    p.add_argument("--kib", type=int, default=100, help="size of each of them")
    p.add_argument("--sample-every", type=int, default=50, help="RSS sampled every this many schemas")
    p.add_argument("--num-large", type=int, default=10, help="large schemas queued before an unconstrained request")
    p.add_argument("--large-kib", type=int, default=120, help="size of each of those")
    p.add_argument("--out-dir", default="bench_results")
    p.set_defaults(func=cmd_bench_grammar_load)
    p = bench.add_parser("kernels", help="Triton kernels vs torch SDPA / paged gather (CUDA)")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU interpreter, to test the script")
    p.add_argument("--out-dir", default="bench_results")
    p.set_defaults(func=cmd_bench_kernels)
    p = bench.add_parser("overhead", help="served / in-process ratios (throughput, ITL) on the tiny and default models")
    p.add_argument("--out-dir", default="bench_results")
    p.add_argument("--quick", action="store_true", help="few requests, short outputs: checks the script itself")
    p.add_argument("--skip-tiny", action="store_true", help="leave out the tiny-model scenarios")
    p.add_argument("--skip-default", action="store_true", help="leave out the default-model scenarios")
    p.add_argument("--tiny-model", default=None, help="an existing tiny checkpoint folder (else one is written)")
    p.add_argument("--num-requests", type=int, default=None, help="requests in every scenario (default: per scenario)")
    p.add_argument("--output-len", type=int, default=None, help="output tokens per request (default 128)")
    p.set_defaults(func=cmd_bench_overhead)
    p = bench.add_parser("serve", help="TTFT / ITL / throughput against a running server (genai-perf metrics)")
    p.add_argument("--url", default="127.0.0.1:8001", help="gRPC host:port (triton) or base URL .../v1 (openai)")
    p.add_argument("--backend", choices=["triton", "openai"], default="triton")
    p.add_argument("--model", default="tritium")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32], help="closed-loop sweep")
    p.add_argument("--request-rate", type=float, nargs="+", help="open-loop Poisson rates (req/s) instead")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--api-key", default=os.environ.get("TRITIUM_API_KEY"))
    p.add_argument("--out-dir", default="bench_results")
    p.set_defaults(func=cmd_bench_serve)
    p = bench.add_parser("interference", help="ITL of running streams alone vs while big prompts arrive")
    p.add_argument("--url", default="127.0.0.1:8001", help="gRPC host:port of the server")
    p.add_argument("--http-url", default="http://127.0.0.1:8000", help="its HTTP address (big prompts go there)")
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--big-prompt-kib", type=int, default=500)
    p.add_argument("--out-dir", default="bench_results")
    p.set_defaults(func=cmd_bench_interference)
    p = bench.add_parser("cluster", help="1 replica vs 2 behind tritium's router vs 2 behind vllm-router "
                         "(cache_aware), shared-prefix prompts, on this machine")
    p.add_argument("--model", default=None, help="model folder (default: the default model)")
    p.add_argument("--concurrency", type=int, default=16, help="requests in flight (closed loop)")
    p.add_argument("--num-requests", type=int, default=64, help="requests per setup")
    p.add_argument("--output-len", type=int, default=32, help="output tokens per request (ignore_eos)")
    p.add_argument("--prefix-tokens", type=int, default=256, help="tokens of each group's shared prefix")
    p.add_argument("--groups", type=int, default=4, help="prefix groups (requests cycle through them)")
    p.add_argument("--out", default="bench_results", help="folder for cluster.json and cluster.png")
    p.add_argument("--skip-vllm-router", action="store_true", help="leave out setup c (noted in the report)")
    p.set_defaults(func=cmd_bench_cluster)
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
