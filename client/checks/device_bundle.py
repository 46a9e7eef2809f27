"""The folder a lent GPU machine gets with the working tree (`make device-bundle`, then `bash
tools/device-check.sh` there): the wheels gpu-check needs that the machine's image may lack, and the default
model's config and tokenizer files, from which gpu-check builds random-weights checkpoints on the device.

    python -m tritium.client.checks.device_bundle prepare [--dest build/device] [--python-version 3.12]
    python3 client/checks/device_bundle.py install [--bundle build/device] [--target build/device-run/site]

`prepare` runs here (it needs PyPI and the default model) and writes `DEST/wheels/`, `DEST/model/` and
`DEST/manifest.json`; it fails when the folder and the working tree together exceed the 64 MiB a device call
carries. `install` runs on the device with nothing but the standard library: it installs the bundle's wheels
whose distribution is not installed already (pip --no-index --no-deps --target, or unzipping them when the
image has no pip). The image has torch, triton, numpy, transformers, tokenizers, safetensors and their
dependencies; llguidance and gguf are not needed by gpu-check.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import shutil
import subprocess
import sys
import zipfile
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

CARRY_LIMIT_BYTES = 64 << 20
DEFAULT_DEST = "build/device"
DEFAULT_TARGET = "build/device-run/site"
TARGET_PYTHON = "3.12"
PLATFORMS = ("manylinux2014_x86_64", "manylinux_2_17_x86_64", "manylinux_2_28_x86_64")
# What gpu-check imports at run time beyond the image: matplotlib and its dependencies for the PNG; tqdm,
# jinja2 / markupsafe (chat templates) and packaging are in the image as torch's and transformers'
# dependencies, but small, so they come along in case (install skips what is there).
WHEELS = ("matplotlib", "contourpy", "cycler", "fonttools", "kiwisolver", "pillow", "pyparsing",
          "python-dateutil", "six", "packaging", "tqdm", "jinja2", "markupsafe")
MODEL_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "special_tokens_map.json", "chat_template.jinja")


@dataclass
class BundleFile:
    """A file of the bundle: its path in the bundle, size and sha256."""

    path: str
    bytes: int
    sha256: str


@dataclass
class Wheel(BundleFile):
    """A carried wheel: its distribution name and version, as the wheel's file name says."""

    name: str = ""
    version: str = ""


@dataclass
class Manifest:
    """What `prepare` put into the bundle, for whom, and how big it is with the working tree."""

    created: str
    python_version: str
    platforms: list[str]
    wheels: list[Wheel] = field(default_factory=list)
    model_source: str = ""
    git_commit: str | None = None  # the working tree's HEAD when prepared ("+dirty" with local changes)
    model_files: list[BundleFile] = field(default_factory=list)
    bundle_bytes: int = 0
    tree_bytes: int = 0
    limit_bytes: int = CARRY_LIMIT_BYTES


class BundleTooLarge(RuntimeError):
    """The bundle and the working tree exceed what a device call carries."""


def pinned(names: tuple[str, ...]) -> list[str]:
    """`name==version` for each distribution installed here (the versions the tests ran with), else `name`."""
    specs = []
    for name in names:
        try:
            specs.append(f"{name}=={importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            specs.append(name)
    return specs


def download_wheels(dest: Path, specs: list[str], python_version: str) -> None:
    """`pip download` binary wheels of `specs` for CPython `python_version` on x86_64 Linux into `dest`, without
    their dependencies (WHEELS lists them). Raises CalledProcessError when pip fails."""
    abi = "cp" + python_version.replace(".", "")
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--only-binary=:all:", "--no-deps",
                    "--python-version", python_version, "--implementation", "cp", "--abi", abi, "--abi", "abi3",
                    "--abi", "none", *platforms, "--dest", str(dest), *specs], check=True)


def wheel_name(path: Path) -> tuple[str, str]:
    """The normalized distribution name and the version in a wheel's file name."""
    name, version = path.name.split("-")[:2]
    return normalize(name), version


def normalize(name: str) -> str:
    """A distribution name as wheel file names and PEP 503 compare it."""
    return name.lower().replace("-", "_").replace(".", "_")


def describe(path: Path, root: Path) -> BundleFile:
    """The file's path under `root`, its size and sha256."""
    return BundleFile(str(path.relative_to(root)), path.stat().st_size, hashlib.sha256(path.read_bytes()).hexdigest())


def folder_bytes(folder: Path) -> int:
    """The size of every file under `folder`."""
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file() and not p.is_symlink())


def tree_bytes(repo: Path) -> int:
    """The size of what a device call copies of the working tree: tracked files and untracked ones git does not
    ignore (0 outside a git checkout)."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=repo,
                             capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return 0
    files = (repo / name for name in out.decode().split("\0") if name)
    return sum(p.stat().st_size for p in files if p.is_file() and not p.is_symlink())


def head_commit(repo: Path) -> str | None:
    """HEAD's commit, with "+dirty" when tracked files changed; None outside a git checkout."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo,
                               capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def prepare(dest: Path, model_source: Path | None = None, python_version: str = TARGET_PYTHON,
            wheels: tuple[str, ...] = WHEELS, repo: Path | None = None,
            limit_bytes: int = CARRY_LIMIT_BYTES) -> Manifest:
    """Fill `dest` anew (wheels/, model/, manifest.json) from PyPI and the default model (or `model_source`),
    print its size and return its manifest. Raises BundleTooLarge when `dest` and the working tree of `repo`
    exceed `limit_bytes` (the folder is left for a look), CalledProcessError when pip download fails."""
    if model_source is None:
        from tritium.backend.models.registry import resolve_model

        model_source = resolve_model(None)
    shutil.rmtree(dest, ignore_errors=True)
    (dest / "wheels").mkdir(parents=True)
    (dest / "model").mkdir()
    download_wheels(dest / "wheels", pinned(wheels), python_version)
    for name in MODEL_FILES:
        if (model_source / name).is_file():
            shutil.copy(model_source / name, dest / "model" / name)
    manifest = Manifest(datetime.now(timezone.utc).isoformat(timespec="seconds"), python_version, list(PLATFORMS),
                        model_source=str(model_source), limit_bytes=limit_bytes)
    for path in sorted((dest / "wheels").glob("*.whl")):
        name, version = wheel_name(path)
        manifest.wheels.append(Wheel(**asdict(describe(path, dest)), name=name, version=version))
    manifest.model_files = [describe(p, dest) for p in sorted((dest / "model").iterdir())]
    manifest.tree_bytes = tree_bytes(repo or Path.cwd())
    manifest.git_commit = head_commit(repo or Path.cwd())
    manifest.bundle_bytes = folder_bytes(dest)
    (dest / "manifest.json").write_text(json.dumps(asdict(manifest), indent=2), encoding="utf-8")
    manifest.bundle_bytes = folder_bytes(dest)
    total = manifest.bundle_bytes + manifest.tree_bytes
    print(f"{dest}: {len(manifest.wheels)} wheels, {len(manifest.model_files)} model files, "
          f"{manifest.bundle_bytes / 2**20:.1f} MiB (+ working tree {manifest.tree_bytes / 2**20:.1f} MiB = "
          f"{total / 2**20:.1f} MiB of the {limit_bytes / 2**20:.0f} MiB a device call carries)")
    if total > limit_bytes:
        raise BundleTooLarge(f"{dest} and the working tree are {total / 2**20:.1f} MiB, over the "
                             f"{limit_bytes / 2**20:.0f} MiB a device call carries")
    return manifest


def read_manifest(bundle: Path) -> dict[str, object]:
    """The bundle's manifest.json as a dict. Raises FileNotFoundError (saying how to make one) without it."""
    path = bundle / "manifest.json"
    if not path.is_file():
        raise FileNotFoundError(f"no {path}: run `make device-bundle` before the device call, and carry {bundle}")
    data: dict[str, object] = json.loads(path.read_text(encoding="utf-8"))
    return data


def installed(name: str) -> bool:
    """Whether a distribution of that (normalized) name is installed for this python."""
    return any(normalize(d.metadata["Name"] or "") == name for d in importlib.metadata.distributions())


def wheel_fits(file_name: str, version: tuple[int, int] = sys.version_info[:2]) -> bool:
    """Whether a wheel's tags (its file name) fit CPython `version` on this machine's architecture: a pure wheel,
    or one built for that version or for the stable ABI of an earlier one."""
    import platform

    python_tag, abi_tag, platform_tag = file_name[: -len(".whl")].split("-")[-3:]
    if platform_tag != "any" and not platform_tag.endswith(platform.machine()):
        return False
    exact = f"cp{version[0]}{version[1]}"
    for tag in python_tag.split("."):
        if tag in ("py3", f"py{version[0]}{version[1]}") or (tag == exact and abi_tag in (exact, "none", "abi3")):
            return True
        if abi_tag == "abi3" and tag.startswith("cp3") and int(tag[3:] or 0) <= version[1]:
            return True
    return False


def _pip_install(wheels: list[Path], target: Path) -> bool:
    """pip (--no-index --no-deps) of `wheels` into `target`; whether it succeeded."""
    run = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--upgrade",
                          "--target", str(target), *map(str, wheels)], check=False)
    return run.returncode == 0


def install(bundle: Path, target: Path) -> list[str]:
    """Install into `target`, best effort, the bundle's wheels whose distribution is not installed already and
    whose tags fit this python (its version read here, not the one the bundle was made for); returns their file
    names. Uses pip (--no-index --no-deps) when this python has it, else unzips the wheels (enough for the pure and
    binary wheels carried: none has scripts or data to place). A wheel that does not fit or fails is reported and
    left out: gpu-check runs without it (no PNG without matplotlib)."""
    import importlib.util

    manifest = read_manifest(bundle)
    wheels = manifest["wheels"]
    assert isinstance(wheels, list)
    missing = [bundle / w["path"] for w in wheels if not installed(w["name"])]
    unfit = [p for p in missing if not wheel_fits(p.name)]
    if unfit:
        print(f"skipped {len(unfit)} wheels made for another python than {sys.version.split()[0]} (the bundle's "
              f"{manifest.get('python_version')}): {', '.join(p.name for p in unfit)}", flush=True)
    chosen = [p for p in missing if p not in unfit]
    target.mkdir(parents=True, exist_ok=True)
    pip = importlib.util.find_spec("pip") is not None
    done = chosen if chosen and pip and _pip_install(chosen, target) else []
    for wheel in [] if done else chosen:  # one at a time, when pip took them together badly or is absent
        try:
            if not pip or not _pip_install([wheel], target):
                with zipfile.ZipFile(wheel) as z:
                    z.extractall(target)
            done.append(wheel)
        except (OSError, zipfile.BadZipFile) as exc:
            print(f"warning: {wheel.name} did not install ({type(exc).__name__}); gpu-check goes on without it",
                  flush=True)
    have = [w["name"] for w in wheels if bundle / w["path"] not in missing]
    print(f"installed {len(done)} wheels into {target}"
          f"{': ' + ', '.join(p.name for p in done) if done else ''}; already there: "
          f"{', '.join(have) or 'none'}", flush=True)
    return [p.name for p in done]


def main(argv: list[str] | None = None) -> int:
    """`prepare` or `install` (see the module docstring); returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="here: fill the bundle (needs PyPI and the default model)")
    p.add_argument("--dest", default=DEFAULT_DEST)
    p.add_argument("--python-version", default=TARGET_PYTHON, help="the device image's python (wheel tags)")
    p.add_argument("--model-files", default=None, help="take config and tokenizer from this folder")
    i = sub.add_parser("install", help="on the device: install the wheels the image lacks")
    i.add_argument("--bundle", default=DEFAULT_DEST)
    i.add_argument("--target", default=DEFAULT_TARGET)
    args = parser.parse_args(argv)
    try:
        if args.command == "prepare":
            prepare(Path(args.dest), Path(args.model_files) if args.model_files else None, args.python_version)
        else:
            install(Path(args.bundle), Path(args.target))
    except (BundleTooLarge, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
