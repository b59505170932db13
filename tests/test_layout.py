"""The layout's rules, checked on the source, each with a companion test that plants the violation: the
layers import only the layers below them, functions stay short, nothing probes a drafter, no file reads the
shared folder beside the checkout, and docs/architecture.md names every module."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUNTIME = sorted((ROOT / "treespec" / "core").glob("*.py")) + sorted(
    (ROOT / "treespec" / "drafters").glob("*.py")
)
LAYERED = RUNTIME + sorted((ROOT / "treespec" / "training").glob("*.py"))  # the packages `LAYERS` rules
PACKAGE = sorted((ROOT / "treespec").rglob("*.py"))  # runtime, training, tools and the top level


LAYERS = {  # package -> the parts of treespec it must not import (directly or inside a function)
    "core": ("drafters", "training", "tools", "recipes", "api"),
    "drafters": ("training", "tools", "recipes", "api"),
    "training": ("tools", "recipes", "api"),
}


def _module_name(path: Path, root: Path = ROOT) -> str:
    return ".".join(path.relative_to(root).with_suffix("").parts)


def _imported(source: str, module: str) -> list[tuple[int, str]]:
    """(line, absolute name) of every import in `source`, the text of dotted `module`: `import a.b` gives
    a.b; `from X import n` gives X.n (n may be a module), relative forms resolved against `module`."""
    package = module.split(".")[:-1]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            origin = ".".join(base + ([node.module] if node.module else []))
            found += [(node.lineno, f"{origin}.{alias.name}") for alias in node.names]
    return found


def layer_violations(source: str, module: str) -> list[str]:
    """Imports in `source` (the text of `module`, e.g. treespec.core.generate) that its layer forbids."""
    parts = module.split(".")
    banned = LAYERS.get(parts[1], ()) if len(parts) > 2 else ()
    return [
        f"{module}:{line} imports {name}"
        for line, name in _imported(source, module)
        if name.split(".")[0] == "treespec" and len(name.split(".")) > 1 and name.split(".")[1] in banned
    ]


@pytest.mark.parametrize("path", LAYERED, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_each_layer_imports_only_the_layers_below_it(path):
    """core imports nothing from drafters, training, tools or the API above; drafters nothing from
    training or tools; training nothing from tools."""
    assert not layer_violations(path.read_text(), _module_name(path))


def test_the_layer_check_catches_every_form_of_a_forbidden_import():
    planted = """
from ..tools.models import default_heads_folder
from .. import training
import treespec.tools.cli

def later():
    from ...treespec.tools import bench  # a lazy import counts too
"""
    found = layer_violations(planted, "treespec.core.planted")
    assert [v.split(" imports ")[1] for v in found][:3] == [
        "treespec.tools.models.default_heads_folder",
        "treespec.training",
        "treespec.tools.cli",
    ]
    assert len(found) == 4
    allowed = "from .drafting import Drafter\nfrom .tree import Tree\nimport torch\n"
    assert not layer_violations(allowed, "treespec.core.planted")
    assert not layer_violations(planted, "treespec.tools.planted")  # tools may import anything
    assert layer_violations("from ..drafters.heads import MedusaHeads\n", "treespec.core.planted")
    assert layer_violations("from .. import recipes\n", "treespec.drafters.planted")
    assert not layer_violations("from ..drafters.heads import MedusaHeads\n", "treespec.training.planted")


def _long_functions(source: str, limit: int = 80) -> list[tuple[str, int]]:
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lines = node.end_lineno - node.lineno + 1
            if lines > limit:
                found.append((node.name, lines))
    return found


@pytest.mark.parametrize("path", PACKAGE, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_functions_are_at_most_80_lines(path):
    long = _long_functions(path.read_text())
    assert not long, f"{path.name}: {long}"


def test_the_length_check_catches_a_long_method():
    body = "".join(f"        x{i} = {i}\n" for i in range(80))
    planted = f"class A:\n    def long(self):\n{body}\n    def short(self):\n        return 1\n"
    assert _long_functions(planted) == [("long", 81)]


def _generate_shape(source: str) -> tuple[int, int]:
    """(lines, parameters) of the module-level `generate` in `source`, every parameter counted."""
    module = ast.parse(source)
    (node,) = [n for n in module.body if isinstance(n, ast.FunctionDef) and n.name == "generate"]
    args = node.args
    count = len(args.posonlyargs) + len(args.args) + len(args.kwonlyargs)
    count += (args.vararg is not None) + (args.kwarg is not None)
    return node.end_lineno - node.lineno + 1, count


def test_the_public_generate_is_one_function_of_at_most_60_lines_and_12_parameters():
    """The module-level `generate` itself (not a wrapper of the same name), every parameter counted."""
    import treespec

    source = (ROOT / "treespec" / "api.py").read_text()
    lines, count = _generate_shape(source)
    assert lines <= 60 and count <= 12
    (node,) = [n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name == "generate"]
    real = inspect.unwrap(treespec.generate)  # under torch.inference_mode's wrapper
    assert real.__code__.co_filename.endswith("api.py")
    first = min(n.lineno for n in [node, *node.decorator_list])  # code objects start at the decorators
    assert real.__code__.co_firstlineno == first


def test_the_generate_shape_counts_every_kind_of_parameter():
    planted = "def generate(a, b, /, c, d=1, *rest, e, f=2, **more):\n    return a\n"
    assert _generate_shape(planted) == (2, 8)


def _drafter_members() -> set[str]:
    """Every name of the drafter protocol and every public member a shipped drafter class defines."""
    import treespec
    from treespec.core.drafting import BaseDrafter, Drafter

    members = {n for n in dir(Drafter) if not n.startswith("_")} | set(Drafter.__annotations__)
    for name in treespec.__all__:
        cls = getattr(treespec, name)
        if inspect.isclass(cls) and issubclass(cls, BaseDrafter):
            members |= {n for n in vars(cls) if not n.startswith("_")}
    return members


def drafter_probes(source: str, members: set[str]) -> list[int]:
    """Lines of `source` that probe an object for a drafter's part: getattr / hasattr of a drafter member's
    name (whatever the object is called), or of anything on an object whose text says drafter."""
    return [
        n.lineno
        for n in ast.walk(ast.parse(source))
        if isinstance(n, ast.Call)
        and isinstance(n.func, ast.Name)
        and n.func.id in ("getattr", "hasattr")
        and n.args
        and (
            "drafter" in ast.unparse(n.args[0]).lower()
            or (len(n.args) > 1 and isinstance(n.args[1], ast.Constant) and n.args[1].value in members)
        )
    ]


def test_no_getattr_or_hasattr_on_drafters():
    """The drafter protocol is the only contract: nothing probes a drafter for optional parts."""
    members = _drafter_members()
    offenders = [
        f"{p.relative_to(ROOT)}:{line}" for p in PACKAGE for line in drafter_probes(p.read_text(), members)
    ]
    assert not offenders


def test_the_probe_check_catches_probes_whatever_the_object_is_called():
    members = _drafter_members()
    assert {"propose", "target_topk", "finish", "feature_layers"} <= members
    planted = """
def wrap(inner, source, d):
    if hasattr(inner, "target_topk"):
        pass
    finish = getattr(source, "finish", None)
    layers = getattr(self.drafters[0], "feature_layers", ())
    if hasattr(d.drafter, "anything"):
        pass
    return getattr(config, "hidden_size", 0)  # not a drafter's part
"""
    assert drafter_probes(planted, members) == [3, 5, 6, 7]


def reads_shared(text: str) -> bool:
    """Whether `text` reads the shared folder beside the checkout (a path or a joined Path)."""
    needle = "/".join(["..", "shared"])  # spelled in two parts so this file does not match itself
    return needle in text or " / ".join(['"shared"', '"data"']) in text


def test_nothing_reads_the_sibling_shared_folder():
    files = [p for d in ("treespec", "scripts", "tests") for p in (ROOT / d).rglob("*.py")]
    files += [ROOT / "Makefile", ROOT / ".ci" / "run", ROOT / "pyproject.toml"]
    assert not [str(p.relative_to(ROOT)) for p in files if reads_shared(p.read_text())]


def test_the_shared_folder_check_catches_both_spellings():
    assert reads_shared("open('" + "/".join(["..", "shared", "x.json"]) + "')")
    assert reads_shared("ROOT.parent / " + " / ".join(['"shared"', '"data"']) + " / 'q.jsonl'")
    assert not reads_shared("default_data_file('questions.jsonl')")


def _documented_modules(text: str) -> set[str]:
    """Modules docs/architecture.md names: its `pkg/` table rows and the layout's top-level files."""
    named = set()
    for line in text.splitlines():
        for package in ("core", "drafters", "training", "tools"):
            if line.startswith(f"| `{package}/` |"):
                cell = line.split("|")[2]
                while "(" in cell:  # what a module holds is said in brackets: drop it
                    cell = re.sub(r"\([^()]*\)", "", cell)
                named |= {f"{package}/{m}" for m in re.findall(r"`(\w+)`", cell)}
        match = re.match(r"^  (\w+)\.py\s", line)
        if match and match.group(1) != "__init__":
            named.add(match.group(1))
    return named


def _package_modules(root: Path) -> set[str]:
    modules = {p.stem for p in (root / "treespec").glob("*.py")} - {"__init__"}
    for package in ("core", "drafters", "training", "tools"):
        modules |= {f"{package}/{p.stem}" for p in (root / "treespec" / package).glob("*.py")} - {
            f"{package}/__init__"
        }
    return modules


def test_the_architecture_page_lists_every_module():
    documented = _documented_modules((ROOT / "docs" / "architecture.md").read_text())
    modules = _package_modules(ROOT)
    assert not modules - documented, f"docs/architecture.md does not name {sorted(modules - documented)}"
    assert not documented - modules, (
        f"docs/architecture.md names modules that are gone: {sorted(documented - modules)}"
    )


def test_the_architecture_check_sees_a_module_the_page_misses(tmp_path):
    (tmp_path / "treespec" / "core").mkdir(parents=True)
    (tmp_path / "treespec" / "core" / "planted.py").write_text("")
    (tmp_path / "treespec" / "io.py").write_text("")
    page = "| `core/` | `decoder` (the loop) |\n  io.py         atomic writes\n"
    assert _package_modules(tmp_path) - _documented_modules(page) == {"core/planted"}
