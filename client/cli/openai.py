"""`tritium openai`: an OpenAI-compatible endpoint in front of one or more tritonserver replicas (with more than
one, tritium's router picks the replica)."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from tritium.client.cli import options
from tritium.client.openai.reasoning import REASONING_PARSERS


def add_parser(subparsers: Any) -> None:
    """Register `openai` and its options on the top-level subparsers."""
    p = subparsers.add_parser("openai", help="OpenAI-compatible endpoint in front of tritonserver replicas")
    p.add_argument("--upstream", action="append", required=True, help="host:grpc_port of a tritonserver (repeat)")
    p.add_argument("--upstream-metrics", action="append", default=None,
                   help="metrics URL of each --upstream, in the same order (engine load and health, the vllm:* "
                   "gauges; default: http://HOST:8002/metrics for an upstream on port 8001)")
    options.host(p)
    p.add_argument("--port", type=int, default=9000)
    options.api_key(p, help="require Authorization: Bearer KEY; also sent to Triton "
                    f"(default: ${options.API_KEY_ENV})")
    p.add_argument("--admin-key", default=os.environ.get(options.ADMIN_KEY_ENV),
                   help="turn on POST /v1/load_lora_adapter and /v1/unload_lora_adapter, which then take "
                   "Authorization: Bearer ADMIN_KEY (not the --api-key); sent on to every upstream, whose model must "
                   f"have the same key (tritium serve --admin-key) (default: ${options.ADMIN_KEY_ENV}; none: those "
                   "routes answer 404)")
    options.model(p, default="tritium", help="the Triton model to call (its name is always accepted as the "
                  "OpenAI model id too)")
    options.served_model_name(p, help="the OpenAI model id that /v1/models lists (default: the name the upstream's "
                              "model reports, which `tritium serve --model` sets, else --model)")
    options.tokenizer(p, "model folder (or a name in $TRITIUM_CACHE/models) whose tokenizer and chat template to use "
                      "(default: the folder the upstream reports serving when it is on this host, else the default "
                      "model)")
    p.add_argument("--max-concurrency", type=int, default=256,
                   help="upstream requests in flight (a choice each) beyond which requests get 503 + Retry-After")
    p.add_argument("--expose-model-path", action="store_true",
                   help="name the local model folder in /model_info and /server_info (sglang-router loads the "
                   "tokenizer from there); by default those open routes carry no filesystem path")
    p.add_argument("--reasoning-parser", choices=sorted(REASONING_PARSERS), default=None,
                   help="split a thinking model's chat replies into message.reasoning_content (the <think> block) "
                   "and content, under vLLM's names: deepseek_r1 (text before </think> is reasoning, <think> or "
                   "not), qwen3 (reasoning only inside <think>...</think>) (default: none, the text is all content)")
    options.unsafe_no_auth(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Serve until stopped; returns 0 then, 2 when the bind policy refuses the address."""
    from tritium.client.cli.bind_policy import open_bind_refusal
    from tritium.client.openai.app import serve_openai

    if (refusal := open_bind_refusal(args.host, bool(args.api_key), args.unsafe_no_auth)) is not None:
        print(f"error: {refusal}", file=sys.stderr)
        return 2
    serve_openai(args.upstream, args.host, args.port, args.api_key or None, args.model, args.tokenizer,
                 max_concurrency=args.max_concurrency, metrics_urls=args.upstream_metrics,
                 expose_model_path=args.expose_model_path, admin_key=args.admin_key or None,
                 served_model_name=args.served_model_name or None, reasoning_parser=args.reasoning_parser)
    return 0
