"""Smoke test of scripts/bench_kernel.py: a one-configuration grid, and the roofline arithmetic."""

from __future__ import annotations

import json

import pytest
from conftest import load_script

from treespec import ops


def test_roofline_figures():
    bench = load_script("bench_kernel")
    row = {
        "flops": 2e9,
        "ms": {"sdpa_mask": 30.0, "treespec": 20.0},
        "kv_bytes": 1e7,
        "gflops": 100.0,
        "kv_gbps": 0.5,
        "gemm_gflops": 200.0,
    }
    r = bench.add_roofline(row, copy_gbps=5.0)
    # the products alone at 200 GFLOP/s take 10 ms: SDPA (30 ms) can be beaten by 3x at most
    assert r["ceiling_vs_sdpa"] == pytest.approx(3.0)
    assert r["of_gemm"] == pytest.approx(0.5)
    assert r["kv_of_memcpy"] == pytest.approx(0.1)
    assert r["ceiling_kv_of_memcpy"] == pytest.approx(1e7 / 10e-3 / 1e9 / 5.0)  # 1 GB/s of 5


def test_bench_kernel_smoke(tmp_path, capsys):
    if not ops.load():
        pytest.skip(f"compiled extension unavailable: {ops.build_info()['error']}")
    bench = load_script("bench_kernel")
    out = tmp_path / "k.json"
    argv = ["--shapes", "smollm2", "--prefixes", "128", "--trees", "16", "--dtypes", "float32"]
    bench.main([*argv, "--repeats", "2", "--out", str(out)])
    result = json.loads(out.read_text())
    (row,) = result["kernel"]
    assert row["max_abs_err"] < 2e-5  # the op against the reference on this run's inputs
    assert row["gemm_gflops"] > 0 and row["ms"]["gemm"] > 0
    assert row["ceiling_vs_sdpa"] > 0 and row["ceiling_kv_of_memcpy"] > 0
    assert any("GEMM-rate ceiling" in line for line in result["targets"])
    assert "| ceiling vs sdpa |" in capsys.readouterr().out
