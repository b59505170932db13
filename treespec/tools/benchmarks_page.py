"""Write BENCHMARKS.md, the current-results page, from the benchmark JSON files in ``benchmarks/``.

    python scripts/benchmarks_page.py            rewrite BENCHMARKS.md from benchmarks/*.json
    python scripts/benchmarks_page.py --check    exit 1 (and say so) when BENCHMARKS.md is out of date

The page is generated, never edited by hand: a test regenerates it from the committed JSON files and
fails when the committed page differs.

Which runs are current: ``benchmarks/current.json`` lists them, in the order the page shows them:

    {"runs": [{"file": "2026-12-02-dynamic-13-s11.json",          a JSON file in benchmarks/
               "title": "One sequence, ...",                       optional: the section's heading
               "machine": "AMD EPYC, AVX2, 2 cores",               optional: the JSON does not say
               "log": "2026-12-02-c-session11-one-row-kernel.md",  optional: its notes in benchmarks/log/
               "notes": ["...", "..."]}]}                          optional: lines printed under the table

Without that file, the newest run of each kind (by the ``started`` time the benchmark recorded, else
the file name) is current. Two kinds are shown as tables: ``bench`` (``scripts/bench.py``: one sequence
at a time, a summary per Spec-Bench category and overall) and ``batch`` (``scripts/bench_batch.py``:
tokens/s per method and batch size). GPU runs of the device machine get a section of their own: the
newest ``device_timing`` file (``scripts/device_timing.py``: kernels against SDPA, random-weight models of
real shapes, a projection from CPU acceptance) and the newest ``device_check`` file (the kernel timings
``scripts/device_check.sh`` wrote before it), found in ``benchmarks/`` or ``benchmarks/log/``. Every
other JSON file is listed under "Older runs and other files", and the dated notes in
``benchmarks/log/*.md`` are listed by their first heading.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

CURRENT_FILE = "current.json"
LOG_FOLDER = "log"
SHOWN_KINDS = ("bench", "batch")
DEVICE_KINDS = ("device_timing", "device_check")  # each one's newest run is shown in the GPU section
KIND_NAMES = {
    "bench": "one sequence at a time (`scripts/bench.py`)",
    "batch": "batches (`scripts/bench_batch.py`)",
    "kernel": "tree-attention kernel (`scripts/bench_kernel.py`)",
    "cost_curve": "verification cost curve (`scripts/cost_curve.py`)",
    "vllm_check": "vLLM serving an exported drafter (`scripts/vllm_drafter_check.py`)",
    "device_timing": "GPU timings: kernels, models of real shapes (`scripts/device_timing.py`)",
    "device_check": "GPU kernel timings (`scripts/device_check.sh`, before device_timing.py)",
    "other": "other",
}
METHOD_NAMES = {  # bench.py / bench_batch.py method -> what it is
    "hf": "HF `generate`",
    "hf_prompt_lookup": "HF prompt lookup",
    "hf_assisted": "HF assisted generation (draft model)",
    "vllm": "vLLM CPU build",
    "vllm_ngram": "vLLM CPU build, n-gram speculation",
    "llamacpp": "llama.cpp (llama-cpp-python, the same GGUF file), plain",
    "llamacpp_lookup": "llama.cpp prompt-lookup decoding",
    "baseline": "treespec, plain loop (no drafter)",
    "baseline_sdpa": "treespec, plain loop, SDPA attention",
    "plain": "treespec, plain steps (no drafter)",
    "treespec": "treespec, heads + static tree",
    "treespec_sdpa": "treespec, heads + static tree, SDPA attention",
    "treespec_auto": 'treespec, heads, `plain_above="auto"`',
    "treespec_lookup": "treespec, heads + static tree + prompt lookup",
    "lookup": "treespec, prompt lookup only",
    "dynamic": "treespec, dynamic trees (heads + prompt lookup)",
    "eagle": "treespec, EAGLE-style drafter",
    "eagle_lookup": "treespec, EAGLE-style drafter + prompt lookup",
    "eagle_dynamic": "treespec, dynamic trees (EAGLE-style drafter + prompt lookup)",
    "eagle_dynamic_suffix": "treespec, dynamic trees (EAGLE-style drafter + suffix trees)",
    "eagle_dynamic_all": "treespec, dynamic trees (EAGLE-style drafter + suffix + recycling)",
    "eagle_heads_all": "treespec, dynamic trees (EAGLE-style drafter + heads + suffix + recycling)",
    "draft_model": "treespec, draft model",
    "draft_model_tree": "treespec, draft model + runner-up leaves",
    "self_spec": "treespec, self-speculative (exit head)",
    "suffix": "treespec, suffix trees (request + earlier answers)",
    "dynamic_suffix": "treespec, dynamic trees (heads + suffix trees)",
    "dynamic_all": "treespec, dynamic trees (heads + suffix + recycling)",
    "recycling": "treespec, token recycling",
    # the recipes' own names (`treespec.recipes`; some earlier names above are aliases of them)
    "heads": "treespec, heads + static tree",
    "heads+lookup": "treespec, heads + static tree + prompt lookup",
    "eagle+lookup": "treespec, EAGLE-style drafter + prompt lookup",
    "dynamic+suffix": "treespec, dynamic trees (heads + suffix trees)",
    "dynamic+all": "treespec, dynamic trees (heads + suffix + recycling)",
    "eagle+dynamic": "treespec, dynamic trees (EAGLE-style drafter + prompt lookup)",
    "eagle+suffix": "treespec, dynamic trees (EAGLE-style drafter + suffix trees)",
    "eagle+all": "treespec, dynamic trees (EAGLE-style drafter + suffix + recycling)",
    "all": "treespec, dynamic trees (EAGLE-style drafter + heads + suffix + recycling)",
}
REFERENCE = "hf"
WORKLOAD_NAMES = {  # bench.py --workload -> how the page names its prompts
    "spec-bench": "Spec-Bench",
    "sharegpt-heldout": "held-out ShareGPT",
    "refine": "self-refinement (`--workload refine`)",
}


def run_kind(data: object) -> str:
    """'bench', 'batch', 'kernel', 'cost_curve', 'vllm_check', 'device_timing', 'device_check' or 'other',
    from the fields a benchmark wrote."""
    if not isinstance(data, dict):
        return "other"
    if isinstance(data.get("config"), dict) and isinstance(data.get("summary"), list):
        if "prompts" in data:
            return "bench"
        if "records" in data:
            return "batch"
    if "kernel" in data and "targets" in data:
        return "kernel"
    if data.get("format") == "treespec.cost_curve":
        return "cost_curve"
    if "vllm_speculative_equals_vllm_plain" in data:
        return "vllm_check"
    if data.get("format") == "treespec.device_timing":
        return "device_timing"
    if {"build", "failures", "copy_gbps", "rows"} <= set(data):  # device_check.sh's device_check.json
        return "device_check"
    return "other"


def load_runs(folder: Path) -> dict[str, dict]:
    """Every ``*.json`` directly in ``folder`` (current.json excepted): name -> {kind, data}."""
    runs = {}
    for path in sorted(folder.glob("*.json")):
        if path.name == CURRENT_FILE:
            continue
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}: not valid JSON ({error}); fix or remove the file") from None
        runs[path.name] = {"kind": run_kind(data), "data": data}
    return runs


def _started(name: str, data: object) -> str:
    config = data.get("config") if isinstance(data, dict) else None
    started = config.get("started") if isinstance(config, dict) else None
    return started or name[:10]


def current_runs(folder: Path, runs: dict[str, dict]) -> list[dict]:
    """The entries of benchmarks/current.json, or the newest run of each shown kind without it."""
    listing = folder / CURRENT_FILE
    if not listing.exists():
        newest = {}
        order = sorted(runs, key=lambda name: (_started(name, runs[name]["data"]), name))
        for name in order:
            if runs[name]["kind"] in SHOWN_KINDS:
                newest[runs[name]["kind"]] = {"file": name}
        return [newest[kind] for kind in SHOWN_KINDS if kind in newest]
    entries = json.loads(listing.read_text()).get("runs", [])
    for entry in entries:
        name = entry.get("file")
        if name not in runs:
            raise ValueError(f"{listing}: lists {name!r}, which is not a JSON file in {folder}")
        if runs[name]["kind"] not in SHOWN_KINDS:
            raise ValueError(
                f"{listing}: {name} is a {runs[name]['kind']} file; only bench.py and bench_batch.py "
                "results can be shown as current"
            )
    return entries


def _method(name: str) -> str:
    base, _, numerics = name.partition("@")
    if base not in METHOD_NAMES:
        return f"`{name}`"
    return f"{METHOD_NAMES[base]}{f', {numerics} numerics' if numerics else ''} (`{name}`)"


def _fmt(value: float | None, spec: str, suffix: str = "") -> str:
    return "" if value is None else f"{format(value, spec)}{suffix}"


def overall_summary(data: dict) -> dict:
    """A bench.py run's summary over all prompts: {"category": "overall", "prompts", "methods": {...}}."""
    return next((row for row in data["summary"] if row.get("category") == "overall"), data["summary"][-1])


def bench_table(data: dict) -> list[str]:
    """Markdown table of a bench.py run's overall results: one row per method."""
    overall = overall_summary(data)
    methods = [m for m in data["config"].get("methods", overall["methods"]) if m in overall["methods"]]
    prompts = overall.get("prompts", len(data["prompts"]))
    reference = overall["methods"].get(REFERENCE)
    plain = any(entry.get("identical_to_plain") is not None for entry in overall["methods"].values())
    lines = [
        "| method | tokens/s | x HF generate | accepted / step | nodes / step | outputs equal to HF greedy |"
        + (" outputs equal to treespec's plain loop |" if plain else ""),
        "|---|---|---|---|---|---|" + ("---|" if plain else ""),
    ]
    for name in methods:
        entry = overall["methods"][name]
        speed = entry["tokens_per_second"]
        ratio = entry.get("speedup")
        if ratio is None and reference:
            ratio = speed / reference["tokens_per_second"]
        same = entry.get("identical_to_hf")
        cells = [
            _method(name),
            _fmt(speed, ".1f"),
            _fmt(ratio, ".2f", "x"),
            _fmt(entry.get("accept_length"), ".2f"),
            _fmt(entry.get("nodes_per_step"), ".1f"),
            "reference" if name == REFERENCE else ("" if same is None else f"{same}/{prompts}"),
        ]
        if plain:
            equal = entry.get("identical_to_plain")
            cells.append("" if equal is None else f"{equal}/{prompts}")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def batch_table(data: dict) -> list[str]:
    """Markdown table of a bench_batch.py run: one row per method, tokens/s (x HF) per batch size."""
    rows = {(row["batch"], row["method"]): row for row in data["summary"]}
    sizes = sorted({size for size, _ in rows})
    methods = [m for m in data["config"].get("methods", []) if any((s, m) in rows for s in sizes)]
    methods += sorted({m for _, m in rows} - set(methods))
    lines = [
        "| method | "
        + " | ".join(f"B = {size}" for size in sizes)
        + " | rows equal to the same method at B = 1 |",
        "|---|" + "---|" * len(sizes) + "---|",
    ]
    footnote = False
    for name in methods:
        cells, same = [_method(name)], {}
        for size in sizes:
            row = rows.get((size, name))
            if row is None:
                cells.append("")
                continue
            repeated = row.get("measured_at", size) != size  # one run at another B, compared here
            footnote = footnote or repeated
            ratio = row.get("vs_hf")
            cells.append(
                f"{row['tokens_per_second']:.1f}"
                + (f" ({ratio:.2f}x)" if ratio is not None else "")
                + ("*" if repeated else "")
            )
            if row.get("same_as_single") and not repeated and size != 1:  # B = 1 is the reference
                same[size] = tuple(row["same_as_single"])
        cells.append(_same_cell(same))
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    lines.append("Tokens/s over all prompts at each batch size B (x HF batched `generate` at the same B).")
    if footnote:
        lines.append(
            "\\* decodes one prompt at a time: measured once at B = 1 and compared with HF at each B."
        )
    return lines


def _same_cell(same: dict[int, tuple[int, int]]) -> str:
    """'16/16 at each B' when every batch size agrees, else the count per B ('' without B = 1 to compare)."""
    if not same:
        return ""
    if len(set(same.values())) == 1:
        ((equal, total),) = set(same.values())
        return f"{equal}/{total}" + (" at each B" if len(same) > 1 else "")
    return ", ".join(f"{equal}/{total} at B = {size}" for size, (equal, total) in same.items())


def kernel_ratio_table(rows: list[dict]) -> list[str]:
    """Markdown table of GPU kernel rows (device_timing's "kernel_rows", device_check's "rows"): one line
    per shape, dtype and prefix; per node count n, SDPA-with-a-float-mask ms / treespec ms and the K/V
    bytes treespec read per second."""
    groups: dict[tuple, dict[int, dict]] = {}
    for row in rows:
        groups.setdefault((row["shape"], row["dtype"], row["prefix"]), {})[row["n"]] = row
    nodes = sorted({row["n"] for row in rows})
    lines = [
        "| shape | dtype | prefix | " + " | ".join(f"n = {n}" for n in nodes) + " |",
        "|---|---|---|" + "---|" * len(nodes),
    ]
    for (shape, dtype, prefix), by_n in groups.items():
        cells = [
            f"{r['sdpa_float'] / r['treespec']:.2f}x, {_rate(r['kv_gbps'])} GB/s"
            if (r := by_n.get(n))
            else ""
            for n in nodes
        ]
        lines.append(f"| {shape} | {dtype} | {prefix} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Each cell: SDPA with a dense float mask ms / treespec's kernel ms (> 1: treespec is faster), then "
        "the K/V bytes treespec's kernel read per second (n = 1: one-token decoding, no mask). SDPA with a "
        "bool mask and flash-attn without a mask are in the JSON.",
    ]
    return lines


def _rate(gbps: float) -> str:
    return f"{gbps:.0f}" if gbps >= 10 else f"{gbps:.1f}"


def _count(parameters: int) -> str:
    return f"{parameters / 1e9:.2f} B" if parameters >= 1e9 else f"{parameters / 1e6:.0f} M"


def model_step_table(models: list[dict]) -> list[str]:
    """Markdown table of device_timing's random-weight models: per model, kernel and prefix, the one-token
    step, verify(n) / verify(1) and HF `generate`'s ms per token."""
    rows_of = [row for m in models for rows in m["verify_ms"].values() for row in rows.values()]
    nodes = sorted({int(n) for row in rows_of for n in row} - {1})
    lines = [
        "| model shape | parameters | kernel | prefix | one-token step ms | "
        + " | ".join(f"verify {n} / 1" for n in nodes)
        + " | HF `generate` ms / token |",
        "|---|---|---|---|---|" + "---|" * len(nodes) + "---|",
    ]
    for m in models:
        hf = m.get("hf_generate", {}).get("ms_per_token")
        for kernel, rows in m["verify_ms"].items():
            name = f"{kernel} (auto)" if kernel == m.get("auto_kernel") else kernel
            for prefix, row in rows.items():
                one = row.get("1")
                ratios = [_fmt(row[str(n)] / one, ".2f", "x") if one and str(n) in row else "" for n in nodes]
                cells = [m["label"], _count(m["parameters"]), name, prefix, _fmt(one, ".2f")]
                lines.append("| " + " | ".join([*cells, *ratios, _fmt(hf, ".2f")]) + " |")
    for m in models:
        for kernel, error in m.get("errors", {}).items():
            lines.append(f"- {m['label']}, kernel {kernel}: failed ({error})")
    lines += [
        "",
        "Random weights (speed does not depend on them). Step and verification: `Decoder.score` over n "
        "nodes (`treespec.training.costs.verify_ms`, median); kernel `compiled` is treespec's own attention "
        "kernel, `sdpa` torch's. HF: greedy `generate`, "
        + (models[0].get("hf_generate", {}).get("how", "") if models else ""),
    ]
    return lines


def projection_table(projection: dict) -> list[str]:
    """Markdown table of device_timing's projection: tokens/s each drafter would reach at its CPU
    acceptance with the measured verification costs (labelled as a projection)."""
    lines = [
        f"**Projection.** {projection['label']}",
        "",
        "| model shape | method | accepted / step | nodes / step | verify ms | projected tokens/s "
        "| x one-token steps | x HF `generate` |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in projection["rows"]:
        cells = [
            r["model"],
            _method(r["method"]),
            f"{r['accept_length']:.2f}",
            f"{r['nodes_per_step']:.1f}",
            f"{r['verify_ms']:.2f}",
            f"{r['projected_tokens_per_second']:.0f}",
            f"{r['vs_one_token_steps']:.2f}x",
            _fmt(r.get("vs_hf_generate"), ".2f", "x"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def device_tables(data: dict) -> list[str]:
    """The tables of one GPU run: a device_timing file's kernels, models and projection, or a
    device_check file's kernels."""
    rows = data.get("kernel_rows", data.get("rows", []))
    lines = []
    if rows:
        timer = data.get("timer", "median of CUDA-event timings")
        lines += [f"Attention kernels ({timer}):", "", *kernel_ratio_table(rows), ""]
    if data.get("copy_gbps"):
        size = data.get("copy_megabytes", 256)
        lines += [f"A {size} MB device copy: {_rate(data['copy_gbps'])} GB/s (bytes copied per second).", ""]
    if data.get("models"):
        lines += ["Random-weight models of real shapes:", "", *model_step_table(data["models"]), ""]
    lines += [f"- model {name}: failed ({error})" for name, error in data.get("model_errors", {}).items()]
    if data.get("projection", {}).get("rows"):
        lines += [*projection_table(data["projection"]), ""]
    return lines


def device_section(folder: Path, runs: dict[str, dict], link: str) -> list[str]:
    """The page's GPU section: the newest run of each device kind among ``runs`` (``load_runs(folder)``) or
    in ``folder``'s log folder (none: no section)."""
    runs = {name: run for name, run in runs.items() if run["kind"] in DEVICE_KINDS}
    if (folder / LOG_FOLDER).is_dir():
        logged = load_runs(folder / LOG_FOLDER).items()
        runs |= {f"{LOG_FOLDER}/{name}": run for name, run in logged if run["kind"] in DEVICE_KINDS}
    newest = {}
    for name in sorted(runs, key=lambda name: Path(name).name):
        newest[runs[name]["kind"]] = name
    if not newest:
        return []
    lines = [
        "## GPU runs",
        "",
        "Measured on a GPU machine lent for a few minutes (`scripts/device_check.sh`, which runs "
        "`scripts/device_timing.py`); the newest run of each format.",
        "",
    ]
    for kind in DEVICE_KINDS:
        if kind not in newest:
            continue
        name, data = newest[kind], runs[newest[kind]]["data"]
        title = KIND_NAMES[kind][0].upper() + KIND_NAMES[kind][1:]
        smoke = " (a smoke test of the script: tiny shapes, not a measurement)" if data.get("smoke") else ""
        lines += [f"### {title}: {data.get('device')}, torch {data.get('torch')}{smoke}", ""]
        lines += device_tables(data)
        lines += [f"JSON: [{link}/{name}]({link}/{name}).", ""]
    return lines


def _settings(entry: dict, data: dict, kind: str) -> str:
    """One line: machine, device, dtype, threads, sizes, tree, versions, date."""
    get = data["config"].get
    prompts = len(data["prompts"]) if kind == "bench" else get("num_prompts", "?")
    penalty = get("repetition_penalty", 1.0)
    parts = [
        f"Machine: {entry['machine']}" if entry.get("machine") else f"Platform: {get('platform', '?')}",
        ", ".join(str(x) for x in (get("device"), get("dtype", "?")) if x)
        + f", {get('threads', '?')} threads",
        f"{prompts} {WORKLOAD_NAMES.get(get('workload') or 'spec-bench', get('workload'))} prompts, "
        f"{get('max_new_tokens', '?')} new tokens, greedy"
        + (f" with repetition penalty {penalty}" if penalty != 1.0 else ""),
        "compiled steps" if get("compile") else "eager steps",
    ]
    if get("tree_choices"):
        parts.append(f"the heads' tree: {len(get('tree_choices')) + 1} nodes")
    versions = get("versions") or {}
    parts += [f"{k} {v}" for k, v in versions.items() if k in ("torch", "transformers")]
    if get("started"):
        parts.append(f"started {get('started')}")
    return "; ".join(parts) + "."


def run_section(entry: dict, data: dict, kind: str, link: str) -> list[str]:
    """The page's section for one current run: heading, settings, command, table, notes, links."""
    name = entry["file"]
    lines = [f"### {entry.get('title') or KIND_NAMES[kind].capitalize() + ': ' + name}", ""]
    lines.append(_settings(entry, data, kind))
    lines.append("")
    command = data["config"].get("command")
    if command:
        lines += ["```", command, "```", ""]
    lines += bench_table(data) if kind == "bench" else batch_table(data)
    lines.append("")
    for note in entry.get("notes", []):
        lines.append(f"- {note}")
    if entry.get("notes"):
        lines.append("")
    wall = data.get("wall_seconds")
    where = f"JSON: [{link}/{name}]({link}/{name})" + (f" (wall time {wall:.0f} s)" if wall else "")
    if entry.get("log"):
        where += f"; notes: [{link}/{LOG_FOLDER}/{entry['log']}]({link}/{LOG_FOLDER}/{entry['log']})"
    lines += [where + ".", ""]
    return lines


def _describe(kind: str, data: object) -> str:
    """A few words on an older run for the list."""
    if kind in SHOWN_KINDS:
        config = data["config"]
        size = (
            f"{len(data['prompts'])} prompts"
            if kind == "bench"
            else "B = "
            + ",".join(str(b) for b in config.get("batch_sizes", []))
            + f", {config.get('num_prompts')} prompts"
        )
        compiled = ", compiled" if config.get("compile") else ""
        return f"{size}, {config.get('dtype')}{compiled}: " + ", ".join(config.get("methods", []))
    if kind == "kernel":
        return f"{data.get('threads')} thread(s)" + (", end to end" if "e2e" in data else "")
    if kind == "vllm_check":
        return (
            f"{data.get('prompts')} prompts, {data.get('draft_tokens')} draft tokens; vLLM's output with the "
            f"drafter equals its plain output on {data.get('vllm_speculative_equals_vllm_plain')}"
        )
    if kind == "cost_curve":
        return f"{data.get('dtype')}, paths: " + ", ".join(data.get("verify_ms", {}))
    if kind in DEVICE_KINDS:
        models = ", ".join(m["label"] for m in data.get("models", []))
        return f"{data.get('device')}" + (f"; models: {models}" if models else "")
    return ", ".join(list(data)[:6]) if isinstance(data, dict) else type(data).__name__


def older_runs(runs: dict[str, dict], current: list[dict], link: str) -> list[str]:
    """The list of every other JSON file, newest first, with its kind and a few words."""
    shown = {entry["file"] for entry in current}
    lines = ["| file | kind | what |", "|---|---|---|"]
    for name in sorted(runs, reverse=True):
        if name in shown:
            continue
        kind = runs[name]["kind"]
        lines.append(
            f"| [{name}]({link}/{name}) | {KIND_NAMES[kind]} | {_describe(kind, runs[name]['data'])} |"
        )
    return lines


def log_entries(folder: Path, link: str) -> list[str]:
    """benchmarks/log/*.md, newest first, each linked under its first heading."""
    lines = []
    for path in sorted((folder / LOG_FOLDER).glob("*.md"), reverse=True):
        if path.name == "README.md":
            continue
        first = next((ln for ln in path.read_text().splitlines() if ln.startswith("#")), path.stem)
        lines.append(f"- [{first.lstrip('#').strip()}]({link}/{LOG_FOLDER}/{path.name})")
    return lines


def render(folder: str | Path, page: str | Path) -> str:
    """The text of the results page at ``page`` for the benchmark files in ``folder``."""
    folder, page = Path(folder), Path(page)
    link = Path(os.path.relpath(folder.resolve(), page.resolve().parent)).as_posix()
    runs = load_runs(folder)
    current = current_runs(folder, runs)
    how = f"`{link}/{CURRENT_FILE}`" if (folder / CURRENT_FILE).exists() else "the newest run of each kind"
    lines = [
        "# Benchmarks",
        "",
        "<!-- Generated by `python scripts/benchmarks_page.py` from the JSON files in "
        f"{link}/ (treespec/tools/benchmarks_page.py); do not edit by hand. -->",
        "",
        "Each benchmark runs every method in the same process on the same prompt token ids, interleaved per",
        "prompt with a rotating order, and writes one JSON file (settings, per-prompt records, summary). The",
        "machines are shared with other work, so absolute tokens/s move from day to day: compare the ratios",
        "within one run. Speed is wall clock per call, prefill included, after a warm-up call per method.",
        "",
        "## Current results",
        "",
        f"The runs shown here are chosen by {how}; regenerate this page with",
        "`python scripts/benchmarks_page.py` after adding a run.",
        "",
    ]
    for entry in current:
        run = runs[entry["file"]]
        lines += run_section(entry, run["data"], run["kind"], link)
    lines += device_section(folder, runs, link)
    lines += ["## Older runs and other files", ""]
    lines += older_runs(runs, current, link)
    folders = sorted(p.name for p in folder.iterdir() if p.is_dir() and p.name != LOG_FOLDER)
    if folders:
        lines += ["", "Folders: " + ", ".join(f"[{name}/]({link}/{name}/)" for name in folders) + "."]
    lines += ["", f"## Dated notes ([{link}/{LOG_FOLDER}/]({link}/{LOG_FOLDER}/))", ""]
    lines += log_entries(folder, link) or ["(none yet)"]
    return "\n".join(lines).rstrip("\n") + "\n"


def write_page(folder: str | Path, page: str | Path) -> bool:
    """Rewrite ``page`` from ``folder``; True when its text changed."""
    text = render(folder, page)
    page = Path(page)
    if page.exists() and page.read_text() == text:
        return False
    page.write_text(text)
    return True


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    """Command line: rewrite the page, or with --check report whether it is up to date."""
    root = Path.cwd()
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--benchmarks", default=str(root / "benchmarks"), help="folder of JSON files (default ./benchmarks)"
    )
    p.add_argument("--out", default=str(root / "BENCHMARKS.md"), help="the page (default ./BENCHMARKS.md)")
    p.add_argument("--check", action="store_true", help="change nothing; exit 1 when the page is out of date")
    args = p.parse_args(argv)
    if args.check:
        page = Path(args.out)
        fresh = page.exists() and page.read_text() == render(args.benchmarks, page)
        print(
            f"{args.out} is {'up to date' if fresh else 'out of date: run python scripts/benchmarks_page.py'}"
        )
        return 0 if fresh else 1
    changed = write_page(args.benchmarks, args.out)
    print(f"{'wrote' if changed else 'unchanged:'} {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
