"""gpu-check's run loop without the steps' work: `--steps`, the JSON rewritten after every step (a run cut
short leaves what it did), the time budget, and the options a re-started smoke run gets back."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from tritium.client.checks import gpu_check
from tritium.client.checks import kernels as kernel_checks
from tritium.client.checks.gpu_check import STEP_NUMBERS, Options, parse_steps, run_gpu_check
from tritium.client.checks.report import FAIL, PASS, Outcome
from tritium.client.cli import gpu_check as cli


def read(out: Path) -> dict[str, object]:
    data: dict[str, object] = json.loads((out / "gpu_check.json").read_text())
    return data


def statuses(data: dict[str, object]) -> dict[str, str]:
    steps = data["steps"]
    assert isinstance(steps, list)
    return {s["number"]: s["status"] for s in steps}


def test_parse_steps() -> None:
    assert parse_steps(None) == list(STEP_NUMBERS) == parse_steps("all")
    assert parse_steps("5, 3b,1") == ["1", "3b", "5"]  # run order, not the order asked
    with pytest.raises(ValueError, match="unknown step 6"):
        parse_steps("1,6")


def test_only_the_selected_steps_run_and_the_json_is_written_after_each(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "out"
    seen_by_step_4: list[dict[str, str]] = []

    def kernels(smoke: bool) -> Outcome:
        return Outcome(PASS, "fake kernels", {"cases": 1})

    def bench(smoke: bool) -> Outcome:  # a step that dies: what was written before it must stay
        seen_by_step_4.append(statuses(read(out)))
        raise RuntimeError("the device fell over")

    monkeypatch.setattr(kernel_checks, "check_kernels", kernels)
    monkeypatch.setattr(gpu_check, "check_kernel_bench", bench)
    data = run_gpu_check(options=Options(str(out), smoke=True, steps="4,1"))

    assert seen_by_step_4 == [{"1": PASS, "2": "not run", "3": "not run", "3b": "not run", "2b": "not run",
                               "3c": "not run", "2c": "not run", "2d": "not run", "4": "not run", "5": "not run",
                               "3d": "not run"}]
    on_disk = read(out)
    assert statuses(on_disk) == statuses(data) == {**seen_by_step_4[0], "4": FAIL}
    steps = {s["number"]: s for s in on_disk["steps"]}  # type: ignore[union-attr]
    assert steps["4"]["summary"] == "RuntimeError: the device fell over"
    assert steps["2"]["summary"] == "not selected (--steps)"
    assert on_disk["passed"] is False and on_disk["complete"] is True
    assert [g["verdict"] for g in on_disk["goals"]] == ["not measured"] * 6  # type: ignore[union-attr]
    assert any(line.startswith("2 greedy parity") and "not run" in line for line in on_disk["summary"])  # type: ignore[union-attr]
    assert (out / "gpu_check.png").is_file()


def test_steps_past_the_budget_are_reported_not_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernel_checks, "check_kernels", lambda smoke: Outcome(PASS, "fake"))
    monkeypatch.setattr(gpu_check, "check_kernel_bench", lambda smoke: Outcome(PASS, "fake"))
    data = run_gpu_check(options=Options(str(tmp_path), smoke=True, steps="1,4", budget_s=-1.0))
    assert statuses(data)["1"] == statuses(data)["4"] == "not run"
    assert data["passed"] is True and data["complete"] is False
    assert "time budget" in data["steps"][0]["summary"]


def test_a_restarted_smoke_run_gets_its_options_back() -> None:
    parser = argparse.ArgumentParser()
    cli.add_parser(parser.add_subparsers())
    opts = Options("o", True, "1,2b", "random", "build/device/model", 400.0)
    args = parser.parse_args(["gpu-check", *cli.cli_argv(opts)])
    assert Options(args.out, args.smoke, args.steps, args.model, args.model_files, args.budget_s) == opts
