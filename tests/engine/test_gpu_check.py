"""`tritium gpu-check --smoke` end to end on the CPU: every step reports, the CUDA-only ones skip, the JSON and
the PNG are written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from tritium.client.checks.engine import STEP_LABEL, recording_syncs, split_profile
from tritium.client.checks.report import StepResult, goal_verdicts


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_gpu_check_smoke(tmp_path: Path, default_model_path: Path) -> None:
    out = tmp_path / "gpu_check"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the entry must set it itself
    run = subprocess.run([sys.executable, "-m", "tritium.client.checks.gpu_check", "--smoke", "--out", str(out)],
                         capture_output=True, text=True, timeout=840, env=env)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    data = json.loads((out / "gpu_check.json").read_text())
    status = {s["number"]: s["status"] for s in data["steps"]}
    assert status == {"1": "pass", "2": "pass", "3": "skip", "3b": "skip", "2b": "pass", "3c": "skip", "4": "pass",
                      "5": "pass", "3d": "pass", "2c": "pass", "2d": "pass"}, data["steps"]
    assert data["complete"] and data["models"]["random-llama8b-like"]["shape"]["head_dim"] == 128
    families = data["models"]
    assert families["gemma3"]["shape"]["sliding_window"] == 8 and "sliding_window" not in families["qwen3"]["shape"]
    assert all(s["seconds"] >= 0 and s["summary"] for s in data["steps"])
    assert data["smoke"] and data["passed"] and data["machine"]["torch"] and data["machine"]["triton"]
    assert [g["verdict"] for g in data["goals"]] == ["not measured"] * 6  # smoke figures are not judged
    features = next(s for s in data["steps"] if s["name"] == "decode_features")["figures"]
    assert features["lora"]["lora"]["steps"] > 0 and features["ngram"]["random"]["ngram"]["tokens_per_s"] > 0
    int8 = next(s for s in data["steps"] if s["name"] == "kernel_bench")["figures"]["int8_gemm"]
    assert [p["rows"] for p in int8["points"]] == [1, 16] and all(p["int8_ms"] > 0 for p in int8["points"])
    parity = next(s for s in data["steps"] if s["name"] == "parity")["figures"]
    assert all(p["identical"] for p in parity["prompts"])
    assert (out / "gpu_check.png").stat().st_size > 10_000
    assert "goal" in run.stdout and "results:" in run.stdout


def step(name: str, **figures: object) -> StepResult:
    return StepResult("0", name, name, "pass", 1.0, "", dict(figures))


def test_goal_verdicts() -> None:
    def prefill(seqlen: int, ours: float, sdpa: float) -> dict[str, object]:
        return {"head_dim": 64, "batch": 1, "seqlen": seqlen, "tritium_tflops": ours, "sdpa_flash_tflops": sdpa}

    def decode(batch: int, gbs: float) -> dict[str, object]:
        return {"head_dim": 64, "batch": batch, "context": 4096, "tritium_gbs": gbs, "torch_gather_gbs": 1.0,
                "peak_gbs": 4800.0}

    # decode is judged against the copy measured on the device (4,000 GB/s), not the data sheet's 4,800
    def int8(rows: int, speedup: float) -> dict[str, object]:
        return {"rows": rows, "int8_ms": 1.0, "bf16_ms": speedup, "speedup": speedup}

    # int8 is judged at 16 rows and fewer only: prefill-sized GEMMs may run dense
    bench = step("kernel_bench", prefill=[prefill(1024, 10, 100), prefill(2048, 95, 100), prefill(8192, 91, 100)],
                 decode=[decode(8, 100.0), decode(64, 3000.0)], copy_gbs=4000.0,
                 int8_gemm={"layer": [4096, 4096], "points": [int8(1, 1.8), int8(16, 1.4), int8(4096, 0.7)]})
    timing = step("step_timing", host_ms_per_step=2.0, gpu_ms_per_step=3.0)
    features = step("decode_features", smoke=False, lora={"overhead": 0.12},
                    ngram={"repeating": {"ratio": 2.1}, "random": {"ratio": 0.98}})
    goals = goal_verdicts({"kernel_bench": bench, "step_timing": timing, "decode_features": features})
    assert [g.verdict for g in goals] == ["met"] * 6
    assert goals[4].value == "+12%" and "worst 0.98x" in goals[5].value
    features.figures["lora"]["overhead"], features.figures["ngram"]["random"]["ratio"] = 0.2, 0.9
    assert [g.verdict for g in goal_verdicts({"decode_features": features})][4:] == ["missed", "missed"]
    features.figures["smoke"] = True
    assert [g.verdict for g in goal_verdicts({"decode_features": features})][4:] == ["not measured"] * 2
    assert "worst 1.40x at 2 row counts" in goals[3].value
    assert "0.91x" in goals[0].value and "75% of 4000 GB/s (copy)" in goals[1].value
    bench.figures["copy_gbs"] = 4500.0  # 3,000 is 67% of it
    assert goal_verdicts({"kernel_bench": bench})[1].verdict == "missed"
    bench.figures["copy_gbs"] = None  # no copy measured: the peak does not stand in
    assert goal_verdicts({"kernel_bench": bench})[1].verdict == "not measured"
    bench.figures["copy_gbs"] = 4000.0

    bench.figures["prefill"].append(prefill(4096, 80, 100))
    timing.figures["gpu_ms_per_step"] = 1.5
    bench.figures["int8_gemm"]["points"].append(int8(8, 1.1))
    assert [g.verdict for g in goal_verdicts({"kernel_bench": bench, "step_timing": timing})] == \
        ["missed", "met", "missed", "missed", "not measured", "not measured"]
    assert [g.verdict for g in goal_verdicts({})] == ["not measured"] * 6


def test_split_profile_separates_host_waits_and_gpu_time() -> None:
    from torch.autograd import DeviceType

    def event(name: str, us: float, device: DeviceType = DeviceType.CPU, annotation: bool = False) -> SimpleNamespace:
        return SimpleNamespace(name=name, device_type=device, is_user_annotation=annotation,
                               time_range=SimpleNamespace(elapsed_us=lambda: us))

    events = [event(STEP_LABEL, 5000), event(STEP_LABEL, 3000), event("cudaStreamSynchronize", 1500),
              event("cudaMemcpyAsync_v3020", 500), event("cudaLaunchKernel", 10), event("aten::mm", 100),
              event("gemm_kernel", 2000, DeviceType.CUDA), event("Memcpy DtoH", 50, DeviceType.CUDA),
              event(STEP_LABEL, 7000, DeviceType.CUDA, annotation=True)]
    split = split_profile(events, steps=2)
    assert split == {"profiled_wall_ms_per_step": 4.0, "sync_wait_ms_per_step": 1.0, "host_ms_per_step": 3.0,
                     "gpu_ms_per_step": 1.025}
    assert split_profile(events[:3], steps=1)["gpu_ms_per_step"] is None


def test_recording_syncs_names_the_innermost_tritium_frame(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    import tritium.backend.sample.sampler

    modes: list[str] = []
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)
    namespace: dict[str, object] = {}
    # a function that lives (as far as tracebacks know) in backend/sample/sampler.py and synchronizes
    exec(compile("def fetch():\n    import warnings\n    warnings.warn('called a synchronizing CUDA operation')\n",
                 tritium.backend.sample.sampler.__file__, "exec"), namespace)
    with recording_syncs() as found:
        namespace["fetch"]()  # type: ignore[operator]
        namespace["fetch"]()  # type: ignore[operator]
    assert found == ["backend/sample/sampler.py:3 in fetch"] * 2
    assert modes == ["warn", "default"]
