"""The cost curve of this machine: what one verification forward costs, by node count and prefix length.

    verify_ms[path][prefix][n] = median ms of `Decoder.score` over n tree nodes after `prefix` committed
                                 tokens (the forward, the tree attention and the logits of every node)

for the eager path (transformers' modules as they are), oneDNN prepacked linears, exact block weights
(`core.packed`; "blocks" is the decoder's default "auto", which falls back to oneDNN for weights without
blocks), the same compiled with torch.compile ("compiled", `core.compiled`) and the row-invariant kernels
of bitwise numerics ("exact": exact attention and linears). It is written as JSON (`save_cost_curve`;
default `$TREESPEC_CACHE/costs/<model>-<dtype>-r<KERNELS_REVISION>.json`) for people and later tools
(`load_cost_curve`, `interpolate`). The heads' static tree (`machine_tree`, `--tree machine`) is chosen by
timing whole steps through `Decoder.step` instead (`training.calibrate`) and kept beside the curves.

Dynamic trees (`verify_cost_model`) need the curve of the path they run: on first use, when the cache
folder has none, `ensure_cost_curve` measures a quick one (`QUICK_NODES` x `QUICK_PREFIXES`, the shape
`interpolate` needs) and keeps it in `default_cost_file`; `scripts/cost_curve.py` measures a fuller
one. A file that exists but cannot be read is refused, never overwritten.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from ..core.attention import auto_kernel
from ..core.decoder import Decoder, synchronized_clock
from ..core.drafting import BaseDrafter
from ..core.native import unsupported_reason as native_unsupported
from ..core.packed import BLOCK_ROWS_MAX
from ..core.tree import Tree
from ..io import DEFAULT_MODEL_NAME, atomic_write_json, cache_root
from . import calibrate

# bumped whenever a kernel or the choice between kernels changes what a verification costs (2: one bf16
# row through `exact_linear` on CPUs without AMX), so cached curves of older kernels are measured again
# 3: the native step (`core.native`) verifies Llama-family models
# 4: AVX2 block linears decode the weights once for 3+ rows (a tree's verification costs about half)
# 5: AVX2 Q4_1 blocks widened from memory, one weight row at a time (a one-token step costs about 2/3)
# 6: float32 weights of bf16 values read from bf16 copies; bf16 weights widened by one load + shift
# 7: row-invariant attention with AVX2 tiles (trees in bitwise / int8 numerics cost less); AVX2 int8 Q4_1
#    integer sums in 16 bits
# 8: AVX2 int8 linears stream each weight panel in one pass with software prefetch (int8 steps cheaper)
# 9: AVX2 int8 tiles keep their integer sums in registers (int8 trees of 4+ nodes cost less)
# 10: AVX2 int8 tiles of 2-4 rows a group of 16 weight rows at a time, Q8 in nibbles (int8 trees cost less)
# 11: AVX-512 VNNI int8 tiles of several rows ask for the weight stream 4 KB ahead (int8 trees cost less)
# 12: AVX-512 float Q4_1 blocks looked up in a per-block table, one-row tiles convert float16 scales 16 blocks
#     at a time (float32 steps and trees cost less)
KERNELS_REVISION = 12
NODES = (1, 4, 8, 16, 32, 64)
PREFIXES = (128, 512, 1024)
# name -> Decoder(linears=..., compile=...)
PATHS = {
    "eager": {"linears": "torch"},
    "onednn": {"linears": "onednn"},
    "blocks": {"linears": "auto", "step": "hf"},
    "native": {
        "linears": "auto",
        "step": "native",
    },  # one C++ call per verification (`core.native`; Llama-family models)
    "compiled": {"linears": "auto", "compile": True},
    "exact": {"numerics": "bitwise"},  # the row-invariant kernels (`Decoder(numerics="bitwise")`)
    "int8": {"numerics": "int8"},  # int8 activations in the native step (`Decoder(numerics="int8")`)
}
# the quick curve measured on first use (`ensure_cost_curve`): interpolation is linear between measured
# node counts and flat beyond the last, so the counts span the largest trees drafters use (a 32-node tree
# plus a lookup branch), bracket the block kernel's switch to a GEMM above BLOCK_ROWS_MAX rows, and double
# in between; two prefixes (the nearest measured one prices a step) separate short from chat-length
# contexts (longer ones, priced at 512, are measured by scripts/cost_curve.py).
QUICK_NODES = tuple(sorted({1, 4, 8, 16, BLOCK_ROWS_MAX, 32, 64}))
QUICK_PREFIXES = (128, 512)
QUICK_REPEATS = 3


def default_cost_file(model) -> Path:
    """`$TREESPEC_CACHE/costs/<model name>-<dtype>-r<KERNELS_REVISION>.json` (default cache
    `~/.cache/treespec`): a curve measured on older kernels is not read (a new one is measured)."""
    name = (getattr(model.config, "name_or_path", "") or "model").replace("/", "--")
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    return cache_root() / "costs" / f"{name}-{dtype}-r{KERNELS_REVISION}.json"


class _Shape(BaseDrafter):
    """A drafter that only declares a tree shape (`Decoder.score` verifies given tokens; nothing drafted)."""

    def __init__(self, tree: Tree):
        self.tree = tree

    def propose(self, hidden, roots, max_depth=None):
        raise RuntimeError("a cost-curve shape drafts nothing: use Decoder.score")


@torch.inference_mode()
def verify_ms(
    model,
    n: int,
    prefix: int,
    linears: str = "auto",
    repeats: int = 7,
    seed: int = 0,
    compile: bool = False,
    numerics: str = "fast",
    step: str = "auto",
    kernel: str = "auto",
) -> float:
    """Median ms of one verification of n nodes after `prefix` random committed tokens (the first call,
    which compiles when `compile`, is not counted; on CUDA each timing waits for the device).
    kernel: the decoder's attention kernel (`Decoder(kernel=...)`)."""
    gen = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    decoder = Decoder(
        model,
        _Shape(Tree.chain(n - 1)),  # its cost is any n-node tree's (attention differs only in the mask)
        acceptance="greedy",
        linears=linears,
        compile=compile,
        numerics=numerics,
        step=step,
        kernel=kernel,
    )
    clock = synchronized_clock(decoder.device)  # the decoder's own clock waits only when it prices steps
    prompt = torch.randint(0, vocab, (prefix,), generator=gen).tolist()
    decoder.prefill(prompt, max_new_tokens=n + 1)
    tokens = torch.randint(0, vocab, (1, n), generator=gen).to(decoder.device)  # [1, n]
    times = []
    for _ in range(repeats + 1):
        t0 = clock()
        decoder.score(tokens)
        times.append(clock() - t0)
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


def interpolate(rows: dict[str, dict[str, float]], prefix: int, n: int) -> float:
    """verify ms at n nodes from one path of a cost curve (`curve["verify_ms"][path]`: prefix -> nodes ->
    ms): the row of the measured prefix nearest to `prefix` (a tie goes to the shorter), linear between
    measured counts; below the first, the first; beyond the last, on the last segment's slope."""
    nearest = min(rows, key=lambda p: (abs(int(p) - prefix), int(p)))
    row = sorted((int(k), v) for k, v in rows[nearest].items())
    if n <= row[0][0]:
        return row[0][1]
    for (n0, v0), (n1, v1) in zip(row, row[1:], strict=False):
        if n <= n1:
            return v0 + (v1 - v0) * (n - n0) / (n1 - n0)
    if len(row) < 2:
        return row[-1][1]
    (n0, v0), (n1, v1) = row[-2:]  # beyond the measured counts (a batch's rows x nodes): the last slope
    return v1 + max(0.0, v1 - v0) * (n - n1) / (n1 - n0)


def verify_paths(model, compile: bool = False, numerics: str = "fast") -> list[str]:
    """The cost-curve paths that price the step `Decoder(model, compile=compile, numerics=numerics)` runs,
    best first (uncompiled: the native step (`core.native`) where it runs this model, else the others)."""
    if numerics in ("bitwise", "int8"):
        return ["exact" if numerics == "bitwise" else "int8"]
    if compile:
        return ["compiled"]
    param = next(model.parameters())
    native = native_unsupported(model, auto_kernel(param.device, param.dtype), "auto", False, False) is None
    return (["native"] if native else []) + ["blocks", "onednn", "eager"]


def measure_command(model, path: str) -> str:
    """The command that measures the full cost curve of `path` for this model and dtype."""
    name = getattr(model.config, "name_or_path", "") or ""
    where = "" if name in ("", DEFAULT_MODEL_NAME) else f" --model {name}"
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    return f"python scripts/cost_curve.py{where} --dtype {dtype} --paths {path}"


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def ensure_cost_curve(
    model,
    compile: bool = False,
    curve_file: str | os.PathLike | None = None,
    progress: Callable[[str], None] | None = _stderr,
    numerics: str = "fast",
) -> tuple[dict, str, Path]:
    """This machine's cost curve with a path that prices the step `Decoder(compile=compile,
    numerics=numerics)` runs (`verify_paths`): returns (curve, path, file).

    Without `curve_file` it is `default_cost_file(model)` (under `$TREESPEC_CACHE`); when that file is
    missing, or lacks every path that would do, a quick curve of the path is measured now (`quick_curve`;
    the compiled path compiles its three size classes, which the compiled step would do anyway) and kept
    there, beside the paths the file already had. `progress` (default: one line on stderr) says what is
    measured, where it goes and how to measure a fuller one. A `curve_file` given by the caller must exist
    and have the path; a file that exists but is not a cost curve is refused (`load_cost_curve`), never
    overwritten."""
    wanted = verify_paths(model, compile, numerics)
    file = Path(curve_file) if curve_file else default_cost_file(model)
    remeasure = f"{measure_command(model, wanted[0])} --out {file}"
    curve = load_cost_curve(file, remeasure) if file.is_file() else None
    if curve is not None:
        path = next((p for p in wanted if p in curve["verify_ms"]), None)
        if path is not None:
            return curve, path, file
    if curve_file:  # the caller's own file: theirs to measure
        if curve is None:
            raise ValueError(
                f"no cost curve at {file}: measure one with {remeasure}, or leave the file out to "
                "use this machine's (measured on first use)"
            )
        raise ValueError(
            f"{file} has no {wanted[0]!r} path (it has {sorted(curve['verify_ms'])}): {remeasure}"
        )
    path = wanted[0]
    nodes, prefixes = quick_points(model)
    if progress:
        why = "no cost curve" if curve is None else f"no {path!r} path in the cost curve"
        slow = " (compiling first: a few minutes)" if compile else ""
        progress(
            f"{why} for this model and dtype yet: measuring a quick one once{slow}, {path} verification at "
            f"{len(nodes)} node counts x prefixes {', '.join(map(str, prefixes))}, kept in {file} "
            f"(a fuller one: {measure_command(model, path)})"
        )
    t0 = time.perf_counter()
    measured = quick_curve(model, path, nodes, prefixes)
    measured["quick"] = {path: {"seconds": round(time.perf_counter() - t0, 1)}}
    if curve is not None:  # keep what the file had; add the path
        curve["verify_ms"][path] = measured["verify_ms"][path]
        curve["quick"] = {**curve.get("quick", {}), **measured["quick"]}
    else:
        curve = measured
    save_cost_curve(file, curve)
    return curve, path, file


def quick_points(model) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(node counts, prefixes) of the quick curve: `QUICK_NODES` x `QUICK_PREFIXES`, cut to what the
    model's positions (and sliding window) hold: a prefix, n + 1 new tokens and an n-node block."""
    config = model.config
    limits = [getattr(config, "max_position_embeddings", None)]
    if getattr(config, "use_sliding_window", True):
        limits.append(getattr(config, "sliding_window", None))
    limit = min((x for x in limits if x), default=1 << 30)
    nodes = tuple(n for n in QUICK_NODES if 2 * n + 2 <= limit) or (1,)
    room = max(1, limit - 2 * max(nodes) - 1)  # prefix + (n + 1 new tokens) + an n-node block
    return nodes, tuple(sorted({min(p, room) for p in QUICK_PREFIXES}))


def quick_curve(
    model, path: str, nodes: Sequence[int] = QUICK_NODES, prefixes: Sequence[int] = QUICK_PREFIXES
) -> dict:
    """`cost_curve` of one path at few points (`QUICK_REPEATS` timings each): what a dynamic tree needs.
    A point priced above one that costs at least as much (more nodes at its prefix, or its node count at
    a longer prefix: a burst of other work on the machine) is measured again, keeping the lower time."""
    curve = cost_curve(model, nodes, prefixes, paths=(path,), repeats=QUICK_REPEATS)
    rows = curve["verify_ms"][path]
    for _ in range(2):
        suspects = suspect_points(rows)
        for prefix, n in suspects:
            again = verify_ms(model, n, prefix, repeats=QUICK_REPEATS, **PATHS[path])
            rows[str(prefix)][str(n)] = min(rows[str(prefix)][str(n)], again)
        if not suspects:
            break
    return curve


def suspect_points(rows: dict[str, dict[str, float]], slack: float = 1.2) -> list[tuple[int, int]]:
    """(prefix, nodes) of the points of one path priced more than `slack` x a point that costs at least as
    much: more nodes at the same prefix, or the same nodes at a longer prefix."""
    table = {(int(p), int(n)): ms for p, row in rows.items() for n, ms in row.items()}
    return [
        (p, n)
        for (p, n), ms in sorted(table.items())
        if any(
            ms > slack * other for (q, m), other in table.items() if (q, m) != (p, n) and q >= p and m >= n
        )
    ]


def verify_cost_model(
    model,
    compile: bool = False,
    curve_file: str | os.PathLike | None = None,
    progress: Callable[[str], None] | None = _stderr,
    numerics: str = "fast",
) -> Callable[[int, int], float]:
    """(nodes, prefix) -> seconds of one verification on this machine, read from its cost curve: the
    row-invariant kernels' ("exact") under bitwise numerics, else the compiled path when `compile`, else
    the uncompiled step's ("blocks", else "onednn", else "eager").
    The curve is `curve_file`, else this machine's (`default_cost_file`), measured quickly on first use
    (`ensure_cost_curve`, which says so through `progress`)."""
    curve, path, _ = ensure_cost_curve(model, compile, curve_file, progress, numerics)
    rows = curve["verify_ms"][path]
    return lambda nodes, prefix: interpolate(rows, prefix, nodes) / 1e3


def save_cost_curve(path: str | os.PathLike, curve: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, curve, indent=1)


def load_cost_curve(path: str | os.PathLike, measure: str | None = None) -> dict:
    """Read a cost curve written by `save_cost_curve`; refuses anything else (not JSON, another format,
    rows that are not node count -> ms) with a message that names the file and how to measure it again
    (`measure`: the command; default `scripts/cost_curve.py --out <path>`)."""
    try:
        with open(path, encoding="utf-8") as f:
            curve = json.load(f)
        problem = _curve_problem(curve)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        problem = f"unreadable: {error}"
    if problem:
        raise ValueError(
            f"{path} is not a treespec cost curve ({problem}): measure it again with "
            f"{measure or f'python scripts/cost_curve.py --out {path}'}, or delete it (a missing curve "
            "in the cache folder is measured on first use)"
        )
    return curve


def _curve_problem(curve) -> str | None:
    """What is wrong with a parsed cost curve (None: nothing)."""
    if not isinstance(curve, dict) or curve.get("format") != "treespec.cost_curve":
        return "no 'format': 'treespec.cost_curve'"
    paths = curve.get("verify_ms")
    if not isinstance(paths, dict):
        return "no 'verify_ms' table"
    for path, rows in paths.items():
        if not isinstance(rows, dict) or not rows:
            return f"path {path!r} has no prefix rows"
        for prefix, row in rows.items():
            if not isinstance(row, dict) or not row:
                return f"path {path!r} prefix {prefix} has no node counts"
            try:
                int(prefix)
                bad = [n for n, ms in row.items() if int(n) < 1 or not isinstance(ms, (int, float))]
            except (TypeError, ValueError):
                bad = [prefix]
            if bad:
                return f"path {path!r} prefix {prefix}: bad entries {bad[:3]}"
    return None


def read_acceptance(heads_folder: str | os.PathLike) -> list[list[float]] | None:
    """acceptance[head][rank] from the heads folder's acceptance.json (`scripts/calibrate_tree.py`), or
    None when the folder has none."""
    table_file = Path(heads_folder) / "acceptance.json"
    if not table_file.is_file():
        return None
    return json.loads(table_file.read_text())["acceptance"]


def machine_tree_file(model, heads_folder: str | os.PathLike) -> Path:
    """Where `machine_tree` keeps its choice: next to the cost curves, per model, dtype, heads folder (and
    the content of its acceptance.json: retrained heads are priced again) and the uncompiled verification
    path the decoder runs ("native" or "blocks")."""
    path = verify_paths(model)[0]
    curve_file = default_cost_file(model)
    table_file = Path(heads_folder) / "acceptance.json"
    content = hashlib.sha256(table_file.read_bytes()).hexdigest()[:8] if table_file.is_file() else "none"
    return curve_file.with_name(f"{curve_file.stem}-{Path(heads_folder).name}-{content}-{path}-tree.json")


def machine_tree(
    model,
    heads,
    heads_folder: str | os.PathLike,
    budgets: Sequence[int] = (4, 8, 16, 32),
    repeats: int = 3,
    progress=None,
) -> tuple[Tree, str]:
    """The heads' best tree on this machine, chosen once over `budgets` and kept in `machine_tree_file`:
    one speculative step of each budget's tree timed through the uncompiled `Decoder.step`
    (`calibrate.forward_costs`; a compiled step would compile once per budget), the budget with the most
    expected tokens per second (`calibrate.choose_budget`). Heads without acceptance.json keep their own
    tree. Returns (tree, description)."""
    table = read_acceptance(heads_folder)
    if table is None:
        return heads.tree, "the heads' tree.json (no acceptance.json to price trees with)"
    saved = machine_tree_file(model, heads_folder)
    if saved.is_file():
        tree = Tree.load(saved, max_depth=heads.num_heads)
        return tree, f"priced on this machine ({tree.num_nodes} nodes; {saved}, delete it to re-measure)"
    if progress:
        progress(
            f"pricing trees of {', '.join(map(str, budgets))} nodes on this machine (once; timed steps) ..."
        )
    costs = calibrate.forward_costs(model, budgets, heads, prefix=300, repeats=repeats, table=table)
    best, _ = calibrate.choose_budget(table, costs)
    tree = Tree.from_acceptance(table, best)
    saved.parent.mkdir(parents=True, exist_ok=True)
    tree.save(saved)
    return tree, f"priced on this machine ({best} nodes with timed steps; kept in {saved})"
