"""Every kernel compiles for sm_80 and sm_90 without a GPU, and none spills on sm_90 where the engine
uses it (see tritium.kernels.compile_check)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

KERNELS = {"store_kv_kernel", "rms_norm_kernel", "rotary_kernel", "silu_and_mul_kernel",
           "prefill_attention_kernel", "decode_split_kernel", "decode_reduce_kernel"}


@pytest.mark.slow
def test_all_kernels_compile_for_sm80_and_sm90_without_spills() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "tritium.kernels.compile_check", "--json"],
                          env=env, capture_output=True, text=True, timeout=900)
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    failures = [r for r in results if not r["ok"]]
    assert not failures, failures[:3]
    spills = [r for r in results if r["arch"] == 90 and r["used_by_engine"] and (r["spill_stores"] or r["spill_loads"])]
    assert not spills, spills[:3]
    assert proc.returncode == 0, proc.stderr[-2000:]
    for arch in (80, 90):
        built = {r["kernel"] for r in results if r["arch"] == arch}
        assert built == KERNELS
        for dtype in ("fp16", "bf16", "fp32"):
            dims = {r["head_dim"] for r in results if r["arch"] == arch and r["dtype"] == dtype
                    and r["kernel"] == "prefill_attention_kernel"}
            assert dims == {64, 128, 256}
    assert all(r["registers"] > 0 for r in results)
