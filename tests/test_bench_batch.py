"""The batched benchmark (treespec.tools.bench_batch, scripts/bench_batch.py): options, the summary and
crossover arithmetic, and a smoke run on the embedded model."""

from __future__ import annotations

import json

import pytest
from conftest import load_script

from treespec.tools import bench_batch


def test_options_are_checked(capsys):
    args = bench_batch.parse_args(["--batch-sizes", "8,1,4", "--num-prompts", "8"])
    assert args.batch_sizes == [1, 4, 8] and args.methods == list(bench_batch.DEFAULT_METHODS)
    for bad in (
        ["--methods", "hf,fast"],
        ["--batch-sizes", "1,16", "--num-prompts", "8"],
        ["--model", "some/other-model", "--methods", "eagle"],  # the shipped layer is the default model's
    ):
        with pytest.raises(SystemExit) as info:
            bench_batch.parse_args(bad)
        assert info.value.code == 2
    err = capsys.readouterr().err
    assert "unknown methods" in err and "pass --eagle FOLDER" in err
    assert bench_batch.RECIPE_METHODS["treespec_lookup"] == ("heads+lookup", "auto")
    assert set(bench_batch.RECIPE_METHODS) >= {"plain", "heads", "dynamic+suffix"}


def test_script_is_a_thin_wrapper(capsys):
    with pytest.raises(SystemExit) as info:
        load_script("bench_batch").main(["--help"])
    assert info.value.code == 0
    assert "usage: python scripts/bench_batch.py" in capsys.readouterr().out


def _record(batch, group, method, seconds, outputs):
    return {"batch": batch, "group": group, "method": method, "seconds": seconds, "outputs": outputs}


def test_summary_ratios_same_rows_and_crossover():
    records = [
        _record(1, 0, "hf", 2.0, [[1, 2]]),
        _record(1, 1, "hf", 2.0, [[3, 4]]),
        _record(1, 0, "plain", 1.0, [[1, 2]]),
        _record(1, 1, "plain", 1.0, [[3, 4]]),
        _record(1, 0, "treespec", 0.5, [[1, 2]]),
        _record(1, 1, "treespec", 0.25, [[3, 4]]),
        _record(2, 0, "hf", 1.0, [[1, 2], [3, 4]]),
        _record(2, 0, "plain", 0.5, [[1, 2], [3, 4]]),
        _record(2, 0, "treespec", 0.8, [[1, 2], [3, 5]]),  # slower than plain, one row differs
    ]
    summary = bench_batch.summarize(records, ["hf", "plain", "treespec"], [1, 2])
    row = {(r["batch"], r["method"]): r for r in summary}
    assert row[(1, "treespec")]["tokens_per_second"] == 4 / 0.75 and row[(1, "treespec")]["vs_hf"] == 4 / 0.75
    assert row[(2, "plain")]["vs_hf"] == 2.0
    assert row[(2, "treespec")]["same_as_single"] == [1, 2]
    # paired per group against plain on the same group, sorted: 1.0 / 0.5 and 1.0 / 0.25
    assert row[(1, "treespec")]["vs_plain_groups"] == [2.0, 4.0]
    assert row[(2, "treespec")]["vs_plain_groups"] == [0.625]
    assert row[(1, "hf")]["vs_plain_groups"] == [0.5, 0.5]
    assert bench_batch.crossover(summary) == 2
    assert bench_batch.crossover(summary[:3]) is None  # B = 1 only: speculation pays
    table = bench_batch.format_table(summary)
    assert "| 2 | treespec | 5.0 | 1.25 | 0.62 / 0.62 / 0.62 (1) | 1/2 |" in table
    assert "| 1 | treespec | 5.3 | 5.33 | 2.00 / 4.00 / 4.00 (2) | - |" in table


def test_one_prompt_at_a_time_methods_run_at_the_smallest_batch_only():
    calls = []

    def runner(name):
        def run(prompts, max_new_tokens):
            calls.append((name, len(prompts), max_new_tokens))
            return [[7] * 3 for _ in prompts]

        return run

    runners = {"hf": runner("hf"), "hf_prompt_lookup": runner("hf_prompt_lookup")}
    records = bench_batch.run_groups([[1], [2], [3], [4]], runners, [1, 4], 5)
    measured = [(name, size) for name, size, tokens in calls if tokens == 5]
    assert measured.count(("hf_prompt_lookup", 1)) == 4 and ("hf_prompt_lookup", 4) not in measured
    assert measured.count(("hf", 4)) == 1
    summary = bench_batch.summarize(records, ["hf", "hf_prompt_lookup"], [1, 4])
    row = {(r["batch"], r["method"]): r for r in summary}
    assert row[(4, "hf_prompt_lookup")]["measured_at"] == 1
    assert row[(4, "hf_prompt_lookup")]["tokens"] == row[(1, "hf_prompt_lookup")]["tokens"] == 12
    assert "one prompt at a time, run at B = 1" in bench_batch.format_table(summary)


def test_a_compiled_run_warms_up_every_measured_batch_size():
    calls = []
    runners = {"plain": lambda prompts, m: calls.append((len(prompts), m)) or [[7] for _ in prompts]}
    bench_batch.run_groups([[1]] * 8, runners, [1, 8], 5, compile=True)
    assert [size for size, tokens in calls if tokens == 8] == [1, 2, 3, 8]  # the warm-up calls
    calls.clear()
    bench_batch.run_groups([[1]] * 8, runners, [1, 8], 5)
    assert [size for size, tokens in calls if tokens == 8] == [1, 2, 3]  # eager: one row and several


@pytest.mark.integration
def test_smoke_run_on_the_embedded_model(tmp_path, capsys):
    out = tmp_path / "batch.json"
    result = bench_batch.main(
        ["--batch-sizes", "1,2", "--num-prompts", "2", "--max-new-tokens", "6", "--out", str(out),
         "--methods", "hf,plain,treespec_auto,treespec_lookup"]
    )  # fmt: skip
    assert json.loads(out.read_text())["crossover"] == result["crossover"]
    rows = {(r["batch"], r["method"]): r for r in result["summary"]}
    assert len(rows) == 8 and all(r["tokens"] > 0 for r in rows.values())
    # float32 greedy: batched rows equal the same prompts decoded alone, for every treespec method
    assert all(
        rows[(2, m)]["same_as_single"] == [2, 2] for m in ("plain", "treespec_auto", "treespec_lookup")
    )
    assert "| 2 | treespec_auto |" in capsys.readouterr().out
