"""The layout's rules, checked on the source: the runtime (core, drafters) never imports training or tools,
stays in short functions, and no project file reads the shared folder beside the checkout."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUNTIME = sorted((ROOT / "treespec" / "core").glob("*.py")) + sorted(
    (ROOT / "treespec" / "drafters").glob("*.py")
)


def _functions(path: Path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node.name, node.end_lineno - node.lineno + 1


@pytest.mark.parametrize("path", RUNTIME, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_runtime_imports_neither_training_nor_tools(path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            module = "." * node.level + (node.module or "")
            assert not any(part in ("training", "tools") for part in module.split(".")), (path.name, module)


@pytest.mark.parametrize("path", RUNTIME, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_runtime_functions_are_at_most_80_lines(path):
    long = [(name, n) for name, n in _functions(path) if n > 80]
    assert not long, f"{path.name}: {long}"


def test_generate_is_at_most_60_lines():
    lengths = dict(_functions(ROOT / "treespec" / "core" / "generate.py"))
    assert lengths["generate"] <= 60


def test_nothing_reads_the_sibling_shared_folder():
    needle = "/".join(["..", "shared"])  # spelled in two parts so this file does not match itself
    files = [p for d in ("treespec", "scripts", "tests") for p in (ROOT / d).rglob("*.py")]
    files += [ROOT / "Makefile", ROOT / ".ci" / "run", ROOT / "pyproject.toml"]
    offenders = [
        str(p.relative_to(ROOT))
        for p in files
        if needle in p.read_text() or " / ".join(['"shared"', '"data"']) in p.read_text()
    ]
    assert not offenders
