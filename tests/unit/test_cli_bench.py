"""`tritium bench`: the subcommands come from the SCENARIOS table, each with the options and defaults it had when
every scenario was registered by hand."""

from __future__ import annotations

import argparse

import pytest

from tritium.client.cli import bench, options
from tritium.client.cli.main import build_parser

OUT = options.DEFAULT_OUT_DIR
# The parsed defaults of `tritium bench NAME` (no options given) as the hand-written registrations had them.
DEFAULTS = {
    "offline": {"num_requests": 32, "output_len": 128, "min_prompt": 32, "max_prompt": 256, "max_num_seqs": 64,
                "skip_transformers": False, "dtype": "auto", "quantization": None, "out_dir": OUT},
    "structured": {"num_requests": 32, "output_len": 256, "repeats": 3, "smoke": False, "out_dir": OUT},
    "grammar-load": {"num_schemas": 1000, "kib": 100, "sample_every": 50, "num_large": 10, "large_kib": 120,
                     "out_dir": OUT},
    "kernels": {"smoke": False, "out_dir": OUT},
    "moe": {"smoke": False, "out_dir": OUT},
    "overhead": {"out_dir": OUT, "quick": False, "skip_tiny": False, "skip_default": False, "tiny_model": None,
                 "num_requests": None, "output_len": None},
    "serve": {"url": "127.0.0.1:8001", "backend": "triton", "model": "tritium", "concurrency": [1, 8, 32],
              "request_rate": None, "num_requests": 64, "input_len": 128, "output_len": 64, "api_key": None,
              "out_dir": OUT},
    "interference": {"url": "127.0.0.1:8001", "http_url": "http://127.0.0.1:8000", "streams": 16, "output_len": 64,
                     "big_prompt_kib": 500, "out_dir": OUT},
    "cluster": {"model": None, "concurrency": 16, "num_requests": 64, "output_len": 32, "prefix_tokens": 256,
                "groups": 4, "out": OUT, "skip_vllm_router": False},
    "priority": {"model": None, "num_requests": 400, "input_len": 256, "output_len": 128, "request_rate": 32.0,
                 "high_fraction": 0.1, "max_num_seqs": 32, "repeats": 2, "smoke": False, "out_dir": OUT},
    "lora": {"num_requests": 32, "output_len": 128, "input_len": 64, "repeats": 4, "out_dir": OUT},
    "families": {"num_requests": 16, "output_len": 64, "window": 512, "contexts": [512, 1024, 2048, 4096],
                 "out_dir": OUT},
    "tp": {"ranks": 2, "batches": [1, 32], "steps": 24, "repeats": 2, "shapes": ["default-size", "tiny"],
           "out_dir": OUT},
    "moe-cpu": {"batches": [1, 8, 32], "steps": 16, "num_requests": 16, "output_len": 64, "out_dir": OUT},
    "spec": {"num_requests": 4, "output_len": 128, "repeats": 2, "num_speculative_tokens": 4, "draft_model": None,
             "draft_layers": None, "smoke": False, "out_dir": OUT},
    "embeddings": {"model": None, "num_texts": 256, "batch": 32, "repeats": 3, "endpoint": False, "out_dir": OUT},
    "aiperf": {bench.FORWARDED: []},
}


@pytest.fixture
def parser(monkeypatch: pytest.MonkeyPatch) -> argparse.ArgumentParser:
    monkeypatch.delenv(options.API_KEY_ENV, raising=False)  # `bench serve --api-key` defaults to it
    return build_parser()


def bench_subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """`tritium bench`'s subcommands by name, in registration order."""
    top = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    sub = next(a for a in top.choices["bench"]._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def test_the_subcommands_are_the_tables_in_its_order(parser: argparse.ArgumentParser) -> None:
    assert list(bench_subparsers(parser)) == [s.name for s in bench.SCENARIOS] == list(DEFAULTS)


@pytest.mark.parametrize("scenario", bench.SCENARIOS, ids=lambda s: s.name)
def test_each_scenario_parses_to_its_defaults_and_runs_its_function(parser: argparse.ArgumentParser,
                                                                   scenario: bench.Scenario) -> None:
    args, unknown = parser.parse_known_args(["bench", scenario.name])
    values = vars(args)
    assert (values.pop("command"), values.pop("bench"), values.pop("func"), unknown) == \
        ("bench", scenario.name, scenario.run, [])
    assert values == DEFAULTS[scenario.name]


def test_only_the_forwarding_scenario_leaves_help_and_unknown_options_to_its_module(
        parser: argparse.ArgumentParser) -> None:
    subparsers = bench_subparsers(parser)
    assert [s.name for s in bench.SCENARIOS if s.forwards] == ["aiperf"]
    assert [name for name, p in subparsers.items() if not p.add_help] == ["aiperf"]
    args, unknown = parser.parse_known_args(["bench", "aiperf", "--help", "--door", "openai"])
    assert args.func is bench.run_aiperf and unknown == ["--help", "--door", "openai"]
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "offline", "--door", "openai"])
