"""The `tritium` command: builds the parser from the command modules and runs the chosen command.

Each command lives in its own module, which declares its options (`add_parser(subparsers)`, using
cli/options.py for the options several commands share) and runs it; this one only puts them together.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from tritium.client.cli import bench, generate, gpu_check, models, openai, serve
from tritium.client.cli.bench import FORWARDED

COMMANDS = (models, generate, serve, openai, gpu_check, bench)  # in `tritium --help` order


def build_parser() -> argparse.ArgumentParser:
    """The `tritium` parser, every command registered; a parsed Namespace's `func(args)` runs the command."""
    parser = argparse.ArgumentParser(prog="tritium", description="tritium LLM inference engine")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse `argv` (default: sys.argv[1:]) and run the command; returns its exit status, or 2 when it raised
    ValueError or RuntimeError (printed as `error: ...`). Arguments the parser does not know are an error,
    except for a subcommand that forwards them (`tritium bench aiperf`)."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if hasattr(args, FORWARDED):
        setattr(args, FORWARDED, unknown)
    elif unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        return int(args.func(args))
    except (ValueError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
