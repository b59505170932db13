"""Smoke test of scripts/bench.py on the embedded model: tiny settings, float32, exact match with HF."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench.py"


def load_bench():
    """scripts/ is not a package: import bench.py from its path."""
    spec = importlib.util.spec_from_file_location("bench_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.integration
def test_bench_smoke(tmp_path, capsys):
    bench = load_bench()
    out = tmp_path / "b.json"
    argv = ["--num-prompts", "2", "--max-new-tokens", "8", "--dtype", "float32"]
    methods = ["hf", "baseline", "treespec", "lookup", "treespec_lookup"]
    bench.main([*argv, "--out", str(out), "--methods", ",".join(methods), "--lookup", "4"])

    result = json.loads(out.read_text())
    prompts = result["prompts"]
    assert len(prompts) == 2
    assert [p["category"] for p in prompts] == ["writing", "roleplay"]  # round-robin over categories
    assert [row["category"] for row in result["summary"]] == ["writing", "roleplay", "overall"]
    for p in prompts:
        assert set(p["methods"]) == set(methods)
        assert 1 <= p["methods"]["hf"]["new_tokens"] <= 8
        for m in methods[1:]:
            assert p["methods"][m]["identical_to_hf"], (m, p)
    overall = result["summary"][-1]["methods"]
    assert overall["treespec"]["identical_to_hf"] == 2
    assert overall["treespec"]["accept_length"] >= 1.0
    assert overall["hf"]["speedup"] == pytest.approx(1.0)
    assert overall["treespec_lookup"]["accept_length"] >= 1.0
    printed = capsys.readouterr().out
    assert "same(treespec)" in printed and "accept(treespec_lookup)" in printed
    assert result["config"]["lookup"] == 4
