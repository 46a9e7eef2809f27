"""`tritium gpu-check` (also `python -m tritium.client.checks.gpu_check`): the ~5-minute check on a CUDA GPU,
or `--smoke` on a CPU."""

from __future__ import annotations

import argparse
from typing import Any

from tritium.client.cli import options


def add_parser(subparsers: Any) -> None:
    """Register `gpu-check` and its options on the top-level subparsers."""
    from tritium.client.checks.gpu_check import DEFAULT_OUT, STEP_NUMBERS

    p = subparsers.add_parser("gpu-check",
                              help="on a CUDA GPU: kernels, parity, syncs, benchmarks and goals in ~5 minutes")
    options.smoke(p, help="tiny shapes on the CPU (Triton interpreter): checks the script, not the GPU")
    options.out_dir(p, flag="--out", default=DEFAULT_OUT, help=f"results folder (JSON + PNG; default {DEFAULT_OUT})")
    p.add_argument("--steps", default=None, metavar="N,N",
                   help=f"run only these steps ({','.join(STEP_NUMBERS)}); the others are reported 'not run'")
    p.add_argument("--model", default="auto",
                   help="auto (the default model when installed, else random), default, random (random weights "
                        "with the default model's shapes and tokenizer) or a model folder")
    p.add_argument("--model-files", default=None, metavar="DIR",
                   help="config.json and tokenizer files the random checkpoints copy (default: the default model)")
    p.add_argument("--budget-s", type=float, default=None, metavar="S",
                   help="steps not started within S seconds are reported 'not run'")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run the check; returns 0 when every step passed (or skipped, or was not run), else 1. With --smoke, sets
    TRITON_INTERPRET=1 first (starting this process again when triton is imported already). Raises
    RuntimeError without CUDA unless --smoke, ValueError for an unknown step."""
    from tritium.client.checks.gpu_check import Options, ensure_interpreter, parse_steps, run_gpu_check

    parse_steps(args.steps)  # an unknown step fails before anything starts
    opts = Options(args.out, args.smoke, args.steps, args.model, args.model_files, args.budget_s)
    if args.smoke:
        ensure_interpreter(cli_argv(opts))
    return 0 if run_gpu_check(options=opts)["passed"] else 1


def cli_argv(opts: Any) -> list[str]:
    """The command-line options that ask for `opts` (a gpu_check.Options) again."""
    argv = ["--out", opts.out_dir, "--model", opts.model]
    if opts.smoke:
        argv.append("--smoke")
    if opts.steps is not None:
        argv += ["--steps", opts.steps]
    if opts.model_files is not None:
        argv += ["--model-files", opts.model_files]
    if opts.budget_s is not None:
        argv += ["--budget-s", str(opts.budget_s)]
    return argv
