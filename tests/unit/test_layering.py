"""Dependencies go one way (docs/architecture.md, "Layers"): serving -> engine -> core | worker -> models -> layers ->
kernels, with the plain data and settings every layer shares at the bottom. Every import is counted, those under
TYPE_CHECKING and inside functions too. No test module imports another."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Top to bottom. A backend module belongs to the first layer with a prefix of its name (relative to
# tritium.backend); it may import modules of its own layer and of the layers after it.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("serving", ("serving", "testing")),
    ("engine", ("__init__", "engine", "llm", "output_processor", "detokenizer")),
    ("worker", ("worker",)),
    ("spec", ("spec",)),
    ("sample", ("sample",)),
    ("structured_output", ("structured_output.compiler", "structured_output.decoding")),
    ("core", ("core",)),
    ("models", ("models",)),
    ("layers", ("layers", "lora")),
    ("common", ("config", "model_config", "config_readers", "family_configs", "sampling_params", "outputs",
                "tokenizer", "structured_output.constraint")),
)
# Core and the worker side are siblings under the engine: the worker side sees only the state the engine hands
# it (the sequences and the scheduled batch), never the scheduler, block manager or queues.
WORKER_SIDE = ("worker", "spec", "sample", "structured_output")
CORE_STATE = ("core.sequence", "core.batch")


def backend_modules() -> dict[str, Path]:
    """Every backend module by its name relative to tritium.backend (empty package files aside)."""
    out = {}
    for path in (ROOT / "backend").rglob("*.py"):
        parts = path.relative_to(ROOT / "backend").with_suffix("").parts
        if len(parts) > 1 and parts[-1] == "__init__" and not imports(path):
            continue
        out[".".join(parts[:-1] if parts[-1] == "__init__" and len(parts) > 1 else parts)] = path
    return out


def imports(path: Path) -> set[str]:
    """The tritium modules `path` imports, at any place in it."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("tritium"):
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("tritium"))
    return found


def layer_of(module: str) -> int:
    for i, (_, prefixes) in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return i
    raise AssertionError(f"tritium.backend.{module} belongs to no layer: add it to LAYERS")


def test_every_backend_import_points_down() -> None:
    modules = backend_modules()
    names = {name: layer_of(name) for name in modules}
    wrong: set[str] = set()
    for name, path in modules.items():
        mine = names[name]
        for target in imports(path):
            if target.startswith("tritium.client"):
                wrong.add(f"{name} -> {target} (the backend never imports the client)")
            if not target.startswith("tritium.backend."):
                continue
            other = target.removeprefix("tritium.backend.")
            while other not in names and "." in other:  # `from package import name`: the module is the package
                other = other.rsplit(".", 1)[0]
            if other not in names:
                continue
            theirs = names[other]
            if theirs < mine:
                wrong.add(f"{name} ({LAYERS[mine][0]}) -> {other} ({LAYERS[theirs][0]})")
            elif LAYERS[mine][0] in WORKER_SIDE and LAYERS[theirs][0] == "core" and other not in CORE_STATE:
                wrong.add(f"{name} ({LAYERS[mine][0]}) -> {other} (core: only {', '.join(CORE_STATE)})")
    assert not wrong, "imports against the layers:\n" + "\n".join(sorted(wrong))


def test_kernels_import_nothing_of_the_backend_or_client() -> None:
    wrong = [f"{path.relative_to(ROOT)} -> {target}" for path in (ROOT / "kernels").rglob("*.py")
             for target in imports(path) if not target.startswith("tritium.kernels")]
    assert not wrong, "\n".join(wrong)


def test_nothing_outside_the_engine_reaches_into_the_worker() -> None:
    """Serving code and the client see the worker through `LLMEngine.worker_info` only."""
    reach = re.compile(r"\.worker\.(?!info\b)\w+")
    files = [*(ROOT / "backend" / "serving").rglob("*.py"), *(ROOT / "client").rglob("*.py")]
    wrong = [f"{path.relative_to(ROOT)}:{i}: {line.strip()}" for path in files
             for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1) if reach.search(line)]
    assert not wrong, "\n".join(wrong)


def test_no_test_module_imports_another() -> None:
    test_modules = {p.stem for p in (ROOT / "tests").rglob("test_*.py")}
    wrong = []
    for path in (ROOT / "tests").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else \
                [a.name for a in node.names] if isinstance(node, ast.Import) else []
            wrong += [f"{path.relative_to(ROOT)} imports {n}" for n in names if n.split(".")[-1] in test_modules]
    assert not wrong, "\n".join(wrong)
