"""Lines per part of the tree, and how many of backend/'s lines are docstrings and comments.

    python tools/line_counts.py [--json]

Parts: backend/ per package, kernels/, client/, tests/, README.md and each docs/ page.
"""

from __future__ import annotations

import ast
import io
import json
import sys
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def python_lines(path: Path) -> tuple[int, int, int]:
    """(lines, docstring lines, comment-only lines) of one Python file."""
    text = path.read_text(encoding="utf-8")
    doc = 0
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                doc += (first.end_lineno or first.lineno) - first.lineno + 1
    comments = {tok.start[0] for tok in tokenize.generate_tokens(io.StringIO(text).readline)
                if tok.type == tokenize.COMMENT and tok.line.strip().startswith("#")}
    return len(text.splitlines()), doc, len(comments)


def parts() -> dict[str, list[Path]]:
    """Each part's files."""
    out: dict[str, list[Path]] = {}
    for path in sorted((ROOT / "backend").rglob("*.py")):
        rel = path.relative_to(ROOT / "backend")
        key = f"backend/{rel.parts[0]}/" if len(rel.parts) > 1 else "backend/*.py"
        out.setdefault(key, []).append(path)
    for top in ("kernels", "client", "tests"):
        out[f"{top}/"] = sorted((ROOT / top).rglob("*.py"))
    return out


def main() -> None:
    report: dict[str, dict[str, int]] = {}
    total = {"lines": 0, "docstring": 0, "comment": 0}
    for name, files in parts().items():
        lines = doc = comments = 0
        for path in files:
            n, d, c = python_lines(path)
            lines, doc, comments = lines + n, doc + d, comments + c
        report[name] = {"files": len(files), "lines": lines, "docstring": doc, "comment": comments}
        if name.startswith("backend/"):
            total = {"lines": total["lines"] + lines, "docstring": total["docstring"] + doc,
                     "comment": total["comment"] + comments}
    report["backend (all)"] = {"files": sum(len(f) for n, f in parts().items() if n.startswith("backend/")), **total}
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    for page in pages:
        report[str(page.relative_to(ROOT))] = {"lines": len(page.read_text(encoding="utf-8").splitlines())}
    if "--json" in sys.argv:
        print(json.dumps(report, indent=1))
        return
    for name, row in report.items():
        extra = ""
        if "docstring" in row:
            share = 100 * row["docstring"] / max(row["lines"], 1)
            extra = f"  docstring {row['docstring']:5d} ({share:4.1f}%)  comment {row['comment']:5d}"
        print(f"{name:40s} {row['lines']:6d}{extra}")


if __name__ == "__main__":
    main()
