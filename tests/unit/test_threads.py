"""CPU intra-op threads sized to the host (worker/threads.py): every usable core, the cgroup quota, the affinity."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tritium.backend.config import EngineConfig
from tritium.backend.serving.settings import load_settings
from tritium.backend.worker.threads import (
    ThreadChoice,
    cgroup_cpu_quota,
    choose_threads,
    parse_cfs,
    parse_cpu_max,
    set_up_threads,
    usable_cores,
)


@pytest.mark.parametrize("cores", [1, 2, 4, 8, 16, 64])
def test_every_usable_core_runs_a_thread(cores: int) -> None:
    assert choose_threads(cores) == ThreadChoice(cores, "every usable core")


def test_num_threads_overrides_the_rule_and_omp_num_threads() -> None:
    assert choose_threads(16, override=3) == ThreadChoice(3, "num_threads is set")
    assert choose_threads(2, override=5, omp_num_threads="1").count == 5  # more than the cores: asked


def test_omp_num_threads_counts_when_num_threads_is_unset() -> None:
    choice = choose_threads(16, omp_num_threads="4")
    assert (choice.count, choice.reason) == (4, "OMP_NUM_THREADS is set")
    assert choose_threads(16, omp_num_threads="junk").count == 16
    assert choose_threads(16, omp_num_threads="0").count == 16


@pytest.mark.parametrize("text,cpus", [("150000 100000\n", 1.5), ("max 100000\n", None), ("200000 100000", 2.0),
                                       ("", None), ("bad 100000", None)])
def test_cgroup_v2_cpu_max(text: str, cpus: float | None) -> None:
    assert parse_cpu_max(text) == cpus


@pytest.mark.parametrize("quota,period,cpus", [("-1", "100000", None), ("50000", "100000", 0.5),
                                               ("400000\n", "100000\n", 4.0), ("x", "100000", None)])
def test_cgroup_v1_cfs(quota: str, period: str, cpus: float | None) -> None:
    assert parse_cfs(quota, period) == cpus


def _proc(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "proc-self-cgroup"
    path.write_text(text)
    return path


def test_a_v2_quota_of_one_and_a_half_cpus_caps_a_16_core_affinity_at_2(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    (root / "kubepods" / "pod1").mkdir(parents=True)
    (root / "kubepods" / "cpu.max").write_text("400000 100000\n")
    (root / "kubepods" / "pod1" / "cpu.max").write_text("150000 100000\n")
    proc = _proc(tmp_path, "0::/kubepods/pod1\n")
    assert cgroup_cpu_quota(root, proc) == (1.5, str(root / "kubepods" / "pod1" / "cpu.max"))
    cores = usable_cores(set(range(16)), root, proc)
    assert (cores.count, cores.affinity, cores.quota) == (2, 16, 1.5)
    assert "1.5 CPUs" in cores.describe()
    assert choose_threads(cores.count).count == 2


def test_the_tightest_quota_of_the_ancestors_wins(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    (root / "a" / "b").mkdir(parents=True)
    (root / "a" / "cpu.max").write_text("300000 100000\n")
    (root / "a" / "b" / "cpu.max").write_text("max 100000\n")
    assert usable_cores(set(range(16)), root, _proc(tmp_path, "0::/a/b\n")).count == 3


def test_no_quota_leaves_the_affinity_mask(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    root.mkdir()
    (root / "cpu.max").write_text("max 100000\n")
    cores = usable_cores({0, 3, 5}, root, _proc(tmp_path, "0::/\n"))
    assert (cores.count, cores.affinity, cores.quota) == (3, 3, None)
    assert "no cgroup CPU quota" in cores.describe()
    assert usable_cores(set(range(16)), tmp_path / "missing", tmp_path / "missing-proc").count == 16


def test_a_v1_quota(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    folder = root / "cpu,cpuacct" / "docker" / "abc"
    folder.mkdir(parents=True)
    (folder / "cpu.cfs_quota_us").write_text("250000\n")
    (folder / "cpu.cfs_period_us").write_text("100000\n")
    proc = _proc(tmp_path, "4:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n0::/\n")
    cores = usable_cores(set(range(16)), root, proc)
    assert (cores.count, cores.quota) == (3, 2.5)
    unlimited = root / "cpu"
    unlimited.mkdir()
    (unlimited / "cpu.cfs_quota_us").write_text("-1\n")
    (unlimited / "cpu.cfs_period_us").write_text("100000\n")
    assert usable_cores(set(range(16)), root, _proc(tmp_path, "3:cpu,cpuacct:/\n")).count == 16


def test_a_quota_below_one_cpu_still_runs_one_thread(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    root.mkdir()
    (root / "cpu.max").write_text("20000 100000\n")
    cores = usable_cores(set(range(8)), root, _proc(tmp_path, "0::/\n"))
    assert cores.count == 1
    assert choose_threads(cores.count).count == 1


def test_this_host_is_read_without_error() -> None:
    cores = usable_cores()
    assert 1 <= cores.count <= cores.affinity


def test_threads_are_left_alone_off_the_cpu() -> None:
    assert set_up_threads(3, device_type="cuda") is None


@pytest.mark.parametrize("value", [0, -2, 1.5, "4", True])
def test_an_invalid_num_threads_is_refused_naming_the_field(value: object) -> None:
    with pytest.raises(ValueError, match="num_threads must be an integer >= 1"):
        EngineConfig(num_threads=value)  # type: ignore[arg-type]


def test_num_threads_comes_from_model_json(tmp_path: Path) -> None:
    assert EngineConfig().num_threads is None
    (tmp_path / "model.json").write_text(json.dumps({"num_threads": 3}))
    assert load_settings(tmp_path).engine.num_threads == 3
    (tmp_path / "model.json").write_text(json.dumps({"num_threads": 0}))
    with pytest.raises(ValueError, match="num_threads"):
        load_settings(tmp_path)
