"""The cost curve (training.costs): measured on a tiny model, interpolated, saved and refused when foreign."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import tiny_model

from treespec.training.costs import cost_curve, interpolate, load_cost_curve, relative, save_cost_curve


def test_cost_curve_measures_every_point_and_round_trips(tmp_path):
    model = tiny_model("llama", dtype=torch.float32)
    curve = cost_curve(
        model, nodes=[1, 4, 8], prefixes=[16, 40], paths=("eager", "onednn", "blocks"), repeats=2
    )
    for path in ("eager", "onednn", "blocks"):
        for prefix in ("16", "40"):
            row = curve["verify_ms"][path][prefix]
            assert set(row) == {"1", "4", "8"} and all(ms > 0 for ms in row.values())
        assert relative(curve, path, 16)[1] == 1.0
    save_cost_curve(tmp_path / "c.json", curve)
    assert load_cost_curve(tmp_path / "c.json") == json.loads(json.dumps(curve))


def test_interpolate_is_linear_between_measured_counts_and_clamped_outside():
    curve = {"verify_ms": {"packed": {"100": {"1": 10.0, "8": 24.0, "16": 40.0}, "900": {"1": 99.0}}}}
    assert interpolate(curve, "packed", 120, 4) == pytest.approx(10.0 + 14.0 * 3 / 7)
    assert interpolate(curve, "packed", 120, 12) == pytest.approx(32.0)
    assert interpolate(curve, "packed", 120, 64) == 40.0
    assert interpolate(curve, "packed", 800, 4) == 99.0  # the nearest measured prefix


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


def test_heads_without_an_acceptance_table_keep_their_own_tree(tmp_path):
    from conftest import random_heads

    from treespec.training.costs import machine_tree

    model = tiny_model("llama", dtype=torch.float32)
    heads = random_heads(model, num_heads=3)
    tree, note = machine_tree(model, heads, tmp_path)
    assert tree is heads.tree and "no acceptance.json" in note


def test_machine_tree_prices_verification_from_the_cost_curve_of_its_path(tmp_path, monkeypatch):
    from treespec.training import calibrate
    from treespec.training.costs import default_cost_file, machine_tree, machine_tree_file

    model, heads, folder = heads_with_acceptance(tmp_path, monkeypatch)

    def no_timed_steps(*args, **kwargs):
        raise AssertionError("with a cost curve of the path, verification comes from the curve")

    monkeypatch.setattr(calibrate, "forward_costs", no_timed_steps)
    # a second per verification whatever the node count on the compiled path (drafting is noise beside it):
    # the bigger tree wins; on the uncompiled path 8 nodes cost a hundred times more: the small one wins
    curve = {
        "format": "treespec.cost_curve",
        "verify_ms": {
            "compiled": {"300": {"1": 1000.0, "64": 1000.0}},
            "blocks": {"300": {"1": 1000.0, "2": 1000.0, "8": 100000.0}},
        },
    }
    save_cost_curve(default_cost_file(model), curve)
    flat, note = machine_tree(model, heads, folder, budgets=(2, 8), repeats=1, compile=True)
    assert flat.num_nodes == 8 and "compiled cost curve" in note
    steep, note = machine_tree(model, heads, folder, budgets=(2, 8), repeats=1, compile=False)
    assert steep.num_nodes == 2 and "blocks cost curve" in note
    assert machine_tree_file(model, folder, "compiled").is_file()
    assert machine_tree_file(model, folder, "blocks").is_file()


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
        verify_cost_model(model, compile=True, curve_file=curve)
    with pytest.raises(ValueError, match="no cost curve"):
        verify_cost_model(model, curve_file=tmp_path / "missing.json")


def test_timed_steps_run_with_the_model_mode_held_as_generate_holds_it(tmp_path, monkeypatch):
    """The step timings price what `generate` runs: the model switched into treespec's mode once, not
    switched in and out around every timed step."""
    from treespec.core.decoder import Decoder
    from treespec.training import calibrate
    from treespec.training.costs import step_costs

    model, heads, _ = heads_with_acceptance(tmp_path, monkeypatch)
    table = [[0.6, 0.2], [0.4, 0.1]]
    modes = []
    step = Decoder.step

    def watched(self):
        modes.append(model.config._attn_implementation)  # before the step's own switch
        return step(self)

    monkeypatch.setattr(Decoder, "step", watched)
    curve = {"verify_ms": {"blocks": {"300": {"1": 10.0, "8": 20.0}}}}
    costs = step_costs(model, heads, table, [2, 4], curve, "blocks", prefix=20, repeats=2)
    assert set(costs) == {2, 4} and all(seconds > 0 for seconds in costs.values())
    assert len(modes) == 2 * 3 and set(modes) == {"treespec"}
    modes.clear()
    costs = calibrate.forward_costs(model, [2, 4], heads, prefix=20, repeats=2, table=table)
    assert set(costs) == {2, 4} and len(modes) == 2 * 3 and set(modes) == {"treespec"}
    assert model.config._attn_implementation != "treespec"  # stock again after the timings


def test_a_noisy_curve_never_prices_fewer_nodes_above_more(tmp_path, monkeypatch):
    from treespec.training.costs import interpolate_monotone, step_costs

    noisy = {"128": {"1": 41.5, "2": 30.1, "4": 36.9, "8": 50.6, "24": 170.0, "32": 161.5}}
    curve = {"verify_ms": {"blocks": noisy}}
    assert interpolate_monotone(curve, "blocks", 300, 1) == 30.1  # 1 node measured above 2
    assert interpolate_monotone(curve, "blocks", 300, 3) == pytest.approx(33.5)  # between 2 and 4
    assert interpolate_monotone(curve, "blocks", 300, 8) == 50.6
    assert interpolate_monotone(curve, "blocks", 300, 24) == 161.5  # 24 measured above 32
    assert interpolate_monotone(curve, "blocks", 300, 64) == 161.5
    # the tree pricing reads it: 2 nodes are not priced at the 1,000 ms that noise put there
    model, heads, _ = heads_with_acceptance(tmp_path, monkeypatch)
    table = [[0.6, 0.2, 0.1], [0.5, 0.2, 0.1], [0.4, 0.1, 0.05]]
    steep = {"verify_ms": {"blocks": {"300": {"1": 1000.0, "2": 1000.0, "8": 100.0}}}}
    costs = step_costs(model, heads, table, [2, 8], steep, "blocks", prefix=20, repeats=1)
    assert costs[2] < 0.5 and costs[8] < 0.5
