"""`tritium models`: the models tritium knows, where their folders are and whether they are converted."""

from __future__ import annotations

import argparse
from typing import Any


def add_parser(subparsers: Any) -> None:
    """Register `models` and its options on the top-level subparsers."""
    p = subparsers.add_parser("models", help="list available models and where their folders are")
    p.add_argument("--prepare", action="store_true", help="convert the embedded default model if needed")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Print every model (converting the default one first with --prepare); returns 0."""
    from tritium.backend.models.registry import ensure_default_model, list_models

    if args.prepare:
        ensure_default_model(progress=True)
    for entry in list_models():
        state = "ready" if entry.ready else "not converted yet (converted on first use)"
        print(f"{entry.name}\n  path:   {entry.path}\n  status: {state}\n  source: {entry.source}")
    return 0
