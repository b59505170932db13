"""TargetRuntime: one owner per model for treespec's per-model state, with a lifetime and a memory report."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from conftest import hf_greedy, random_heads, tiny_model

import treespec
from treespec.core.packed import packed_linears, packing_supported
from treespec.core.runtime import TargetRuntime

ROOT = Path(__file__).resolve().parents[1]


def test_one_runtime_per_model_holds_the_state_and_close_gives_the_model_back():
    model = tiny_model("llama", dtype=torch.float32)
    other = tiny_model("llama", dtype=torch.float32, seed=1)
    heads = random_heads(model)
    before = model.config._attn_implementation
    runtime = TargetRuntime.of(model)
    assert TargetRuntime.of(model) is runtime and TargetRuntime.of(other) is not runtime
    prompts = [[3, 4, 5], [9, 8, 7, 6]]
    results = treespec.generate(
        model,
        prompts,
        heads,
        max_new_tokens=8,
        eos_token_id=[],
        options=treespec.DecodeOptions(linears="auto"),
    )
    assert [r.token_ids for r in results] == [hf_greedy(model, p, 8) for p in prompts]
    assert runtime.pricers and runtime.attention_users == 0  # a batch priced its steps here
    assert model.config._attn_implementation == before  # the mode is held only during a call
    if packing_supported(model):
        assert runtime.packing is not None and runtime.memory_bytes()["packed_linears"] > 0
    assert TargetRuntime.of(other).pricers == {}  # another model keeps its own
    with treespec.tree_attention_enabled(model), pytest.raises(RuntimeError, match="is decoding"):
        runtime.close()
    runtime.close()
    assert runtime.closed and not runtime.pricers and runtime.packing is None
    assert "forward" not in vars(model.lm_head)  # the linears run stock
    fresh = TargetRuntime.of(model)
    assert fresh is not runtime and fresh.memory_bytes()["total"] == 0
    with fresh:
        again = treespec.generate(model, prompts[0], heads, max_new_tokens=8, eos_token_id=[])
    assert again.token_ids == results[0].token_ids and fresh.closed


def test_heads_keep_their_output_matrix_in_their_own_runtime():
    model = tiny_model("llama", dtype=torch.float32)
    heads = random_heads(model)
    a = treespec.make_drafter(heads, treespec.default_tree(8, 4), model)
    b = treespec.make_drafter(heads, treespec.default_tree(16, 4), model)
    assert a.output is b.output  # built once per heads and output layer
    assert TargetRuntime.of(heads).memory_bytes()["output_matrices"] > 0
    TargetRuntime.of(heads).close()
    c = treespec.make_drafter(heads, treespec.default_tree(8, 4), model)
    assert c.output is not a.output


def test_packing_is_counted_in_the_runtime():
    model = tiny_model("llama", dtype=torch.float32)
    if not packing_supported(model):
        pytest.skip("oneDNN packing is not available here")
    with packed_linears(model, mode="onednn"), packed_linears(model, mode="onednn"):
        assert TargetRuntime.of(model).packing.users == 2
        with pytest.raises(RuntimeError, match="in use in mode"):
            with packed_linears(model, mode="auto"):
                pass
    assert TargetRuntime.of(model).packing.users == 0


CONTAINERS = {  # calls that make a container a module could fill as it runs
    "dict", "list", "set", "defaultdict", "OrderedDict", "Counter", "deque",
    "WeakKeyDictionary", "WeakValueDictionary", "WeakSet",
}  # fmt: skip
MUTATORS = {"append", "extend", "insert", "update", "setdefault", "pop", "popitem", "clear", "add", "discard"}
PLAIN_TYPES = {"int", "str", "bool", "float"}


def _container(value: ast.expr) -> bool:
    if isinstance(value, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)):
        return True
    if isinstance(value, ast.Call):
        func = value.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        return name in CONTAINERS
    return False


def _subscripted(target: ast.expr) -> str | None:
    """NAME of a `NAME[...]` target."""
    if isinstance(target, ast.Subscript) and isinstance(target.value, ast.Name):
        return target.value.id
    return None


def process_state(source: str) -> list[str]:
    """Where a module's source keeps state for the whole process: a module-level container under a
    lower-case name (a constant table is UPPER_CASE), a module-level container that any code fills or
    empties, a `global` statement, or a cache decorator on a function that takes more than plain values
    (a model, a module, a drafter: a cache keyed on objects)."""
    tree = ast.parse(source)
    found, containers = [], set()
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        if (
            isinstance(node, (ast.Assign, ast.AnnAssign))
            and node.value is not None
            and _container(node.value)
        ):
            for target in [t for t in targets if isinstance(t, ast.Name)]:
                if target.id.startswith("__"):  # __all__: the module's export list
                    continue
                containers.add(target.id)
                if not target.id.isupper():
                    found.append(f"{node.lineno}: module-level container {target.id}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Global):
            found.append(f"{node.lineno}: global {', '.join(node.names)}")
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.Delete)):
            targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
            found += [f"{node.lineno}: writes {n}" for n in map(_subscripted, targets) if n in containers]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = node.func.value
            if isinstance(owner, ast.Name) and owner.id in containers and node.func.attr in MUTATORS:
                found.append(f"{node.lineno}: {owner.id}.{node.func.attr}")
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            cached = any("cache" in ast.unparse(d) for d in node.decorator_list)
            params = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
            plain = all(a.annotation is not None and ast.unparse(a.annotation) in PLAIN_TYPES for a in params)
            if cached and not plain:
                found.append(f"{node.lineno}: cache on {node.name}, which takes more than plain values")
    return found


def test_no_module_keeps_process_wide_state_keyed_on_models():
    """The runtime is the owner: nothing in core or drafters keeps state for the whole process."""
    offenders = []
    for path in sorted((ROOT / "treespec" / "core").glob("*.py")) + sorted(
        (ROOT / "treespec" / "drafters").glob("*.py")
    ):
        offenders += [f"{path.name}:{where}" for where in process_state(path.read_text())]
    assert not offenders


def test_the_state_check_catches_each_way_of_keeping_process_state():
    planted = """
import functools, weakref
from collections import defaultdict

_packs = weakref.WeakKeyDictionary()
SEEN = {}
TABLE = {"a": 1}
_count = 0

def remember(model):
    SEEN[model] = 1
    global _count
    _count += 1

@functools.lru_cache(maxsize=8)
def pack(model, mode: str):
    return model

@functools.cache
def default(size: int, heads: int = 4):
    return TABLE["a"]
"""
    found = process_state(planted)
    assert sorted(int(line.split(":")[0]) for line in found) == [5, 11, 12, 16], found
    assert not process_state(
        "__all__ = ['read']\nTABLE = {'a': 1}\n\ndef read(key: str):\n    return TABLE[key]\n"
    )


def test_a_model_made_under_inference_mode_decodes_with_heads():
    """Its weights are inference tensors (no version counter): the packed copies still key on them."""
    with torch.inference_mode():
        model = tiny_model("llama", dtype=torch.float32)
        heads = random_heads(model)
        result = treespec.generate(model, [1, 5, 9, 2], heads, max_new_tokens=12, eos_token_id=[])
    assert result.token_ids == hf_greedy(model, [1, 5, 9, 2], 12)


def test_switching_linear_modes_keeps_each_packing():
    """bitwise and fast decoding alternating on one model re-use their packings (no rebuild per call)."""
    model = tiny_model("llama", dtype=torch.float32)
    runtime = TargetRuntime.of(model)
    with packed_linears(model, mode="onednn"):
        first = runtime.packing
    with packed_linears(model, mode="exact"):
        assert runtime.packing is not first and runtime.packing.mode == "exact"
    with packed_linears(model, mode="onednn"):
        assert runtime.packing is first
    assert runtime.memory_bytes()["packed_linears"] >= first.memory_bytes()
    runtime.close()
    assert not runtime.other_packings
