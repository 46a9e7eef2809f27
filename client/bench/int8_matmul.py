"""CPU microbenchmark behind `Int8Linear`'s path choice (backend/models/quantization.py): at the default model's
projection shapes (SmolLM2-135M: hidden 576, intermediate 1536, 9 heads x 64, 3 KV heads, vocabulary 49152),
batch 1 and 32, the fp32 and bf16 `F.linear`, the oneDNN-packed fp32 and bf16 linears the engine uses unquantized
(`CpuPackedLinear`, backend/models/llama.py; bf16 where oneDNN supports it), and int8 weights through
`_weight_int8pack_mm` with bf16 or fp32 activations, or dequantized then `F.linear`.

`python -m tritium.client.bench.int8_matmul [--threads N] [--reps R]` prints microseconds per call (the
minimum over R calls, so a shared host's contention counts least) and the per-step total of 30 layers + head.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from tritium.backend.models.llama import cpu_packing_available
from tritium.backend.models.quantization import cpu_has_bf16_instructions, quantize_per_channel

SHAPES = {"qkv": (576 + 2 * 192, 576), "o": (576, 576), "gate_up": (2 * 1536, 576), "down": (576, 1536),
          "lm_head": (49152, 576)}
LAYERS = 30


def best_us(fn: Callable[[], object], reps: int) -> float:
    for _ in range(3):
        fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best * 1e6


def candidates(w: torch.Tensor, x: torch.Tensor) -> dict[str, Callable[[], object]]:
    q, s = quantize_per_channel(w)
    unit = torch.ones_like(s, dtype=torch.bfloat16)
    packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
    int8pack = torch.ops.aten._weight_int8pack_mm
    w16, x16 = w.to(torch.bfloat16), x.to(torch.bfloat16)
    bf16: dict[str, Callable[[], object]] = {"bf16_linear": lambda: F.linear(x16, w16)}
    if cpu_packing_available(torch.bfloat16):
        packed16 = torch.ops.mkldnn._reorder_linear_weight(w16, None)
        bf16["bf16_packed"] = lambda: torch.ops.mkldnn._linear_pointwise(x16, packed16, None, "none", [], "")
    return {
        "fp32_linear": lambda: F.linear(x, w),
        "fp32_packed": lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""),
        **bf16,
        "int8_bf16act": lambda: int8pack(x.to(torch.bfloat16), q, unit).float() * s,  # the cpu_bf16 path
        "int8_fp32act": lambda: int8pack(x, q, s),  # the cpu_fp32 path
        "int8_dequant": lambda: F.linear(x, q.float() * s[:, None]),  # the dequant path
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--reps", type=int, default=40)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"threads {torch.get_num_threads()}, capability {torch.backends.cpu.get_cpu_capability()}, "
          f"bf16 instructions {cpu_has_bf16_instructions()}")
    with torch.inference_mode():
        for m in (1, 32):
            totals: dict[str, float] = {}
            for name, (n, k) in SHAPES.items():
                w, x = torch.randn(n, k) * 0.05, torch.randn(m, k)
                reps = max(5, args.reps // 4) if name == "lm_head" else args.reps
                row = {key: best_us(fn, reps if key != "int8_dequant" else max(3, reps // 8))
                       for key, fn in candidates(w, x).items()}
                for key, us in row.items():
                    totals[key] = totals.get(key, 0.0) + us * (1 if name == "lm_head" else LAYERS)
                print(f"batch {m:2d} {name:8s} " + "  ".join(f"{key} {us:9.1f}" for key, us in row.items()),
                      flush=True)
            print(f"batch {m:2d} per step (30 layers + head, ms): "
                  + "  ".join(f"{key} {us / 1000:.2f}" for key, us in totals.items()), flush=True)


if __name__ == "__main__":
    main()
