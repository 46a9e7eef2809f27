"""How many intra-op (OpenMP) threads a CPU engine runs (the rule and why: docs/operating.md, "CPU threads")."""

from __future__ import annotations

import logging
import math
import os
import threading
from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_SELF_CGROUP = Path("/proc/self/cgroup")
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Cores:
    """Usable cores (`count` >= 1): the affinity mask's size capped by the cgroup quota in CPUs (None: none)."""

    count: int
    affinity: int
    quota: float | None = None
    quota_source: str | None = None

    def describe(self) -> str:
        """`2 usable cores (affinity 2 CPUs, no cgroup CPU quota)` or with the quota and its file."""
        quota = "no cgroup CPU quota" if self.quota is None else \
            f"cgroup CPU quota {self.quota:g} CPUs from {self.quota_source}"
        return f"{self.count} usable cores (affinity {self.affinity} CPUs, {quota})"


@dataclass(frozen=True)
class ThreadChoice:
    """The thread count and why, in words (logged)."""

    count: int
    reason: str


def parse_cpu_max(text: str) -> float | None:
    """CPUs a cgroup v2 `cpu.max` ("quota period") allows; None when "max" or unreadable."""
    parts = text.split()
    if not parts or parts[0] == "max":
        return None
    try:
        quota = int(parts[0])
        period = int(parts[1]) if len(parts) > 1 else 100_000
    except ValueError:
        return None
    return quota / period if quota > 0 and period > 0 else None


def parse_cfs(quota_text: str, period_text: str) -> float | None:
    """CPUs cgroup v1's cfs quota and period allow; None when unlimited (-1) or unreadable."""
    try:
        quota, period = int(quota_text.strip()), int(period_text.strip())
    except ValueError:
        return None
    return quota / period if quota > 0 and period > 0 else None


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except OSError:
        return None


def _own_cgroup_dirs(root: Path, proc_cgroup: Path, v1_controller: str | None) -> list[Path]:
    """The process's cgroup folder under `root` and its ancestors, nearest first, then `root`."""
    rel: str | None = None
    for line in (_read(proc_cgroup) or "").splitlines():
        hier, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if (v1_controller is None and hier == "0" and controllers == "") or \
                (v1_controller is not None and v1_controller in controllers.split(",")):
            rel = path
            break
    dirs: list[Path] = []
    if rel:
        here = root / rel.lstrip("/")
        while here != root and root in here.parents:
            dirs.append(here)
            here = here.parent
    return [*dirs, root]


def cgroup_cpu_quota(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_SELF_CGROUP) -> tuple[float | None, str | None]:
    """The tightest CPU quota (v2 or v1) over the process's cgroups, in CPUs, and its file; (None, None): none."""
    found: list[tuple[float, str]] = []
    for folder in _own_cgroup_dirs(root, proc_cgroup, None):
        text = _read(folder / "cpu.max")
        if text is not None and (cpus := parse_cpu_max(text)) is not None:
            found.append((cpus, str(folder / "cpu.max")))
    for mount in ("cpu", "cpu,cpuacct", "cpuacct,cpu"):
        base = root / mount
        if not base.is_dir():
            continue
        for folder in _own_cgroup_dirs(base, proc_cgroup, "cpu"):
            quota, period = _read(folder / "cpu.cfs_quota_us"), _read(folder / "cpu.cfs_period_us")
            if quota is not None and period is not None and (cpus := parse_cfs(quota, period)) is not None:
                found.append((cpus, str(folder / "cpu.cfs_quota_us")))
        break
    if not found:
        return None, None
    cpus, source = min(found)
    return cpus, source


def usable_cores(affinity: set[int] | None = None, root: Path = CGROUP_ROOT,
                 proc_cgroup: Path = PROC_SELF_CGROUP) -> Cores:
    """The affinity mask (None: the process's) capped by the cgroup CPU quota rounded up; at least 1."""
    if affinity is None:
        try:
            affinity = os.sched_getaffinity(0)
        except (AttributeError, OSError):  # not on Linux
            affinity = set(range(os.cpu_count() or 1))
    allowed = max(1, len(affinity))
    quota, source = cgroup_cpu_quota(root, proc_cgroup)
    count = allowed if quota is None else max(1, min(allowed, math.ceil(quota - 1e-9)))
    return Cores(count, allowed, quota, source)


def choose_threads(usable: int, override: int | None = None, omp_num_threads: str | None = None,
                   ranks: int = 1) -> ThreadChoice:
    """`override`, else a valid `omp_num_threads`, else every usable core, shared by `ranks` tensor-parallel ranks
    (docs/operating.md, "CPU threads")."""
    if override is not None:
        return ThreadChoice(override, "num_threads is set")
    if omp_num_threads:
        try:
            omp = int(omp_num_threads.split(",")[0])
        except ValueError:
            omp = 0
        if omp >= 1:
            return ThreadChoice(omp, "OMP_NUM_THREADS is set")
    if ranks > 1:
        return ThreadChoice(max(1, usable // ranks), f"the usable cores shared by {ranks} tensor-parallel ranks")
    return ThreadChoice(max(1, usable), "every usable core")


@dataclass(frozen=True)
class CoreBinding:
    """A thread's CPU affinity, to give back once a tensor-parallel rank 0 bound it to its own cores."""

    thread: int
    cores: frozenset[int]

    @classmethod
    def of_this_thread(cls) -> CoreBinding:
        cores = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()
        return cls(threading.get_ident(), frozenset(cores))

    def restore(self) -> None:
        """Back to the recorded cores when called on the recorded thread (affinity is per thread)."""
        if self.cores and threading.get_ident() == self.thread and hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, self.cores)


def rank_cores(affinity: set[int], usable: int, rank: int, ranks: int) -> set[int] | None:
    """Tensor-parallel rank `rank`'s own cores: the `rank`-th of `ranks` equal parts of the first `usable` cores of
    `affinity`; None when there are fewer usable cores than ranks (the ranks then share them)."""
    if ranks < 2 or usable < ranks:
        return None
    share = usable // ranks
    return set(sorted(affinity)[rank * share : (rank + 1) * share])


def set_up_threads(num_threads: int | None, device_type: str, ranks: int = 1, rank: int = 0) -> ThreadChoice | None:
    """On a CPU: choose, set and log the thread count (each of `ranks` processes). A tensor-parallel rank also binds
    the calling thread, and the threads it starts later, to its own cores (rank_cores): a collective's latency
    doubled when ranks floated over each other's cores (docs/operating.md, "CPU threads"). None, changing nothing,
    on another device."""
    import torch

    if device_type != "cpu":
        return None
    cores = usable_cores()
    rule = choose_threads(cores.count, num_threads, os.environ.get("OMP_NUM_THREADS"), ranks)
    own = rank_cores(os.sched_getaffinity(0), cores.count, rank, ranks) if hasattr(os, "sched_setaffinity") else None
    if own:
        os.sched_setaffinity(0, own)
    torch.set_num_threads(rule.count)
    bound = f"; bound to cores {sorted(own)}" if own else ""
    choice = ThreadChoice(rule.count, f"{rule.reason}; {cores.describe()}{bound}")
    logger.info("tritium engine: %d intra-op threads, %s", choice.count, choice.reason)
    return choice
