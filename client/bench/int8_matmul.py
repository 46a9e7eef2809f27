"""CPU microbenchmark behind `Int8Linear`'s and `Int4Linear`'s path choices (backend/layers/int8_linear.py,
int4_linear.py): at the default model's
projection shapes (SmolLM2-135M: hidden 576, intermediate 1536, 9 heads x 64, 3 KV heads, vocabulary 49152),
batch 1 and 32, the fp32 and bf16 `F.linear`, the oneDNN-packed fp32 and bf16 linears the engine uses unquantized
(`CpuPackedLinear`, backend/layers/linear.py; bf16 where oneDNN supports it), and int8 weights through
`_weight_int8pack_mm` with bf16 or fp32 activations, or dequantized then `F.linear`; and int4 weights (groups of
32) through `_weight_int4pack_mm_for_cpu` with bf16 or fp32 activations, or dequantized then `F.linear`.

`python -m tritium.client.bench.int8_matmul [--threads N] [--reps R] [--distinct-layers] [--columns int4 ...]`
prints microseconds per call (the minimum over R calls, so a shared host's contention counts least) and the per-step
total of 30 layers + head. By default each shape's one weight is called 30 times (it stays in cache);
`--distinct-layers` gives every layer its own weights, as in the engine, where smaller weights matter most.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from tritium.backend.layers.int4_linear import Int4Linear, dequantize_groups, quantize_groups
from tritium.backend.layers.int8_linear import cpu_has_bf16_instructions, quantize_per_channel
from tritium.backend.layers.linear import cpu_packing_available

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
        **int4_candidates(w, x),
    }


def int4_candidates(w: torch.Tensor, x: torch.Tensor) -> dict[str, Callable[[], object]]:
    """Int4Linear's three paths (forced, so both packed ones run on any CPU)."""
    q4, s4, z4 = quantize_groups(w)
    bf16, fp32 = Int4Linear(w, None, path="cpu_bf16"), Int4Linear(w, None, path="cpu_fp32")
    return {
        "int4_bf16act": lambda: bf16(x),  # the cpu_bf16 path (casts back to fp32, as in the engine)
        "int4_fp32act": lambda: fp32(x),  # the cpu_fp32 path
        "int4_dequant": lambda: F.linear(x, dequantize_groups(q4, s4, z4, x.shape[1], x.dtype)),  # the dequant path
    }


def per_call_us(calls: list[Callable[[], object]], reps: int) -> float:
    """Microseconds per call of `calls` made in turn (best_us of the whole round, divided)."""
    return best_us(lambda: [call() for call in calls], reps) / len(calls)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--reps", type=int, default=40)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 32], help="row counts (default: 1 32)")
    p.add_argument("--distinct-layers", action="store_true",
                   help="30 distinct weights per layer shape, called in turn (the engine's case: weights stream "
                        "from memory instead of staying in cache); the figures are per call")
    p.add_argument("--columns", nargs="+", default=None, help="only the columns naming one of these (e.g. int4)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"threads {torch.get_num_threads()}, capability {torch.backends.cpu.get_cpu_capability()}, "
          f"bf16 instructions {cpu_has_bf16_instructions()}")
    with torch.inference_mode():
        for m in args.batches:
            totals: dict[str, float] = {}
            for name, (n, k) in SHAPES.items():
                x = torch.randn(m, k)
                copies = LAYERS if args.distinct_layers and name != "lm_head" else 1
                layers = [candidates(torch.randn(n, k) * 0.05, x) for _ in range(copies)]
                keys = [key for key in layers[0] if args.columns is None or any(c in key for c in args.columns)]
                reps = max(5, args.reps // 4) if name == "lm_head" else args.reps
                row = {key: per_call_us([layer[key] for layer in layers],
                                        reps if not key.endswith("_dequant") else max(3, reps // 8)) for key in keys}
                for key, us in row.items():
                    totals[key] = totals.get(key, 0.0) + us * (1 if name == "lm_head" else LAYERS)
                print(f"batch {m:2d} {name:8s} " + "  ".join(f"{key} {us:9.1f}" for key, us in row.items()),
                      flush=True)
            print(f"batch {m:2d} per step (30 layers + head, ms): "
                  + "  ".join(f"{key} {us / 1000:.2f}" for key, us in totals.items()), flush=True)


if __name__ == "__main__":
    main()
