"""gpu-check's int8 weight GEMM against the bf16 GEMM it replaces (kernel benchmark step): a 4096 x 4096 layer at
decode-sized and prefill-sized row counts, both timed in CUDA graphs (bench/timing.py). A decode step reads the
weights once per layer, so int8's half of the bytes should show at few rows; at prefill sizes the GEMM is
compute-bound and the dense one may win."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

from tritium.backend.layers.int8_linear import quantize_per_channel
from tritium.client.bench.timing import kernel_ms

GPU_LAYER = (4096, 4096)  # N (outputs), K (inputs)
GPU_ROWS = (1, 16, 32, 64, 4096)
SMOKE_LAYER = (64, 64)  # the interpreter's: checks the code
SMOKE_ROWS = (1, 16)
INT8_GOAL_MAX_ROWS = 16
INT8_GOAL_SPEEDUP = 1.3


@dataclass
class Int8Point:
    rows: int
    int8_ms: float
    bf16_ms: float

    @property
    def speedup(self) -> float:
        return self.bf16_ms / self.int8_ms if self.int8_ms > 0 else 0.0


def int8_gemm_figures(smoke: bool) -> dict[str, Any]:
    """{"layer": [N, K], "points": [{rows, int8_ms, bf16_ms, speedup}]}: int8_gemm against `F.linear` on the
    bf16 weight, per row count (fp32 activations under the interpreter)."""
    from tritium.kernels.int8_gemm import int8_gemm

    device, dtype = ("cpu", torch.float32) if smoke else ("cuda", torch.bfloat16)
    n, k = SMOKE_LAYER if smoke else GPU_LAYER
    torch.manual_seed(0)
    weight = (torch.randn(n, k, device=device) * 0.05).to(dtype)
    q, scale = quantize_per_channel(weight)
    q, scale = q.to(device), scale.to(device)
    points = []
    for rows in SMOKE_ROWS if smoke else GPU_ROWS:
        x = torch.randn(rows, k, device=device, dtype=dtype)
        points.append(Int8Point(rows, kernel_ms(lambda x=x: int8_gemm(x, q, scale), smoke),
                                kernel_ms(lambda x=x: torch.nn.functional.linear(x, weight), smoke)))
    return {"layer": [n, k], "points": [asdict(p) | {"speedup": p.speedup} for p in points]}


def int8_goal(figures: dict[str, Any]) -> tuple[bool, bool, str]:
    """(met, measured, detail) of "int8 >= 1.3x bf16 at M <= 16" from `int8_gemm_figures`' output."""
    small = [p for p in figures.get("points", []) if p["rows"] <= INT8_GOAL_MAX_ROWS]
    if not small:
        return False, False, "no int8 GEMM figures"
    worst = min(p["speedup"] for p in small)
    return worst >= INT8_GOAL_SPEEDUP, True, f"worst {worst:.2f}x at {len(small)} row counts <= {INT8_GOAL_MAX_ROWS}"
