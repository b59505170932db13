"""The cost curve of this machine: what one verification forward costs, by node count and prefix length.

    verify_ms[path][prefix][n] = median ms of `Decoder.score` over n tree nodes after `prefix` committed
                                 tokens (the forward, the tree attention and the logits of every node)

for the eager path (transformers' modules as they are), oneDNN prepacked linears, exact block weights
(`core.packed`; "blocks" is the decoder's default "auto", which falls back to oneDNN for weights without
blocks) and the same compiled with torch.compile ("compiled", `core.compiled`), plus each row relative
to a one-token step (n = 1) of the same path and prefix. It is written as JSON (`save_cost_curve`;
default `$TREESPEC_CACHE/costs/<model>-<dtype>.json`) for people and later tools (`load_cost_curve`,
`interpolate`). The tree choice (`price_trees`, `machine_tree`) reads it: a step of a tree costs its
drafting (timed) plus the verification of its node count (from the curve); without a curve it times whole
steps through `Decoder.step`.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
from collections.abc import Sequence
from pathlib import Path

import torch

from ..core.decoder import Decoder
from ..core.tree import Tree
from ..drafters.base import BaseDrafter
from ..io import atomic_write_json, cache_root
from . import calibrate

NODES = (1, 4, 8, 16, 32, 64)
PREFIXES = (128, 512, 1024)
# name -> Decoder(linears=..., compile=...)
PATHS = {
    "eager": {"linears": "torch"},
    "onednn": {"linears": "onednn"},
    "blocks": {"linears": "auto"},
    "compiled": {"linears": "auto", "compile": True},
}


def default_cost_file(model) -> Path:
    """`$TREESPEC_CACHE/costs/<model name>-<dtype>.json` (default cache `~/.cache/treespec`)."""
    name = (getattr(model.config, "name_or_path", "") or "model").replace("/", "--")
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    return cache_root() / "costs" / f"{name}-{dtype}.json"


class _Shape(BaseDrafter):
    """A drafter that only declares a tree shape (`Decoder.score` verifies given tokens; nothing drafted)."""

    def __init__(self, tree: Tree):
        self.tree = tree

    def propose(self, hidden, roots, max_depth=None):
        raise RuntimeError("a cost-curve shape drafts nothing: use Decoder.score")


def _chain(n: int) -> Tree:
    """An n-node chain: its cost is the cost of any n-node tree (attention differs only in the mask)."""
    return Tree.from_choices([[0] * d for d in range(1, n)])


@torch.inference_mode()
def verify_ms(
    model, n: int, prefix: int, linears: str, repeats: int = 7, seed: int = 0, compile: bool = False
) -> float:
    """Median ms of one verification of n nodes after `prefix` random committed tokens (the first call,
    which compiles when `compile`, is not counted)."""
    gen = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    decoder = Decoder(model, _Shape(_chain(n)), acceptance="greedy", linears=linears, compile=compile)
    prompt = torch.randint(0, vocab, (prefix,), generator=gen).tolist()
    decoder.prefill(prompt, max_new_tokens=n + 1)
    tokens = torch.randint(0, vocab, (1, n), generator=gen).to(decoder.device)  # [1, n]
    times = []
    for _ in range(repeats + 1):
        t0 = decoder.clock()
        decoder.score(tokens)
        times.append(decoder.clock() - t0)
    return 1e3 * statistics.median(times[1:])  # the first call warms up


def cost_curve(
    model,
    nodes: Sequence[int] = NODES,
    prefixes: Sequence[int] = PREFIXES,
    paths: Sequence[str] = ("eager", "blocks", "compiled"),
    repeats: int = 7,
    progress=None,
) -> dict:
    """Measure verify_ms for every path x prefix x node count (interleaved by path at each point, so
    machine noise falls on both). progress: called with a label before each point."""
    unknown = [path for path in paths if path not in PATHS]
    if unknown:
        raise ValueError(f"unknown cost-curve paths {unknown}; choose from {list(PATHS)}")
    curve = {path: {str(p): {} for p in prefixes} for path in paths}
    for prefix in prefixes:
        for n in nodes:
            for path in paths:
                if progress:
                    progress(f"{path} n={n} prefix={prefix}")
                curve[path][str(prefix)][str(n)] = verify_ms(model, n, prefix, repeats=repeats, **PATHS[path])
    param = next(model.parameters())
    return {
        "format": "treespec.cost_curve",
        "version": 1,
        "model": getattr(model.config, "name_or_path", ""),
        "dtype": str(param.dtype).removeprefix("torch."),
        "device": str(param.device),
        "threads": torch.get_num_threads(),
        "machine": platform.processor() or platform.machine(),
        "repeats": repeats,
        "verify_ms": curve,
    }


def relative(curve: dict, path: str, prefix: int) -> dict[int, float]:
    """n -> verify_ms(n) / verify_ms(1) for one path and prefix."""
    row = {int(n): ms for n, ms in curve["verify_ms"][path][str(prefix)].items()}
    return {n: ms / row[1] for n, ms in sorted(row.items())} if 1 in row else {}


def interpolate(curve: dict, path: str, prefix: int, n: int) -> float:
    """verify ms at n nodes (linear between measured counts, clamped at the ends) for the measured
    prefix nearest to `prefix`."""
    return interpolate_rows(curve_rows(curve, path), prefix, n)


def curve_rows(curve: dict, path: str) -> dict[int, list[tuple[int, float]]]:
    """One path of a cost curve parsed once: measured prefix -> [(nodes, verify ms)] sorted by nodes."""
    return {
        int(p): sorted((int(k), v) for k, v in row.items()) for p, row in curve["verify_ms"][path].items()
    }


def interpolate_rows(rows: dict[int, list[tuple[int, float]]], prefix: int, n: int) -> float:
    """`interpolate` over a path parsed by `curve_rows` (parsed once, asked for every node count)."""
    row = nearest_row(rows, prefix)
    if n <= row[0][0]:
        return row[0][1]
    for (n0, v0), (n1, v1) in zip(row, row[1:], strict=False):
        if n <= n1:
            return v0 + (v1 - v0) * (n - n0) / (n1 - n0)
    return row[-1][1]


def nearest_row(rows: dict[int, list[tuple[int, float]]], prefix: int) -> list[tuple[int, float]]:
    """The measured row of the prefix nearest to `prefix` (a tie goes to the shorter prefix)."""
    return rows[min(rows, key=lambda p: (abs(p - prefix), p))]


def interpolate_monotone(curve: dict, path: str, prefix: int, n: int) -> float:
    """`interpolate`, never above the price of more nodes at the same prefix: a measured curve can price n
    nodes above n + 1 by noise, and verifying fewer nodes never costs more (the minimum of the
    interpolated value and every measured count above n)."""
    rows = curve_rows(curve, path)
    return min([interpolate_rows(rows, prefix, n)] + [v for k, v in nearest_row(rows, prefix) if k > n])


def verify_cost_model(model, compile: bool = False, curve_file: str | os.PathLike | None = None):
    """(nodes, prefix) -> seconds of one verification on this machine, read from its cost curve
    (`scripts/cost_curve.py`): the compiled path when `compile`, else the uncompiled step's ("blocks",
    else "onednn", else "eager"). Refuses, saying what to run, when the curve lacks the path."""
    path_file = Path(curve_file) if curve_file else default_cost_file(model)
    if not path_file.is_file():
        raise ValueError(
            f"no cost curve for this model and dtype at {path_file}: measure one with "
            f"python scripts/cost_curve.py --paths {'compiled' if compile else 'blocks'}"
        )
    curve = load_cost_curve(path_file)
    wanted = ["compiled"] if compile else ["blocks", "onednn", "eager"]
    path = next((p for p in wanted if p in curve["verify_ms"]), None)
    if path is None:
        raise ValueError(
            f"{path_file} has no {wanted[0]!r} path (it has {sorted(curve['verify_ms'])}): "
            f"python scripts/cost_curve.py --paths {wanted[0]}"
        )
    rows = curve_rows(curve, path)
    return lambda nodes, prefix: interpolate_rows(rows, prefix, nodes) / 1e3


def save_cost_curve(path: str | os.PathLike, curve: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, curve, indent=1)


def load_cost_curve(path: str | os.PathLike) -> dict:
    """Read a cost curve written by `save_cost_curve`; refuses other files with a clear message."""
    with open(path, encoding="utf-8") as f:
        curve = json.load(f)
    if curve.get("format") != "treespec.cost_curve" or "verify_ms" not in curve:
        raise ValueError(f"{path} is not a treespec cost curve (make one with scripts/cost_curve.py)")
    return curve


def read_acceptance(heads_folder: str | os.PathLike) -> list[list[float]] | None:
    """acceptance[head][rank] from the heads folder's acceptance.json (`scripts/calibrate_tree.py`), or
    None when the folder has none."""
    table_file = Path(heads_folder) / "acceptance.json"
    if not table_file.is_file():
        return None
    return json.loads(table_file.read_text())["acceptance"]


def price_trees(
    model,
    heads,
    table: Sequence[Sequence[float]],
    budgets: Sequence[int],
    repeats: int,
    curve: dict | None = None,
    path: str = "blocks",
) -> tuple[int, dict[int, dict[str, float]]]:
    """For each node budget the best tree for `table` and what one speculative step of it costs on this
    machine (prefix 300): drafting timed here plus the verification read from `curve` for `path` when
    given (`step_costs`), else whole steps timed through `Decoder.step` (`calibrate.forward_costs`).
    Returns (the budget with the most expected tokens per second, the numbers behind it)."""
    if curve is not None:
        costs = step_costs(model, heads, table, budgets, curve, path, repeats=repeats)
    else:
        costs = calibrate.forward_costs(model, budgets, heads, prefix=300, repeats=repeats, table=table)
    return calibrate.choose_budget(table, costs)


def step_costs(
    model, heads, table, budgets: Sequence[int], curve: dict, path: str, prefix: int = 300, repeats: int = 3
) -> dict[int, float]:
    """Seconds of one step per budget: the tree's drafting and commit, timed here through `Decoder.step`
    on the uncompiled path (the drafter runs the same on every path), plus the verification of its node
    count read from the cost curve of `path` (`interpolate_monotone`: no compile per budget)."""
    if path not in curve["verify_ms"]:
        raise ValueError(
            f"the cost curve has no {path!r} path; measure it: scripts/cost_curve.py --paths {path}"
        )
    costs = {}
    for n in budgets:
        tree = Tree.from_acceptance(table, n)
        decoder = calibrate.timing_decoder(model, heads, tree, prefix, steps=repeats + 1)
        with decoder.running():  # the model's mode held, as `generate` holds it for a whole call
            decoder.step()  # warm-up
            stats = decoder.stats
            before = (stats.time_draft, stats.time_commit, stats.steps)
            for _ in range(repeats):
                decoder.step()
        steps = stats.steps - before[2]
        around = (stats.time_draft - before[0] + stats.time_commit - before[1]) / steps
        costs[n] = around + interpolate_monotone(curve, path, prefix, tree.num_nodes) / 1e3
    return costs


def machine_tree_file(model, heads_folder: str | os.PathLike, path: str = "blocks") -> Path:
    """Where `machine_tree` keeps its choice: next to the cost curves, per model, dtype, heads folder and
    verification path ("blocks" or "compiled")."""
    curve_file = default_cost_file(model)
    return curve_file.with_name(f"{curve_file.stem}-{Path(heads_folder).name}-{path}-tree.json")


def machine_tree(
    model,
    heads,
    heads_folder: str | os.PathLike,
    budgets: Sequence[int] = (4, 8, 16, 32),
    repeats: int = 3,
    progress=None,
    compile: bool = False,
) -> tuple[Tree, str]:
    """The heads' best tree on this machine for the verification path generate will run (`compile`: the
    compiled step, else the uncompiled one), chosen once by `price_trees` over `budgets` and kept in
    `machine_tree_file`. It reads this machine's cost curve (`default_cost_file`, `scripts/cost_curve.py`)
    when that has the path, else times whole uncompiled steps (a compiled step would compile once per
    budget). Heads without acceptance.json keep their own tree. Returns (tree, description)."""
    table = read_acceptance(heads_folder)
    if table is None:
        return heads.tree, "the heads' tree.json (no acceptance.json to price trees with)"
    path = "compiled" if compile else "blocks"
    saved = machine_tree_file(model, heads_folder, path)
    if saved.is_file():
        tree = Tree.load(saved, max_depth=heads.num_heads)
        return tree, f"priced on this machine ({tree.num_nodes} nodes; {saved}, delete it to re-measure)"
    curve_file = default_cost_file(model)
    curve = load_cost_curve(curve_file) if curve_file.is_file() else None
    if curve is not None and path not in curve["verify_ms"]:
        curve = None
    how = f"the {path} cost curve in {curve_file}" if curve else "timed uncompiled steps"
    if compile and curve is None:
        how += (
            f" (for the compiled step's costs: scripts/cost_curve.py --paths compiled, then delete {saved})"
        )
    if progress:
        progress(f"pricing trees of {', '.join(map(str, budgets))} nodes on this machine (once; {how}) ...")
    best, _ = price_trees(model, heads, table, budgets, repeats, curve=curve, path=path)
    tree = Tree.from_acceptance(table, best)
    saved.parent.mkdir(parents=True, exist_ok=True)
    tree.save(saved)
    return tree, f"priced on this machine ({best} nodes with {how}; kept in {saved})"
