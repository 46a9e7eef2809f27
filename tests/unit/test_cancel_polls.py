"""The is_cancelled() budget of the response thread (CancelPolls), sweep by sweep on a made-up clock."""

from __future__ import annotations

from itertools import pairwise

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tritium.backend.sampling_params import SamplingParams
from tritium.backend.serving.cancel_polls import CANCEL_CHECKS_PER_S, CANCEL_MIN_INTERVAL_S, CancelPolls
from tritium.backend.serving.jobs import Job

from support.sinks import RecordingSink


def sweep(n: int, gaps: list[float], polls: CancelPolls | None = None) -> list[tuple[float, int]]:
    """Sweeps `gaps` apart over `n` jobs: the asks in order, (when, which job)."""
    polls = polls or CancelPolls()
    jobs = [Job(request_id=str(i), params=SamplingParams(), sink=RecordingSink()) for i in range(n)]
    asks = []
    now = 100.0
    for gap in gaps:
        now += gap
        asks += [(now, int(job.request_id)) for job in polls.pick(jobs, now)]
    return asks


def by_job(asks: list[tuple[float, int]]) -> list[list[float]]:
    """When each job was asked."""
    times: dict[int, list[float]] = {}
    for t, i in asks:
        times.setdefault(i, []).append(t)
    return list(times.values())


@pytest.mark.parametrize("n", [1, 5, 6, 10, 64, 200])
def test_with_a_sweep_per_tick_every_job_is_asked_within_the_documented_bound(n: int) -> None:
    tick = 1 / 32
    asks = sweep(n, [tick] * 700)
    bound = max(CANCEL_MIN_INTERVAL_S, n / CANCEL_CHECKS_PER_S)
    settled = 100.0 + bound + tick  # once every job had its first turn
    gaps = [later - earlier for times in by_job(asks) for earlier, later in pairwise(times) if earlier >= settled]
    assert gaps and min(gaps) >= CANCEL_MIN_INTERVAL_S and max(gaps) <= bound + tick
    times = [t for t, _ in asks]
    assert all(later - earlier >= 1.0 for earlier, later in zip(times, times[CANCEL_CHECKS_PER_S:], strict=False))


def test_the_least_recently_asked_goes_first() -> None:
    order = [i for _, i in sweep(64, [1 / 32] * 200)]
    assert order[:64] == list(range(64))  # first turns (all due at once): in the jobs' order
    # Then round robin: between two asks of a job, every other job once (and one asked in the same sweep as it,
    # which may go first next round, twice).
    last: dict[int, int] = {}
    for k, i in enumerate(order):
        assert i not in last or k - last[i] - 1 <= 64
        last[i] = k
    assert len(order) > 256


def test_idle_sweeps_earn_no_burst() -> None:
    polls = CancelPolls()
    for k in range(100):  # ten seconds with nobody to ask, a sweep every 0.1 s
        assert polls.pick([], 100.0 + k / 10) == []
    assert len(sweep(64, [10.0], polls)) <= 1 + CANCEL_MIN_INTERVAL_S * CANCEL_CHECKS_PER_S


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 120), gaps=st.lists(st.floats(0.0, 0.3), min_size=1, max_size=300))
def test_uneven_sweeps_keep_the_rate_and_the_interval(n: int, gaps: list[float]) -> None:
    asks = sweep(n, gaps)
    for times in by_job(asks):
        assert all(later - earlier >= CANCEL_MIN_INTERVAL_S - 1e-9 for earlier, later in pairwise(times))
    # Never ahead of the rate: by any ask, at most what the time since the first sweep earned, plus the first
    # sweep's ask and one left over.
    for k, (t, _) in enumerate(asks):
        assert k + 1 <= 2 + (t - 100.0 - gaps[0]) * CANCEL_CHECKS_PER_S + 1e-6
