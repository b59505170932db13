"""The cost curve (training.costs): measured on a tiny model, interpolated, saved and refused when foreign."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import tiny_model

from treespec.training.costs import cost_curve, interpolate, load_cost_curve, relative, save_cost_curve


def test_cost_curve_measures_every_point_and_round_trips(tmp_path):
    model = tiny_model("llama", dtype=torch.float32)
    curve = cost_curve(model, nodes=[1, 4, 8], prefixes=[16, 40], repeats=2)
    for path in ("eager", "packed"):
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
