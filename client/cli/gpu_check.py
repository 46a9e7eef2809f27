"""`tritium gpu-check` (also `python -m tritium.client.checks.gpu_check`): the ~5-minute check on a CUDA GPU,
or `--smoke` on a CPU."""

from __future__ import annotations

import argparse
from typing import Any

from tritium.client.cli import options


def add_parser(subparsers: Any) -> None:
    """Register `gpu-check` and its options on the top-level subparsers."""
    from tritium.client.checks.gpu_check import DEFAULT_OUT

    p = subparsers.add_parser("gpu-check",
                              help="on a CUDA GPU: kernels, parity, syncs, benchmarks and goals in ~5 minutes")
    options.smoke(p, help="tiny shapes on the CPU (Triton interpreter): checks the script, not the GPU")
    options.out_dir(p, flag="--out", default=DEFAULT_OUT, help=f"results folder (JSON + PNG; default {DEFAULT_OUT})")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run the check; returns 0 when every step passed (or skipped), else 1. With --smoke, sets
    TRITON_INTERPRET=1 first (starting this process again when triton is imported already). Raises
    RuntimeError without CUDA unless --smoke."""
    from tritium.client.checks.gpu_check import ensure_interpreter, run_gpu_check

    if args.smoke:
        ensure_interpreter(["--smoke", "--out", args.out])
    return 0 if run_gpu_check(args.out, args.smoke)["passed"] else 1
