"""Prompt lookup: draft the tokens that followed the latest earlier occurrence of the sequence's last n tokens."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose_ngram(tokens: Sequence[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to `k` drafts, for the largest n in [min_n, max_n] whose n-gram repeats; [] when none does."""
    size = len(tokens)
    if k < 1 or size < min_n + 1:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        windows = sliding_window_view(arr[: size - 1], n)  # every n-gram that ends before the last token
        hits = np.flatnonzero((windows == arr[size - n :]).all(axis=1))
        if hits.size:
            # The latest occurrence that k tokens follow, else the earliest (the longest continuation).
            full = hits[hits <= size - n - k]
            start = int(full[-1] if full.size else hits[0]) + n
            return [int(t) for t in arr[start : start + k]]
    return []
