"""The CLI's shared options that mirror engine settings stay equal to what the engine accepts."""

from __future__ import annotations

import argparse

import pytest

from tritium.backend.config import QUANTIZATIONS
from tritium.client.cli import options


def test_quantization_choices_are_the_engines() -> None:
    assert options.QUANTIZATIONS == QUANTIZATIONS


def test_quantization_option_refuses_unknown_schemes() -> None:
    p = argparse.ArgumentParser()
    options.quantization(p, help="x")
    assert p.parse_args([]).quantization is None
    assert p.parse_args(["--quantization", "int4"]).quantization == "int4"
    with pytest.raises(SystemExit):
        p.parse_args(["--quantization", "fp8"])
