"""Options that more than one `tritium` command takes, each declared here once (a command passes its own
default or help where they differ). Options only one command takes are declared in that command's module.
"""

from __future__ import annotations

import argparse
import os

API_KEY_ENV = "TRITIUM_API_KEY"
ADMIN_KEY_ENV = "TRITIUM_ADMIN_KEY"  # tritonserver's admin APIs, the model's LoRA admin actions, the endpoint's
DEFAULT_GRPC_URL = "127.0.0.1:8001"
DEFAULT_OUT_DIR = "bench_results"
# The engine's weight-only schemes (backend/config.py QUANTIZATIONS; not imported: it loads torch, and
# `tritium --help` stays fast; tests/unit/test_cli_options.py keeps the two equal).
QUANTIZATIONS = ("int8", "int4")
MAX_TENSOR_PARALLEL_SIZE = 64  # backend/config.py's, not imported for the same reason


def url(p: argparse.ArgumentParser, help: str, default: str = DEFAULT_GRPC_URL) -> None:
    """`--url`: the server to talk to."""
    p.add_argument("--url", default=default, help=help)


def api_key(p: argparse.ArgumentParser, help: str = f"default: ${API_KEY_ENV}") -> None:
    """`--api-key`, defaulting to $TRITIUM_API_KEY."""
    p.add_argument("--api-key", default=os.environ.get(API_KEY_ENV), help=help)


def model(p: argparse.ArgumentParser, help: str, default: str | None = None) -> None:
    """`--model`: a model folder or a served model's name (the command's help says which)."""
    p.add_argument("--model", default=default, help=help)


def served_model_name(p: argparse.ArgumentParser, help: str) -> None:
    """`--served-model-name`: the name clients know the served model by (the OpenAI model id)."""
    p.add_argument("--served-model-name", default=None, metavar="NAME", help=help)


def host(p: argparse.ArgumentParser) -> None:
    """`--host`: the address a server binds (loopback unless told otherwise)."""
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")


def unsafe_no_auth(p: argparse.ArgumentParser) -> None:
    """`--unsafe-no-auth`: allow binding a non-loopback --host without keys (bind_policy)."""
    from tritium.client.cli.bind_policy import UNSAFE_FLAG

    p.add_argument(UNSAFE_FLAG, action="store_true",
                   help="allow binding a non-loopback --host without --api-key (only on a trusted network)")


def smoke(p: argparse.ArgumentParser, help: str) -> None:
    """`--smoke`: a tiny run that checks the script itself (its figures mean nothing)."""
    p.add_argument("--smoke", action="store_true", help=help)


def out_dir(p: argparse.ArgumentParser, flag: str = "--out-dir", default: str = DEFAULT_OUT_DIR,
            help: str = "results folder (JSON + PNG)") -> None:
    """The results folder: `--out-dir` (benchmarks) or `--out` (gpu-check, bench cluster)."""
    p.add_argument(flag, default=default, help=help)


def quantization(p: argparse.ArgumentParser, help: str) -> None:
    """`--quantization`: the engine's weight-only scheme (None: the weights stay in their dtype)."""
    p.add_argument("--quantization", default=None, choices=QUANTIZATIONS, help=help)


def tensor_parallel_size(p: argparse.ArgumentParser, help: str) -> None:
    """`--tensor-parallel-size N`: the ranks (processes, GPUs on CUDA) one model is sharded over; None: not given."""
    p.add_argument("--tensor-parallel-size", type=_tensor_parallel_size, default=None, metavar="N", help=help)


def _tensor_parallel_size(text: str) -> int:
    try:
        size = int(text)
    except ValueError:
        size = 0
    if not 1 <= size <= MAX_TENSOR_PARALLEL_SIZE:
        raise argparse.ArgumentTypeError(f"expected an integer from 1 to {MAX_TENSOR_PARALLEL_SIZE} (the ranks one "
                                         f"model is sharded over), got {text!r}")
    return size


def num_requests(p: argparse.ArgumentParser, default: int | None, help: str | None = None) -> None:
    """`--num-requests`: requests per run (or per load point / scenario / setup)."""
    p.add_argument("--num-requests", type=int, default=default, help=help)


def output_len(p: argparse.ArgumentParser, default: int | None, help: str | None = None) -> None:
    """`--output-len`: output tokens per request."""
    p.add_argument("--output-len", type=int, default=default, help=help)


def concurrency(p: argparse.ArgumentParser, default: int | list[int], help: str, sweep: bool = False) -> None:
    """`--concurrency`: requests in flight in a closed loop (`sweep`: one or more values)."""
    p.add_argument("--concurrency", type=int, nargs="+" if sweep else None, default=default, help=help)


def sampling(p: argparse.ArgumentParser) -> None:
    """The sampling options of a generation request: --max-tokens, --temperature, --top-p, --top-k, --seed,
    --stop (cli.generate.sampling_values reads them)."""
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    seed(p)
    p.add_argument("--stop", action="append", help="stop string (repeatable)")


def seed(p: argparse.ArgumentParser, default: int | None = None, help: str | None = None) -> None:
    """`--seed`: the random seed (of the sampler, or of a benchmark's synthetic prompts)."""
    p.add_argument("--seed", type=int, default=default, help=help)


def tokenizer(p: argparse.ArgumentParser, help: str) -> None:
    """`--tokenizer`: a model folder whose tokenizer (and chat template) to use."""
    p.add_argument("--tokenizer", default=None, help=help)
