"""The device bundle (`make device-bundle`): its manifest, its size limit, and installing on the device only the
wheels the image lacks."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tritium.client.checks import device_bundle
from tritium.client.checks.device_bundle import BundleTooLarge, install, prepare, wheel_fits


def make_wheel(folder: Path, name: str, version: str, payload: bytes = b"") -> Path:
    """A minimal pure wheel of a one-module distribution `name` (its module says `VALUE = 42`)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}-{version}-py3-none-any.whl"
    info = f"{name}-{version}.dist-info"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{name}.py", "VALUE = 42\n")
        z.writestr(f"{name}_data.bin", payload)
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    return path


@pytest.fixture
def model_files(tmp_path: Path) -> Path:
    source = tmp_path / "model-source"
    source.mkdir()
    (source / "config.json").write_text(json.dumps({"vocab_size": 32, "hidden_size": 8}))
    (source / "tokenizer.json").write_text("{}")
    (source / "model.safetensors").write_bytes(b"weights are not carried")
    return source


def fake_download(payload: int = 0):  # type: ignore[no-untyped-def]
    def download(dest: Path, specs: list[str], python_version: str) -> None:
        assert python_version == "3.12" and any(s.startswith("matplotlib") for s in specs)
        make_wheel(dest, "tritium_fake_plot", "1.0", b"x" * payload)
        make_wheel(dest, "tqdm", "4.0")
    return download


def test_prepare_writes_wheels_model_files_and_manifest(tmp_path: Path, model_files: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(device_bundle, "download_wheels", fake_download())
    dest = tmp_path / "device"
    manifest = prepare(dest, model_files, repo=tmp_path)
    assert sorted(p.name for p in (dest / "model").iterdir()) == ["config.json", "tokenizer.json"]
    data = json.loads((dest / "manifest.json").read_text())
    assert [w["name"] for w in data["wheels"]] == ["tqdm", "tritium_fake_plot"]
    assert all(len(w["sha256"]) == 64 and (dest / w["path"]).stat().st_size == w["bytes"] for w in data["wheels"])
    assert [f["path"] for f in data["model_files"]] == ["model/config.json", "model/tokenizer.json"]
    assert data["python_version"] == "3.12" and data["model_source"] == str(model_files)
    assert manifest.bundle_bytes >= sum(w["bytes"] for w in data["wheels"]) + (dest / "manifest.json").stat().st_size


def test_prepare_fails_over_the_carry_limit(tmp_path: Path, model_files: Path, monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(device_bundle, "download_wheels", fake_download(payload=300_000))
    with pytest.raises(BundleTooLarge, match="over the 0 MiB"):
        prepare(tmp_path / "device", model_files, repo=tmp_path, limit_bytes=200_000)
    assert "MiB" in capsys.readouterr().out


def test_install_adds_only_the_wheels_the_python_lacks(tmp_path: Path, model_files: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(device_bundle, "download_wheels", fake_download())
    bundle = tmp_path / "device"
    prepare(bundle, model_files, repo=tmp_path)
    target = tmp_path / "site"
    assert install(bundle, target) == ["tritium_fake_plot-1.0-py3-none-any.whl"]  # tqdm is installed here
    assert (target / "tritium_fake_plot.py").is_file() and not (target / "tqdm.py").exists()
    # on the device the bundle installs by path with the standard library alone, no tritium import
    run = subprocess.run([sys.executable, "-S", "client/checks/device_bundle.py", "install", "--bundle", str(bundle),
                          "--target", str(tmp_path / "site2")], capture_output=True, text=True,
                         cwd=Path(device_bundle.__file__).parents[2])
    assert run.returncode == 0, run.stderr
    assert (tmp_path / "site2" / "tritium_fake_plot.py").is_file()


def test_install_without_a_bundle_says_how_to_make_one(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert device_bundle.main(["install", "--bundle", str(tmp_path / "none")]) == 1
    assert "make device-bundle" in capsys.readouterr().err


def test_wheels_are_chosen_by_the_running_pythons_version_and_machine() -> None:
    import platform

    arch = platform.machine()
    assert wheel_fits("six-1.17.0-py2.py3-none-any.whl", (3, 11))
    assert wheel_fits(f"pillow-11.0.0-cp312-cp312-manylinux_2_28_{arch}.whl", (3, 12))
    assert not wheel_fits(f"pillow-11.0.0-cp312-cp312-manylinux_2_28_{arch}.whl", (3, 11))
    assert wheel_fits(f"kiwi-1.0-cp310-abi3-manylinux_2_17_{arch}.whl", (3, 12))  # the stable ABI of 3.10 on
    assert not wheel_fits(f"kiwi-1.0-cp313-abi3-manylinux_2_17_{arch}.whl", (3, 12))
    assert not wheel_fits("pillow-11.0.0-cp312-cp312-manylinux_2_28_not_this_machine.whl", (3, 12))


def test_a_bundle_for_another_python_installs_what_fits_and_goes_on(tmp_path: Path, model_files: Path,
                                                                    monkeypatch: pytest.MonkeyPatch,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(device_bundle, "download_wheels", fake_download())
    bundle = tmp_path / "device"
    prepare(bundle, model_files, repo=tmp_path)
    monkeypatch.setattr(device_bundle, "wheel_fits", lambda name, version=(0, 0): False)
    assert install(bundle, tmp_path / "site") == []
    assert "skipped 1 wheels made for another python" in capsys.readouterr().out


def test_the_device_command_stops_before_any_python_without_a_bundle(tmp_path: Path) -> None:
    root = Path(device_bundle.__file__).parents[2]
    run = subprocess.run(["bash", "tools/device-check.sh"], capture_output=True, text=True, cwd=root,
                         env={"PATH": "/usr/bin:/bin", "DEVICE_BUNDLE": str(tmp_path / "none"),
                              "PYTHON": str(tmp_path / "no-python-here")})
    assert run.returncode == 2
    assert "make device-bundle" in run.stderr and "no-python-here" not in run.stderr
