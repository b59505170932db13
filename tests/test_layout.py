"""The layout's rules, checked on the source: the runtime (core, drafters) never imports training or tools,
stays in short functions, and no project file reads the shared folder beside the checkout."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUNTIME = sorted((ROOT / "treespec" / "core").glob("*.py")) + sorted(
    (ROOT / "treespec" / "drafters").glob("*.py")
)
PACKAGE = sorted((ROOT / "treespec").rglob("*.py"))  # runtime, training, tools and the top level


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


@pytest.mark.parametrize("path", PACKAGE, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_functions_are_at_most_80_lines(path):
    long = [(name, n) for name, n in _functions(path) if n > 80]
    assert not long, f"{path.name}: {long}"


def test_the_public_generate_is_one_function_of_at_most_60_lines_and_12_parameters():
    """The module-level `generate` itself (not a wrapper of the same name), every parameter counted."""
    import treespec

    module = ast.parse((ROOT / "treespec" / "core" / "generate.py").read_text())
    (node,) = [n for n in module.body if isinstance(n, ast.FunctionDef) and n.name == "generate"]
    args = node.args
    count = len(args.posonlyargs) + len(args.args) + len(args.kwonlyargs)
    count += (args.vararg is not None) + (args.kwarg is not None)
    assert node.end_lineno - node.lineno + 1 <= 60 and count <= 12
    real = inspect.unwrap(treespec.generate)  # under torch.inference_mode's wrapper
    assert real.__code__.co_filename.endswith("generate.py")
    first = min(n.lineno for n in [node, *node.decorator_list])  # code objects start at the decorators
    assert real.__code__.co_firstlineno == first


def test_no_getattr_or_hasattr_on_drafters():
    """The drafter protocol is the only contract: nothing probes a drafter for optional parts."""
    offenders = [
        f"{p.relative_to(ROOT)}:{n.lineno}"
        for p in PACKAGE
        for n in ast.walk(ast.parse(p.read_text()))
        if isinstance(n, ast.Call)
        and isinstance(n.func, ast.Name)
        and n.func.id in ("getattr", "hasattr")
        and "drafter" in ast.unparse(n.args[0]).lower()
    ]
    assert not offenders


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
