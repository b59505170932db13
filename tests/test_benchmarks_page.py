"""BENCHMARKS.md is generated: tables from small bench / bench_batch JSON files, the choice of current runs,
and the committed page equal to what the script writes from the committed JSON files."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from treespec.tools import benchmarks_page as page

ROOT = Path(__file__).resolve().parents[1]


def _bench_run(started: str, dynamic: float) -> dict:
    """A bench.py result with the fields the page reads: two prompts, three methods."""
    methods = {
        "hf": {"tokens_per_second": 10.0, "speedup": 1.0},
        "baseline": {
            "tokens_per_second": 25.0,
            "speedup": 2.5,
            "accept_length": 1.0,
            "nodes_per_step": 1.0,
            "identical_to_hf": 2,
        },
        "dynamic": {
            "tokens_per_second": 10.0 * dynamic,
            "speedup": dynamic,
            "accept_length": 1.5734,
            "nodes_per_step": 3.4032,
            "identical_to_hf": 1,
        },
    }
    config = {
        "command": "python scripts/bench.py --methods hf,baseline,dynamic",
        "dtype": "float32",
        "device": "cpu",
        "threads": 2,
        "max_new_tokens": 64,
        "compile": True,
        "methods": ["hf", "baseline", "dynamic"],
        "tree_choices": [[0], [1], [0, 0]],
        "started": started,
    }
    summary = [
        {"category": "writing", "prompts": 1, "methods": methods},
        {"category": "overall", "prompts": 2, "methods": methods},
    ]
    return {"config": config, "wall_seconds": 12.3, "prompts": [{}, {}], "summary": summary}


def _batch_run() -> dict:
    """A bench_batch.py result: B = 1 and 4; HF prompt lookup measured at B = 1 only."""

    def row(batch, method, speed, vs_hf, same, measured_at=None):
        return {
            "batch": batch,
            "method": method,
            "tokens_per_second": speed,
            "vs_hf": vs_hf,
            "same_as_single": same,
            "measured_at": measured_at or batch,
        }

    summary = [
        row(1, "hf", 10.0, 1.0, [4, 4]),
        row(1, "hf_prompt_lookup", 9.0, 0.9, [4, 4]),
        row(1, "plain", 24.0, 2.4, [4, 4]),
        row(4, "hf", 20.0, 1.0, [4, 4]),
        row(4, "hf_prompt_lookup", 9.0, 0.45, [4, 4], measured_at=1),
        row(4, "plain", 70.0, 3.5, [3, 4]),
    ]
    config = {
        "command": "python scripts/bench_batch.py --batch-sizes 1,4",
        "dtype": "float32",
        "threads": 2,
        "num_prompts": 4,
        "max_new_tokens": 32,
        "methods": ["hf", "hf_prompt_lookup", "plain"],
        "started": "2026-12-03T10:00:00",
    }
    return {"config": config, "wall_seconds": 50.0, "summary": summary, "crossover": None, "records": []}


@pytest.fixture
def folder(tmp_path):
    bench = tmp_path / "benchmarks"
    (bench / "log").mkdir(parents=True)
    (bench / "2026-12-01-old.json").write_text(json.dumps(_bench_run("2026-12-01T09:00:00", 2.0)))
    (bench / "2026-12-02-new.json").write_text(json.dumps(_bench_run("2026-12-02T09:00:00", 3.64)))
    (bench / "2026-12-03-batch.json").write_text(json.dumps(_batch_run()))
    (bench / "2026-12-01-curve.json").write_text(
        json.dumps({"format": "treespec.cost_curve", "dtype": "float32", "verify_ms": {"blocks": {}}})
    )
    (bench / "log" / "2026-12-02-a-notes.md").write_text("# 2026-12-02 - what we learned\n\ntext\n")
    return bench


def test_newest_run_of_each_kind_is_current_without_a_listing(folder, tmp_path):
    text = page.render(folder, tmp_path / "BENCHMARKS.md")
    current, older = text.split("## Older runs and other files")
    assert "2026-12-02-new.json" in current and "2026-12-03-batch.json" in current
    assert (
        "2026-12-01-old.json" not in current
        and "[2026-12-01-old.json](benchmarks/2026-12-01-old.json)" in older
    )
    assert "verification cost curve" in older
    assert "- [2026-12-02 - what we learned](benchmarks/log/2026-12-02-a-notes.md)" in older


def test_bench_table(folder, tmp_path):
    lines = page.render(folder, tmp_path / "BENCHMARKS.md").splitlines()
    assert (
        "| method | tokens/s | x HF generate | accepted / step | nodes / step | outputs equal to HF greedy |"
        in lines
    )
    assert "| HF `generate` (`hf`) | 10.0 | 1.00x |  |  | reference |" in lines
    assert "| treespec, plain loop (no drafter) (`baseline`) | 25.0 | 2.50x | 1.00 | 1.0 | 2/2 |" in lines
    assert (
        "| treespec, dynamic trees (heads + prompt lookup) (`dynamic`) | 36.4 | 3.64x | 1.57 | 3.4 | 1/2 |"
        in lines
    )
    assert "python scripts/bench.py --methods hf,baseline,dynamic" in lines
    assert any(
        line.startswith("JSON: [benchmarks/2026-12-02-new.json](benchmarks/2026-12-02-new.json)")
        for line in lines
    )
    assert any("float32, 2 threads" in line and "compiled steps" in line for line in lines)


def test_batch_table(folder, tmp_path):
    lines = page.render(folder, tmp_path / "BENCHMARKS.md").splitlines()
    assert "| method | B = 1 | B = 4 | rows equal to the same method at B = 1 |" in lines
    assert "| HF `generate` (`hf`) | 10.0 (1.00x) | 20.0 (1.00x) | 4/4 |" in lines
    assert "| HF prompt lookup (`hf_prompt_lookup`) | 9.0 (0.90x) | 9.0 (0.45x)* |  |" in lines
    assert "| treespec, plain steps (no drafter) (`plain`) | 24.0 (2.40x) | 70.0 (3.50x) | 3/4 |" in lines


def test_listing_chooses_runs_titles_and_notes(folder, tmp_path):
    listing = {
        "runs": [
            {
                "file": "2026-12-01-old.json",
                "title": "The old one",
                "machine": "a test machine",
                "log": "2026-12-02-a-notes.md",
                "notes": ["measured for a test"],
            }
        ]
    }
    (folder / "current.json").write_text(json.dumps(listing))
    out = tmp_path / "BENCHMARKS.md"
    assert page.write_page(folder, out)
    assert not page.write_page(folder, out)  # unchanged the second time
    current = out.read_text().split("## Older runs and other files")[0]
    assert "### The old one" in current and "Machine: a test machine;" in current
    assert "- measured for a test" in current and "(benchmarks/log/2026-12-02-a-notes.md)" in current
    assert "2026-12-02-new.json" not in current and "2026-12-03-batch.json" not in current


@pytest.mark.parametrize(
    "entry, message",
    [({"file": "missing.json"}, "not a JSON file"), ({"file": "2026-12-01-curve.json"}, "cost_curve file")],
)
def test_listing_refuses_what_it_cannot_show(folder, tmp_path, entry, message):
    (folder / "current.json").write_text(json.dumps({"runs": [entry]}))
    with pytest.raises(ValueError, match=message):
        page.render(folder, tmp_path / "BENCHMARKS.md")


def test_check_reports_a_stale_page(folder, tmp_path, capsys):
    out = tmp_path / "BENCHMARKS.md"
    out.write_text("# edited by hand\n")
    assert page.main(["--benchmarks", str(folder), "--out", str(out), "--check"]) == 1
    assert "out of date" in capsys.readouterr().out
    assert page.main(["--benchmarks", str(folder), "--out", str(out)]) == 0
    assert page.main(["--benchmarks", str(folder), "--out", str(out), "--check"]) == 0


def test_committed_page_is_what_the_script_writes():
    expected = page.render(ROOT / "benchmarks", ROOT / "BENCHMARKS.md")
    assert (ROOT / "BENCHMARKS.md").read_text() == expected, "run: python scripts/benchmarks_page.py"


def test_script_checks_the_committed_page_from_anywhere(tmp_path):
    run = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "benchmarks_page.py"), "--check"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "up to date" in run.stdout


def test_every_recipe_and_benchmark_method_has_a_name_on_the_page():
    from treespec.recipes import RECIPES
    from treespec.tools import bench, bench_batch

    methods = {*RECIPES, *bench.PEER_METHODS, *bench_batch.METHODS}
    assert not methods - set(page.METHOD_NAMES)


def _device_timing_run() -> dict:
    """A scripts/device_timing.py result with the fields the page reads: one kernel shape at two node
    counts, one model on two kernels, one projected method."""

    def kernel(n, treespec, sdpa_float):
        return {"shape": "7b", "dtype": "bfloat16", "prefix": 8192, "n": n, "treespec": treespec} | {
            "sdpa_float": sdpa_float,
            "sdpa_bool": 2 * sdpa_float,
            "kv_gbps": 374.25 if n == 1 else 4.04,
        }

    model = {
        "name": "llama-8b",
        "label": "Llama-3.1-8B shape",
        "parameters": 8_030_261_248,
        "auto_kernel": "sdpa",
        "hf_generate": {"ms_per_token": 22.5, "how": "ms per token = (ms of 64 - ms of 1) / 63."},
        "verify_ms": {
            "sdpa": {"128": {"1": 8.0, "16": 8.8, "64": 12.0}},
            "compiled": {"128": {"1": 8.4, "16": 9.6, "64": 16.8}},
        },
        "errors": {},
    }
    projection = {
        "label": "Projected from CPU acceptance, not a measured GPU run: a test.",
        "rows": [
            {
                "model": "Llama-3.1-8B shape",
                "method": "dynamic",
                "accept_length": 2.34,
                "nodes_per_step": 14.77,
                "verify_ms": 8.7,
                "projected_tokens_per_second": 269.0,
                "vs_one_token_steps": 2.152,
                "vs_hf_generate": 6.05,
            }
        ],
    }
    return {
        "format": "treespec.device_timing",
        "version": 1,
        "device": "NVIDIA H200",
        "torch": "2.11.0+cu130",
        "kernel_rows": [kernel(1, 0.05, 0.02), kernel(16, 0.1, 0.15)],
        "copy_megabytes": 256,
        "copy_gbps": 2080.2,
        "models": [model],
        "projection": projection,
        "smoke": False,
    }


def test_device_runs_get_a_gpu_section(folder, tmp_path):
    assert "## GPU runs" not in page.render(folder, tmp_path / "BENCHMARKS.md")  # none yet: no section
    (folder / "2026-12-07-device-timing.json").write_text(json.dumps(_device_timing_run()))
    old = {"build": {"ok": True}, "failures": [], "copy_gbps": 1999.6, "device": "NVIDIA H200", "torch": "2"}
    old["rows"] = [_device_timing_run()["kernel_rows"][0] | {"shape": "smollm2", "prefix": 128}]
    (folder / "log" / "2026-12-04-c-device-check.json").write_text(json.dumps(old))
    assert page.run_kind(_device_timing_run()) == "device_timing" and page.run_kind(old) == "device_check"

    text = page.render(folder, tmp_path / "BENCHMARKS.md")
    gpu, older = text.split("## GPU runs")[1].split("## Older runs and other files")
    lines = gpu.splitlines()
    assert "| shape | dtype | prefix | n = 1 | n = 16 |" in lines
    assert "| 7b | bfloat16 | 8192 | 0.40x, 374 GB/s | 1.50x, 4.0 GB/s |" in lines  # SDPA ms / treespec ms
    assert "A 256 MB device copy: 2080 GB/s (bytes copied per second)." in lines
    assert (
        "| model shape | parameters | kernel | prefix | one-token step ms | verify 16 / 1 | verify 64 / 1 "
        "| HF `generate` ms / token |" in lines
    )
    assert "| Llama-3.1-8B shape | 8.03 B | sdpa (auto) | 128 | 8.00 | 1.10x | 1.50x | 22.50 |" in lines
    assert "| Llama-3.1-8B shape | 8.03 B | compiled | 128 | 8.40 | 1.14x | 2.00x | 22.50 |" in lines
    assert "**Projection.** Projected from CPU acceptance, not a measured GPU run: a test." in lines
    assert (
        "| Llama-3.1-8B shape | treespec, dynamic trees (heads + prompt lookup) (`dynamic`) | 2.34 | 14.8 "
        "| 8.70 | 269 | 2.15x | 6.05x |" in lines
    )
    assert (
        "JSON: [benchmarks/2026-12-07-device-timing.json](benchmarks/2026-12-07-device-timing.json)." in lines
    )
    # the older device_check format from the log folder: its kernel table alone
    assert "| smollm2 | bfloat16 | 128 | 0.40x, 374 GB/s |" in lines
    logged = "benchmarks/log/2026-12-04-c-device-check.json"
    assert f"JSON: [{logged}]({logged})." in lines
    assert "GPU timings: kernels, models of real shapes" in older  # also listed with the other files
