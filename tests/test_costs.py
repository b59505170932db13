"""The cost curve (training.costs): measured on a tiny model, interpolated, saved and refused when foreign."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import tiny_model

from treespec.training.costs import cost_curve, interpolate, load_cost_curve, save_cost_curve


def test_cost_curve_measures_every_point_and_round_trips(tmp_path):
    model = tiny_model("llama", dtype=torch.float32)
    curve = cost_curve(
        model, nodes=[1, 4, 8], prefixes=[16, 40], paths=("eager", "onednn", "blocks"), repeats=2
    )
    for path in ("eager", "onednn", "blocks"):
        for prefix in ("16", "40"):
            row = curve["verify_ms"][path][prefix]
            assert set(row) == {"1", "4", "8"} and all(ms > 0 for ms in row.values())
    save_cost_curve(tmp_path / "c.json", curve)
    assert load_cost_curve(tmp_path / "c.json") == json.loads(json.dumps(curve))


def test_interpolate_is_linear_between_measured_counts_and_goes_on_the_last_slope_beyond():
    rows = {"100": {"1": 10.0, "8": 24.0, "16": 40.0}, "900": {"1": 99.0}}
    assert interpolate(rows, 120, 4) == pytest.approx(10.0 + 14.0 * 3 / 7)
    assert interpolate(rows, 120, 12) == pytest.approx(32.0)
    # beyond the last measured count (a batch of rows x nodes): the last segment's slope, 2 ms a node
    assert interpolate(rows, 120, 64) == pytest.approx(40.0 + 2.0 * 48)
    assert interpolate(rows, 120, 1) == 10.0  # below the first: the first
    assert interpolate(rows, 800, 4) == 99.0  # the nearest measured prefix
    assert interpolate({"100": {"1": 1.0}, "300": {"1": 3.0}}, 200, 1) == 1.0  # a tie: the shorter


def test_a_file_that_is_not_a_cost_curve_is_refused(tmp_path):
    bad = tmp_path / "tree.json"
    bad.write_text(json.dumps({"format": "treespec.tree", "choices": []}))
    with pytest.raises(ValueError, match="not a treespec cost curve"):
        load_cost_curve(bad)


def heads_with_acceptance(tmp_path, monkeypatch):
    """A tiny model and random heads saved with an acceptance table; the cache under tmp_path."""
    from conftest import random_heads

    monkeypatch.setenv("TREESPEC_CACHE", str(tmp_path / "cache"))
    model = tiny_model("llama", dtype=torch.float32)
    heads = random_heads(model, num_heads=3)
    folder = tmp_path / "heads"
    heads.save_pretrained(folder)
    table = [[0.6, 0.2, 0.1], [0.5, 0.2, 0.1], [0.4, 0.1, 0.05]]
    (folder / "acceptance.json").write_text(json.dumps({"acceptance": table}))
    return model, heads, folder


def test_machine_tree_prices_once_then_reuses_its_choice(tmp_path, monkeypatch):
    from treespec.training import calibrate
    from treespec.training.costs import machine_tree, machine_tree_file

    model, heads, folder = heads_with_acceptance(tmp_path, monkeypatch)
    tree, note = machine_tree(model, heads, folder, budgets=(2, 4, 8), repeats=1)
    assert tree.num_nodes in (2, 4, 8) and "priced on this machine" in note
    assert machine_tree_file(model, folder).is_file()

    def no_measuring(*args, **kwargs):
        raise AssertionError("the kept choice must be reused, not measured again")

    monkeypatch.setattr(calibrate, "forward_costs", no_measuring)
    again, _ = machine_tree(model, heads, folder, budgets=(2, 4, 8), repeats=1)
    assert again.choices == tree.choices
    # retrained heads (another acceptance table in the same folder) are priced again, not read back
    kept = machine_tree_file(model, folder)
    table = json.loads((folder / "acceptance.json").read_text())
    table["acceptance"][0][0] *= 0.5
    (folder / "acceptance.json").write_text(json.dumps(table))
    assert machine_tree_file(model, folder) != kept
    with pytest.raises(AssertionError, match="must be reused"):
        machine_tree(model, heads, folder, budgets=(2, 4, 8), repeats=1)


def test_heads_without_an_acceptance_table_keep_their_own_tree(tmp_path):
    from conftest import random_heads

    from treespec.training.costs import machine_tree

    model = tiny_model("llama", dtype=torch.float32)
    heads = random_heads(model, num_heads=3)
    tree, note = machine_tree(model, heads, tmp_path)
    assert tree is heads.tree and "no acceptance.json" in note


def test_verify_cost_model_reads_the_curve_of_the_path_that_runs(tmp_path):
    from treespec.training.costs import save_cost_curve, verify_cost_model

    model = tiny_model("llama", dtype=torch.float32)
    curve = tmp_path / "c.json"
    blocks = {"128": {"1": 10.0, "8": 26.0}, "1024": {"1": 20.0, "8": 60.0}}
    save_cost_curve(curve, {"format": "treespec.cost_curve", "verify_ms": {"blocks": blocks}})
    seconds = verify_cost_model(model, curve_file=curve)
    assert seconds(1, 100) == pytest.approx(0.010)
    assert seconds(4, 100) == pytest.approx((10.0 + 16.0 * 3 / 7) / 1e3)  # linear between 1 and 8
    assert seconds(8, 900) == pytest.approx(0.060)  # the nearest measured prefix
    with pytest.raises(ValueError, match="--paths compiled"):
        verify_cost_model(model, compile=True, curve_file=curve)  # a file the caller names: not measured
    with pytest.raises(ValueError, match="no cost curve"):
        verify_cost_model(model, curve_file=tmp_path / "missing.json")


def test_a_missing_curve_is_measured_once_on_first_use_then_read(tmp_path, monkeypatch):
    """No curve in an empty cache folder: verify_cost_model measures a quick one of the uncompiled path,
    says so, keeps it where default_cost_file looks and prices from it; the next call only reads it."""
    from treespec.training import costs

    monkeypatch.setenv("TREESPEC_CACHE", str(tmp_path / "cache"))
    model = tiny_model("llama", dtype=torch.float32)  # 512 positions: the 512 prefix is cut to fit
    file = costs.default_cost_file(model)
    assert file.is_relative_to(tmp_path / "cache") and not file.exists()
    measured, messages = [], []
    verify_ms = costs.verify_ms

    def counted(model, n, prefix, *args, **kwargs):
        measured.append((n, prefix, kwargs.get("linears"), kwargs.get("compile", False)))
        return verify_ms(model, n, prefix, *args, **kwargs)

    monkeypatch.setattr(costs, "verify_ms", counted)
    seconds = costs.verify_cost_model(model, progress=messages.append)
    nodes, prefixes = costs.quick_points(model)
    assert nodes == costs.QUICK_NODES and prefixes[0] == 128 and max(prefixes) + 2 * max(nodes) < 512
    # every point (and again any that noise priced above a costlier one)
    assert set(measured) == {(n, p, "auto", False) for n in nodes for p in prefixes}
    assert len(messages) == 1 and str(file) in messages[0] and "scripts/cost_curve.py" in messages[0]
    assert "--dtype float32 --paths native" in messages[0]  # the path a Llama decoder runs
    saved = costs.load_cost_curve(file)
    assert set(saved["verify_ms"]) == {"native"} and saved["model"] == model.config.name_or_path
    assert all(set(map(int, row)) == set(nodes) for row in saved["verify_ms"]["native"].values())
    table = [seconds(n, 300) for n in range(1, 70)]
    assert all(0 < s < 1 for s in table)  # seconds, from the measured rows
    assert seconds(64, 128) == pytest.approx(saved["verify_ms"]["native"]["128"]["64"] / 1e3)

    measured.clear()
    again = costs.verify_cost_model(model, progress=messages.append)
    assert measured == [] and len(messages) == 1  # read, not measured
    assert [again(n, 300) for n in range(1, 70)] == table


def test_a_curve_without_the_path_that_runs_gains_it_and_keeps_the_rest(tmp_path, monkeypatch):
    """bench --compile on a machine whose curve has only the uncompiled path: the compiled path is
    measured (quick points) and added beside what the file had."""
    from treespec.training import costs

    monkeypatch.setenv("TREESPEC_CACHE", str(tmp_path / "cache"))
    model = tiny_model("llama", dtype=torch.float32)
    blocks = {"128": {"1": 10.0, "8": 26.0}}
    costs.save_cost_curve(
        costs.default_cost_file(model), {"format": "treespec.cost_curve", "verify_ms": {"blocks": blocks}}
    )
    measured, messages = [], []
    monkeypatch.setattr(costs, "verify_ms", lambda model, n, prefix, **kw: measured.append(kw) or 5.0 * n)
    seconds = costs.verify_cost_model(model, compile=True, progress=messages.append)
    assert seconds(4, 100) == pytest.approx(0.020)
    assert measured and all(
        kw == {"repeats": costs.QUICK_REPEATS, **costs.PATHS["compiled"]} for kw in measured
    )
    assert len(messages) == 1 and "no 'compiled' path" in messages[0] and "--paths compiled" in messages[0]
    saved = costs.load_cost_curve(costs.default_cost_file(model))
    assert saved["verify_ms"]["blocks"] == blocks and "compiled" in saved["verify_ms"]
    assert costs.verify_cost_model(model, progress=messages.append)(8, 100) == pytest.approx(0.026)
    assert len(messages) == 1


def test_bitwise_numerics_price_trees_on_the_exact_kernels_they_run(tmp_path, monkeypatch):
    """Dynamic trees under numerics="bitwise" read (and on first use measure) the "exact" path, not the
    fast kernels' curve beside it; the measured points run the row-invariant kernels."""
    from treespec import ops
    from treespec.training import costs

    if not ops.available("cpu"):
        pytest.skip("treespec's compiled CPU ops did not build")
    monkeypatch.setenv("TREESPEC_CACHE", str(tmp_path / "cache"))
    model = tiny_model("llama", dtype=torch.float32)
    blocks = {"128": {"1": 10.0, "8": 26.0}}
    costs.save_cost_curve(
        costs.default_cost_file(model), {"format": "treespec.cost_curve", "verify_ms": {"blocks": blocks}}
    )
    assert costs.verify_paths(model, numerics="bitwise") == ["exact"]
    messages = []
    seconds = costs.verify_cost_model(model, numerics="bitwise", progress=messages.append)
    assert len(messages) == 1 and "no 'exact' path" in messages[0] and "--paths exact" in messages[0]
    saved = costs.load_cost_curve(costs.default_cost_file(model))
    assert saved["verify_ms"]["blocks"] == blocks
    exact = saved["verify_ms"]["exact"]["128"]
    assert seconds(8, 100) == pytest.approx(exact["8"] / 1e3)
    assert costs.verify_cost_model(model, progress=messages.append)(8, 100) == pytest.approx(0.026)
    assert len(messages) == 1  # both read, nothing measured again


def test_a_quick_curve_measures_again_the_points_noise_priced_above_costlier_ones(monkeypatch):
    from treespec.training import costs

    rows = {"128": {"1": 90.0, "4": 22.0, "8": 30.0}, "1024": {"1": 25.0, "4": 28.0, "8": 80.0}}
    assert costs.suspect_points(rows) == [(128, 1)]  # above 4 and 8 nodes, and above 1 node at 1024
    assert costs.suspect_points({"128": {"1": 10.0, "8": 11.0}, "1024": {"1": 11.5, "8": 12.0}}) == []
    first = {(128, 1): 90.0, (128, 4): 22.0, (1024, 1): 25.0, (1024, 4): 28.0}
    calls = []

    def fake(model, n, prefix, **kwargs):
        calls.append((prefix, n))
        return first[prefix, n] if len(calls) <= len(first) else 20.0

    monkeypatch.setattr(costs, "verify_ms", fake)
    curve = costs.quick_curve(tiny_model("llama", dtype=torch.float32), "blocks", (1, 4), (128, 1024))
    assert calls[len(first) :] == [(128, 1)]  # once: the second measurement fits
    assert curve["verify_ms"]["blocks"]["128"] == {"1": 20.0, "4": 22.0}


@pytest.mark.parametrize(
    "text",
    [
        "{not json",
        json.dumps({"format": "treespec.tree", "choices": []}),
        json.dumps({"format": "treespec.cost_curve", "verify_ms": {"blocks": {"128": {"x": 1.0}}}}),
        json.dumps({"format": "treespec.cost_curve", "verify_ms": {"blocks": {}}}),
    ],
)
def test_a_corrupt_curve_is_refused_and_left_as_it_is(tmp_path, monkeypatch, text):
    from treespec.training import costs

    monkeypatch.setenv("TREESPEC_CACHE", str(tmp_path / "cache"))
    model = tiny_model("llama", dtype=torch.float32)
    file = costs.default_cost_file(model)
    file.parent.mkdir(parents=True)
    file.write_text(text)

    def no_measuring(*args, **kwargs):
        raise AssertionError("a user's file is never measured over")

    monkeypatch.setattr(costs, "verify_ms", no_measuring)
    with pytest.raises(ValueError, match="is not a treespec cost curve") as refusal:
        costs.verify_cost_model(model)
    message = str(refusal.value)
    assert str(file) in message and "scripts/cost_curve.py" in message and "--dtype float32" in message
    assert file.read_text() == text


def test_timed_steps_run_with_the_model_mode_held_as_generate_holds_it(tmp_path, monkeypatch):
    """The step timings price what `generate` runs: the model switched into treespec's mode once, not
    switched in and out around every timed step."""
    from treespec.core.decoder import Decoder
    from treespec.training import calibrate

    model, heads, _ = heads_with_acceptance(tmp_path, monkeypatch)
    table = [[0.6, 0.2], [0.4, 0.1]]
    modes = []
    step = Decoder.step

    def watched(self):
        modes.append(model.config._attn_implementation)  # before the step's own switch
        return step(self)

    monkeypatch.setattr(Decoder, "step", watched)
    costs = calibrate.forward_costs(model, [2, 4], heads, prefix=20, repeats=2, table=table)
    assert set(costs) == {2, 4} and len(modes) == 2 * 3 and set(modes) == {"treespec"}
    assert model.config._attn_implementation != "treespec"  # stock again after the timings
