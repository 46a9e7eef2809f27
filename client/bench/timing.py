"""How the kernel benchmarks time a launch: the mean of many calls captured in one CUDA graph and replayed, so that
a small kernel's figure is the GPU's time, not Python's launch overhead (the engine replays its decode steps the
same way); triton's `do_bench` for a function that cannot be captured (one that waits on the host)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)


def kernel_ms(fn: Callable[[], object], smoke: bool) -> float:
    """Milliseconds per call of `fn` on CUDA; with `smoke` (the interpreter on a CPU) one timed call, which checks
    the code and means nothing."""
    if smoke:
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1000
    import torch
    import triton.testing

    try:
        return float(triton.testing.do_bench_cudagraph(fn, rep=60))
    except RuntimeError as exc:  # capture refused (a host sync inside): launches timed instead
        torch.cuda.synchronize()
        logger.info("timing without a CUDA graph (%s)", exc)
        return float(triton.testing.do_bench(fn, warmup=10, rep=60))
