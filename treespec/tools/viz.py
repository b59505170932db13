"""Pictures of candidate trees: the static topology, one decoding step, and a whole run as HTML.

Every picture starts as a networkx graph whose nodes carry what is shown (``label``, ``kind``,
probabilities, ``accepted``); :func:`layered_layout` places it top-down, x by leaf order and y by
depth, and matplotlib (Agg, no pyplot state) draws it. The ``draw_*`` functions return the graph
they drew so callers and tests can inspect it. matplotlib is the optional ``viz`` extra
(``pip install treespec[viz]``): it is imported only when a picture is drawn, so the graphs, the
layout, ``visible`` and the HTML page work without it.

    draw_tree(tree, "tree.png", acceptance=None)     static tree, coloured by acceptance if known
    draw_step(trace, 0, "step.svg")                   one step: accepted path, rejected, bonus
    write_html(trace, "run.html")                     self-contained page stepping through a run
"""

from __future__ import annotations

import json
import unicodedata
import warnings
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING

import networkx as nx

from ..core.tree import Tree
from ..io import atomic_write, atomic_write_text
from .trace import Trace

if TYPE_CHECKING:
    from matplotlib.colors import Normalize

PICTURE_FORMATS = (".png", ".svg")
VISIBLE = {" ": "␣", "\n": "↵", "\t": "⇥"}

# Styles: (face, border, text colour, border style) per node kind of a step picture.
STEP_STYLE = {
    "root": ("#41ab5d", "#005a32", "white", "solid"),
    "accepted": ("#a1d99b", "#006d2c", "black", "solid"),
    "rejected": ("#f0f0f0", "#c8c8c8", "#9a9a9a", "solid"),
    "bonus": ("#ffe082", "#b8860b", "black", "dashed"),
}
EDGE_STYLE = {  # (colour, width, line style) per edge kind
    "accepted": ("#238b45", 2.6, "solid"),
    "rejected": ("#d0d0d0", 0.8, "solid"),
    "bonus": ("#b8860b", 2.0, "dashed"),
    "tree": ("#8c8c8c", 1.0, "solid"),
}
HEAD_COLOURS = ("#a6cee3", "#b2df8a", "#fdbf6f", "#cab2d6", "#fb9a99", "#ffff99", "#8dd3c7", "#bebada")
ROOT_COLOUR = "#d9d9d9"


def _mpl() -> SimpleNamespace:
    """matplotlib, imported when a picture is drawn (it is the optional ``viz`` extra): the graphs, the
    layout and the HTML page work without it."""
    try:
        from matplotlib import colormaps
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.cm import ScalarMappable
        from matplotlib.colors import LogNorm, Normalize, to_rgb
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError as error:
        raise ImportError(
            "drawing trees needs matplotlib, which is not installed: pip install treespec[viz] "
            "(or pip install matplotlib)"
        ) from error
    return SimpleNamespace(
        colormaps=colormaps,
        FigureCanvasAgg=FigureCanvasAgg,
        ScalarMappable=ScalarMappable,
        LogNorm=LogNorm,
        Normalize=Normalize,
        to_rgb=to_rgb,
        Figure=Figure,
        Patch=Patch,
    )


# ----- text -----


def visible(text: str, limit: int = 12) -> str:
    """A token's text for a label: space '␣', newline '↵', tab '⇥', other controls escaped, cut at limit."""
    out = []
    for ch in text:
        if ch in VISIBLE:
            out.append(VISIBLE[ch])
        elif unicodedata.category(ch) in ("Cc", "Cf", "Zl", "Zp", "Zs"):
            out.append(f"\\x{ord(ch):02x}" if ord(ch) < 0x100 else f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    shown = "".join(out) or "∅"
    return shown if len(shown) <= limit else shown[: limit - 1] + "…"


# ----- graphs -----


def node_probabilities(tree: Tree, acceptance: Sequence[Sequence[float]], mode: str = "path") -> list[float]:
    """Per node: ``acceptance[head][rank]`` ("node") or its product along the path ("path"); root 1."""
    if mode not in ("path", "node"):
        raise ValueError(f"mode must be 'path' or 'node', got {mode!r}")
    probs = [1.0]
    for i, choice in enumerate(tree.choices, start=1):
        head, rank = len(choice) - 1, choice[-1]
        try:
            p = float(acceptance[head][rank])
        except (IndexError, TypeError, ValueError):
            raise ValueError(f"acceptance has no probability for head {head} rank {rank}") from None
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"acceptance[{head}][{rank}] = {p} is not a probability in [0, 1]")
        parent = int(tree.parents[i])
        probs.append(p * probs[parent] if mode == "path" else p)
    return probs


def tree_graph(
    tree: Tree, acceptance: Sequence[Sequence[float]] | None = None, mode: str = "path"
) -> nx.DiGraph:
    """The tree as a graph with ``label`` ("root", "h0 r1", ...), ``kind`` and ``prob`` per node."""
    graph = tree.to_networkx()
    probs = node_probabilities(tree, acceptance, mode) if acceptance is not None else None
    for node, attrs in graph.nodes(data=True):
        attrs["kind"] = "root" if node == 0 else "node"
        attrs["label"] = "root" if node == 0 else f"h{attrs['head']} r{attrs['rank']}"
        attrs["prob"] = probs[node] if probs is not None else None
        if probs is not None and node > 0:
            attrs["label"] += f"\n{_short_prob(probs[node])}"
    for _, _, attrs in graph.edges(data=True):
        attrs["kind"] = "tree"
    title = f"{tree.num_nodes}-node tree, depth {tree.max_depth}, {tree.num_leaves} leaves"
    if acceptance is not None:
        expected = sum(node_probabilities(tree, acceptance, "path"))
        title += f", expected accepted length {expected:.2f}"
    graph.graph.update(title=title, mode=mode if acceptance is not None else None)
    return graph


def step_graph(trace: Trace, step_index: int) -> nx.DiGraph:
    """Step ``step_index`` (0-based) as a graph: token text and draft probability per node,
    ``accepted`` on the path's nodes and edges, and one extra ``kind="bonus"`` node (index N)
    hanging off the last accepted node."""
    if not -len(trace.steps) <= step_index < len(trace.steps):
        raise IndexError(f"step {step_index} out of range: the trace has {len(trace.steps)} steps")
    step_index %= len(trace.steps)
    step = trace.steps[step_index]
    tree = trace.step_tree(step_index)
    accepted = set(step.path)
    graph = tree.to_networkx()
    for node, attrs in graph.nodes(data=True):
        prob = step.draft_probs[node] if step.draft_probs is not None else None
        kind = "root" if node == 0 else "accepted" if node in accepted else "rejected"
        attrs.update(
            token_id=step.token_ids[node],
            text=step.token_texts[node],
            draft_prob=prob,
            accepted=node in accepted,
            kind=kind,
            label=visible(step.token_texts[node]) + "\n" + _prob_line(kind, prob),
        )
    for parent, child, attrs in graph.edges(data=True):
        attrs["kind"] = "accepted" if parent in accepted and child in accepted else "rejected"

    bonus = tree.num_nodes
    graph.add_node(
        bonus,
        depth=len(step.path),
        head=None,
        rank=None,
        choice=None,
        token_id=step.bonus_id,
        text=step.bonus_text,
        draft_prob=None,
        accepted=False,
        kind="bonus",
        label=visible(step.bonus_text) + "\nbonus",
    )
    graph.add_edge(step.path[-1], bonus, kind="bonus")
    added, drafted = "".join(step.accepted_texts), len(step.path) - 1
    graph.graph.update(
        step=step_index + 1,
        num_steps=len(trace.steps),
        title=(
            f"step {step_index + 1} / {len(trace.steps)}: {drafted} drafted token"
            f"{'' if drafted == 1 else 's'} accepted + bonus → {visible(added, 40)}"
        ),
    )
    return graph


def _short_prob(p: float) -> str:
    """A probability in at most 5 characters: '0.36', '0.012', '3e-05'."""
    return f"{p:.2f}" if p >= 0.1 else f"{p:.3f}" if p >= 0.001 else f"{p:.0e}"


def _prob_line(kind: str, prob: float | None) -> str:
    if kind == "root":
        return "root"
    return "p=?" if prob is None else f"p={_short_prob(prob)}"


def layered_layout(graph: nx.DiGraph, root: int = 0) -> dict[int, tuple[float, float]]:
    """Top-down positions: leaves take x = 0, 1, 2, ... in depth-first order (children by index,
    the bonus node last), a parent sits centred over its children, and y = -depth."""
    pos: dict[int, tuple[float, float]] = {}
    next_x = 0.0

    def order(node: int) -> tuple[bool, int]:
        return graph.nodes[node].get("kind") == "bonus", node

    def place(node: int, depth: int) -> None:
        nonlocal next_x
        kids = sorted(graph.successors(node), key=order)
        for kid in kids:
            place(kid, depth + 1)
        if kids:
            x = (pos[kids[0]][0] + pos[kids[-1]][0]) / 2
        else:
            x, next_x = next_x, next_x + 1
        pos[node] = (x, -float(depth))

    place(root, 0)
    return pos


# ----- drawing -----


def draw_tree(
    tree: Tree,
    path: str | Path | None = None,
    acceptance: Sequence[Sequence[float]] | None = None,
    mode: str = "path",
    title: str | None = None,
) -> nx.DiGraph:
    """Draw the static tree to ``path`` (.png or .svg; None draws without saving).

    Without ``acceptance`` nodes are coloured by head; with an ``acceptance[head][rank]`` table
    they are coloured by their path acceptance probability on a log colour bar (``mode="node"``:
    by the node's own acceptance, linear). Returns the graph that was drawn.
    """
    mpl = _mpl()
    graph = tree_graph(tree, acceptance, mode)
    if acceptance is None:
        for node, attrs in graph.nodes(data=True):
            colour = ROOT_COLOUR if node == 0 else HEAD_COLOURS[attrs["head"] % len(HEAD_COLOURS)]
            attrs["style"] = (colour, "#555555", "black", "solid")
        legend = [mpl.Patch(facecolor=ROOT_COLOUR, edgecolor="#555555", label="root")] + [
            mpl.Patch(facecolor=HEAD_COLOURS[h % len(HEAD_COLOURS)], edgecolor="#555555", label=f"head {h}")
            for h in range(tree.max_depth)
        ]
        colorbar = None
    else:
        cmap, norm = mpl.colormaps["viridis"], _probability_norm(graph, mode)
        for _, attrs in graph.nodes(data=True):
            face = cmap(norm(max(attrs["prob"], norm.vmin)))
            attrs["style"] = (face, "#333333", _text_colour(face), "solid")
        legend = []
        colorbar = (cmap, norm, f"{'path' if mode == 'path' else 'node'} acceptance probability")
    _render(graph, path, title or graph.graph["title"], legend, colorbar, column_width=0.62)
    return graph


def draw_step(trace: Trace, step_index: int, path: str | Path | None = None) -> nx.DiGraph:
    """Draw step ``step_index`` (0-based) of ``trace`` to ``path`` (.png or .svg; None: no file).

    Node labels are the decoded token texts (whitespace made visible) and draft probabilities;
    the accepted path is green, rejected nodes grey, the bonus token a dashed gold box below the
    last accepted node. Returns the graph that was drawn.
    """
    mpl = _mpl()
    graph = step_graph(trace, step_index)
    for _, attrs in graph.nodes(data=True):
        attrs["style"] = STEP_STYLE[attrs["kind"]]
    legend = [
        mpl.Patch(facecolor=STEP_STYLE[k][0], edgecolor=STEP_STYLE[k][1], linestyle=STEP_STYLE[k][3], label=k)
        for k in ("root", "accepted", "rejected", "bonus")
    ]
    _render(graph, path, graph.graph["title"], legend, None, column_width=0.85)
    return graph


def _probability_norm(graph: nx.DiGraph, mode: str) -> Normalize:
    """Linear [0, 1] for node probabilities; log for path products, which shrink geometrically."""
    mpl = _mpl()
    if mode == "node":
        return mpl.Normalize(0.0, 1.0)
    smallest = min((p for _, p in graph.nodes(data="prob") if p > 0), default=1.0)
    return mpl.LogNorm(max(min(smallest, 0.1), 1e-4), 1.0, clip=True)


def _text_colour(face) -> str:
    r, g, b = _mpl().to_rgb(face)
    return "black" if 0.299 * r + 0.587 * g + 0.114 * b > 0.5 else "white"


def _render(
    graph: nx.DiGraph,
    path: str | Path | None,
    title: str,
    legend: list,
    colorbar: tuple | None,
    column_width: float,
) -> None:
    """Draw a graph whose nodes carry ``label`` and ``style`` and whose edges carry ``kind``."""
    if path is not None and Path(path).suffix.lower() not in PICTURE_FORMATS:
        raise ValueError(f"{path}: unsupported picture format; use one of {', '.join(PICTURE_FORMATS)}")
    mpl = _mpl()
    pos = layered_layout(graph)
    columns = max(x for x, _ in pos.values()) + 1
    rows = -min(y for _, y in pos.values()) + 1
    width = max(5.0, columns * column_width + (1.4 if colorbar else 0.6))
    fig = mpl.Figure(figsize=(width, max(2.6, rows * 1.15 + 1.2)))
    mpl.FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.set_axis_off()
    ax.set_xlim(-0.6, columns - 0.4)
    ax.set_ylim(-rows + 0.5, 0.5)

    edges = list(graph.edges)
    styles = [EDGE_STYLE[graph.edges[e]["kind"]] for e in edges]
    nx.draw_networkx_edges(
        graph,
        pos,
        edgelist=edges,
        ax=ax,
        arrows=False,
        edge_color=[s[0] for s in styles],
        width=[s[1] for s in styles],
        style=[s[2] for s in styles],
    )
    for node, attrs in graph.nodes(data=True):
        face, border, ink, line = attrs["style"]
        x, y = pos[node]
        ax.text(
            x,
            y,
            attrs["label"],
            ha="center",
            va="center",
            fontsize=7,
            color=ink,
            parse_math=False,
            zorder=3,
            bbox=dict(boxstyle="round,pad=0.3", facecolor=face, edgecolor=border, linestyle=line, lw=1.2),
        )
    ax.set_title(title, fontsize=9, loc="left")
    if legend:
        ax.legend(
            handles=legend,
            loc="upper center",
            bbox_to_anchor=(0.5, 0.0),
            ncol=len(legend),
            fontsize=7,
            frameon=False,
        )
    if colorbar is not None:
        cmap, norm, label = colorbar
        bar = fig.colorbar(mpl.ScalarMappable(norm=norm, cmap=cmap), ax=ax, fraction=0.025, pad=0.01)
        if isinstance(norm, mpl.LogNorm):  # plain numbers instead of 10^-1
            ticks = [t for t in (1e-4, 1e-3, 0.01, 0.03, 0.1, 0.3, 1.0) if norm.vmin <= t]
            bar.set_ticks(ticks, labels=[f"{t:g}" for t in ticks])
            bar.ax.minorticks_off()
        bar.set_label(label, fontsize=8)
    if path is not None:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Glyph .* missing from font")
            fmt = Path(path).suffix.lower()[1:]
            atomic_write(path, lambda tmp: fig.savefig(tmp, format=fmt, dpi=130, bbox_inches="tight"))


# ----- HTML -----


def html_data(trace: Trace) -> dict:
    """Everything the HTML page shows, as plain JSON-ready data (positions from layered_layout)."""
    tree = trace.tree
    steps = []
    previous = trace.start_text
    for k, step in enumerate(trace.steps):
        graph = step_graph(trace, k)
        pos = layered_layout(graph)
        nodes = [
            {
                "id": node,
                "x": pos[node][0],
                "depth": -pos[node][1],
                "label": attrs["label"].split("\n"),
                "kind": attrs["kind"],
                "tip": _tip(attrs),
            }
            for node, attrs in graph.nodes(data=True)
        ]
        edges = [[u, v, attrs["kind"]] for u, v, attrs in graph.edges(data=True)]
        steps.append(
            {
                "nodes": nodes,
                "edges": edges,
                "accept_length": step.accept_length,
                "expected_accept": step.expected_accept,
                "nodes_verified": len(step.token_ids),
                "accepted": [visible(t, 40) for t in step.accepted_texts],
                "before": previous,
                "text": step.text,
            }
        )
        previous = step.text
    return {
        "model": trace.model,
        "tree": f"{tree.num_nodes} nodes, depth {tree.max_depth}, {tree.num_leaves} leaves",
        "max_accept": tree.max_depth + 1,
        "prompt": trace.prompt_text,
        "start_text": trace.start_text,
        "summary": trace.stats.get("summary", ""),
        "steps": steps,
    }


def _tip(attrs: dict) -> str:
    """Hover text of a node in the HTML page: where it comes from, its token, its draft probability."""
    kind, prob = attrs["kind"], attrs["draft_prob"]
    where = {"root": "root", "bonus": "bonus token"}.get(kind, f"head {attrs['head']} rank {attrs['rank']}")
    tip = f"{where}: token {attrs['token_id']} {json.dumps(attrs['text'], ensure_ascii=False)}"
    return tip if prob is None or kind == "root" else f"{tip}, draft p={prob:.4f}"


def write_html(trace: Trace, path: str | Path, title: str | None = None) -> None:
    """Write a self-contained page (inline CSS/JS, no network) that steps through ``trace``:
    ←/→ keys or the buttons move between steps; shows the tree, what was accepted, the growing
    text (``#generated-text``), a step counter (``#step-counter``) and accepted length per step."""
    data = html_data(trace)
    payload = json.dumps(data, ensure_ascii=False, allow_nan=False).replace("<", "\\u003c")
    page = (
        _PAGE.replace("__TITLE__", _escape(title or "treespec trace"))
        .replace("__STYLE__", _STYLE)
        .replace("__SCRIPT__", _SCRIPT)
        .replace("__DATA__", payload)
    )
    atomic_write_text(path, page)


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;")


_PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>__TITLE__</title>
<style>__STYLE__</style>
</head>
<body>
<h1>__TITLE__</h1>
<p id="meta"></p>
<details open><summary>Prompt</summary><pre id="prompt"></pre></details>
<div id="controls">
  <button id="prev" type="button" title="previous step (←)">◀ previous</button>
  <span id="step-counter">step 0 / 0</span>
  <button id="next" type="button" title="next step (→)">next ▶</button>
  <span class="hint">← / → keys step through the run</span>
</div>
<p id="accepted"></p>
<div id="tree"></div>
<h2>Generated text</h2>
<pre id="generated-text"></pre>
<h2>Accepted length per step</h2>
<div id="chart"></div>
<script type="application/json" id="trace-data">__DATA__</script>
<script>__SCRIPT__</script>
</body>
</html>
"""

_STYLE = """
body { font-family: system-ui, sans-serif; margin: 1.5em; color: #222; }
h1 { font-size: 1.3em; } h2 { font-size: 1.05em; margin-top: 1.2em; }
pre { white-space: pre-wrap; background: #f7f7f7; padding: 0.6em; border-radius: 4px; }
#controls { display: flex; gap: 0.8em; align-items: center; margin: 0.8em 0; }
#step-counter { font-weight: bold; min-width: 8em; text-align: center; }
.hint { color: #888; font-size: 0.85em; }
#tree { overflow-x: auto; border: 1px solid #ddd; border-radius: 4px; }
#generated-text mark { background: #c7e9c0; }
#chart svg rect.bar { fill: #9ecae1; cursor: pointer; }
#chart svg rect.bar.current { fill: #238b45; }
#chart svg line.predicted { stroke: #d94801; stroke-width: 2; }
.node text { font: 11px monospace; text-anchor: middle; pointer-events: none; }
.node.root rect { fill: #41ab5d; stroke: #005a32; } .node.root text { fill: white; }
.node.accepted rect { fill: #a1d99b; stroke: #006d2c; }
.node.rejected rect { fill: #f0f0f0; stroke: #c8c8c8; } .node.rejected text { fill: #9a9a9a; }
.node.bonus rect { fill: #ffe082; stroke: #b8860b; stroke-dasharray: 4 3; }
.edge.accepted { stroke: #238b45; stroke-width: 3; } .edge.rejected { stroke: #d0d0d0; stroke-width: 1; }
.edge.bonus { stroke: #b8860b; stroke-width: 2; stroke-dasharray: 5 4; }
"""

_SCRIPT = r"""
"use strict";
const data = JSON.parse(document.getElementById("trace-data").textContent);
const NS = "http://www.w3.org/2000/svg";
const COL = 92, ROW = 70, PAD = 40, BOX_H = 34;
const steps = data.steps;
let current = 0;

function svgEl(name, attrs, parent) {
  const el = document.createElementNS(NS, name);
  for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, v);
  if (parent) parent.appendChild(el);
  return el;
}

function drawTree(step) {
  const maxX = Math.max(...step.nodes.map(n => n.x));
  const maxDepth = Math.max(...step.nodes.map(n => n.depth));
  const w = (maxX + 1) * COL + 2 * PAD, h = maxDepth * ROW + 2 * PAD;
  const svg = svgEl("svg", {width: w, height: h, viewBox: "0 0 " + w + " " + h});
  const at = {};
  for (const n of step.nodes) at[n.id] = [PAD + COL / 2 + n.x * COL, PAD + n.depth * ROW];
  for (const [u, v, kind] of step.edges) {
    svgEl("line", {x1: at[u][0], y1: at[u][1], x2: at[v][0], y2: at[v][1], "class": "edge " + kind}, svg);
  }
  for (const n of step.nodes) {
    const g = svgEl("g", {"class": "node " + n.kind, transform: "translate(" + at[n.id] + ")"}, svg);
    svgEl("title", {}, g).textContent = n.tip;
    const boxW = Math.min(COL - 6, 12 + 7 * Math.max(...n.label.map(line => line.length)));
    svgEl("rect", {x: -boxW / 2, y: -BOX_H / 2, width: boxW, height: BOX_H, rx: 6}, g);
    n.label.forEach((line, i) => {
      svgEl("text", {x: 0, y: (i - (n.label.length - 1) / 2) * 13 + 4}, g).textContent = line;
    });
  }
  return svg;
}

function drawChart() {
  const n = steps.length, barW = Math.max(2, Math.min(24, 900 / Math.max(n, 1)));
  const unit = 22, h = data.max_accept * unit + 30, w = n * barW + 50;
  const svg = svgEl("svg", {width: w, height: h, id: "accept-chart"});
  for (let v = 1; v <= data.max_accept; v++) {
    const y = h - 20 - v * unit;
    svgEl("line", {x1: 30, x2: w, y1: y, y2: y, stroke: "#eee"}, svg);
    svgEl("text", {x: 24, y: y + 4, "text-anchor": "end", "font-size": 10}, svg).textContent = v;
  }
  steps.forEach((s, k) => {
    const bar = svgEl("rect", {
      x: 34 + k * barW, y: h - 20 - s.accept_length * unit, width: Math.max(1, barW - 2),
      height: s.accept_length * unit, "class": "bar", "data-step": k,
    }, svg);
    svgEl("title", {}, bar).textContent = "step " + (k + 1) + ": accepted length " + s.accept_length +
      (s.expected_accept === null ? "" : ", predicted " + s.expected_accept.toFixed(2)) +
      ", " + s.nodes_verified + " nodes verified";
    if (s.expected_accept !== null) {
      svgEl("line", {
        x1: 34 + k * barW, x2: 32 + (k + 1) * barW, "class": "predicted",
        y1: h - 20 - s.expected_accept * unit, y2: h - 20 - s.expected_accept * unit,
      }, svg);
    }
    bar.addEventListener("click", () => show(k));
  });
  return svg;
}

function show(k) {
  if (!steps.length) return;
  current = Math.max(0, Math.min(steps.length - 1, k));
  const step = steps[current];
  document.getElementById("step-counter").textContent = "step " + (current + 1) + " / " + steps.length;
  const tree = document.getElementById("tree");
  tree.replaceChildren(drawTree(step));
  const last = step.nodes.find(n => n.kind === "bonus");
  tree.scrollLeft = PAD + last.x * COL - tree.clientWidth / 2;
  const text = document.getElementById("generated-text");
  const grew = step.text.startsWith(step.before);
  const mark = document.createElement("mark");
  mark.textContent = grew ? step.text.slice(step.before.length) : step.text;
  text.replaceChildren(document.createTextNode(grew ? step.before : ""), mark);
  document.getElementById("accepted").textContent =
    "accepted length " + step.accept_length + " (root included)" +
    (step.expected_accept === null ? "" : ", predicted " + step.expected_accept.toFixed(2)) +
    "; " + step.nodes_verified + " nodes verified; appended: " + step.accepted.join(" · ") +
    "  (last one is the bonus token)";
  document.querySelectorAll("#chart rect.bar").forEach(
    bar => bar.classList.toggle("current", Number(bar.dataset.step) === current));
  document.getElementById("prev").disabled = current === 0;
  document.getElementById("next").disabled = current === steps.length - 1;
}

document.getElementById("meta").textContent =
  (data.model ? "model " + data.model + " · " : "") + "tree " + data.tree + " · " + data.summary;
document.getElementById("prompt").textContent = data.prompt;
document.getElementById("generated-text").textContent = data.start_text;
document.getElementById("chart").appendChild(drawChart());
document.getElementById("prev").addEventListener("click", () => show(current - 1));
document.getElementById("next").addEventListener("click", () => show(current + 1));
document.addEventListener("keydown", e => {
  if (e.key === "ArrowRight") { show(current + 1); e.preventDefault(); }
  else if (e.key === "ArrowLeft") { show(current - 1); e.preventDefault(); }
  else if (e.key === "Home") show(0);
  else if (e.key === "End") show(steps.length - 1);
});
if (steps.length) show(0); else { document.getElementById("next").disabled = true;
  document.getElementById("prev").disabled = true; }
"""
