"""scripts/device_timing.py on the CPU (--smoke: tiny shapes): the JSON the device run writes and the
benchmarks page reads, and the projection's arithmetic. The CUDA paths (CUDA events, flash-attn, the
real shapes) run only on the device machine."""

from __future__ import annotations

import json

import pytest
from conftest import load_script

from treespec import ops

timing = load_script("device_timing")


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    """One smoke run (SmolLM2's family, tiny; node counts 1 and 16 at one prefix): (result, JSON file)."""
    if not ops.available("cpu"):
        pytest.skip(f"compiled extension unavailable: {ops.build_info()['error']}")
    out = tmp_path_factory.mktemp("device_timing") / "device_timing.json"
    argv = ["--device", "cpu", "--smoke", "--models", "smollm2", "--model-nodes", "1,16", "--out", str(out)]
    return timing.main(argv), out


def test_smoke_run_writes_the_format_the_page_reads(smoke_run):
    result, out = smoke_run
    data = json.loads(out.read_text())
    assert data == json.loads(json.dumps(result))
    assert (data["format"], data["version"], data["smoke"], data["device"]) == (
        "treespec.device_timing",
        1,
        True,
        "cpu",
    )
    assert {"torch", "cuda", "build", "kernel_rows", "copy_gbps", "models", "projection"} <= set(data)
    assert data["build"]["ok"] and data["copy_gbps"] > 0 and data["model_errors"] == {}

    rows = data["kernel_rows"]
    assert {(r["shape"], r["n"]) for r in rows} == {(s, n) for s in ("smollm2", "7b") for n in (1, 8)}
    for row in rows:
        assert all(row[key] > 0 for key in ("treespec", "sdpa_float", "sdpa_bool", "kv_gbps"))

    (model,) = data["models"]
    assert model["name"] == "smollm2" and model["config"]["num_attention_heads"] == 9
    assert model["auto_kernel"] == "compiled" and set(model["verify_ms"]) == {"sdpa", "compiled"}
    for kernel, rows_by_prefix in model["verify_ms"].items():
        assert list(rows_by_prefix) == ["32"] and list(rows_by_prefix["32"]) == ["1", "16"]
        assert all(ms > 0 for ms in rows_by_prefix["32"].values())
        ratio = model["verify_ratio"][kernel]["32"]["16"]
        assert ratio == pytest.approx(rows_by_prefix["32"]["16"] / rows_by_prefix["32"]["1"])
    hf = model["hf_generate"]
    assert hf["ms_one"] > 0 and hf["ms_all"] > 0
    assert hf["ms_per_token"] == pytest.approx((hf["ms_all"] - hf["ms_one"]) / (hf["new_tokens"] - 1))


def test_smoke_projection_is_acceptance_over_the_measured_verification(smoke_run):
    data = json.loads(smoke_run[1].read_text())
    projection = data["projection"]
    assert "not a measured GPU run" in projection["label"]
    (model,) = data["models"]
    curve = model["verify_ms"][model["auto_kernel"]]["32"]  # the only prefix: nearest to any context
    methods = {m["method"]: m for m in projection["acceptance"]["methods"]}
    assert methods and all(m["accept_length"] > 1 and m["nodes_per_step"] > 1 for m in methods.values())
    row = projection["rows"][0]
    method = methods[row["method"]]
    # by hand: verification ms linear between the measured 1 and 16 nodes, at the method's nodes per step
    nodes = method["nodes_per_step"]
    assert 1 < nodes <= 16
    step_ms = curve["1"] + (curve["16"] - curve["1"]) * (nodes - 1) / 15
    tokens_per_second = method["accept_length"] / (step_ms / 1e3)
    assert row["verify_ms"] == pytest.approx(step_ms)
    assert row["projected_tokens_per_second"] == pytest.approx(tokens_per_second)
    assert row["vs_one_token_steps"] == pytest.approx(tokens_per_second / (1e3 / curve["1"]))
    hf_ms = model["hf_generate"]["ms_per_token"]
    if hf_ms > 0:
        assert row["vs_hf_generate"] == pytest.approx(tokens_per_second * hf_ms / 1e3)


def test_projection_picks_the_prefix_nearest_the_benchmarks_context():
    models = [
        {
            "label": "a shape",
            "auto_kernel": "sdpa",
            "verify_ms": {"sdpa": {"128": {"1": 10.0, "16": 12.0}, "1024": {"1": 20.0, "16": 30.0}}},
            "hf_generate": {"ms_per_token": 20.0},
        },
        {"label": "failed", "auto_kernel": "sdpa", "verify_ms": {}},  # no curve: no projection
    ]
    acceptance = {
        "file": "x.json",
        "context": 241,
        "methods": [{"method": "dynamic", "accept_length": 2.5, "nodes_per_step": 8.5}],
    }
    result = timing.projection(models, acceptance)
    (row,) = result["rows"]
    assert row["verify_ms"] == pytest.approx(11.0)  # prefix 128: 10 + 2 * 7.5 / 15
    assert row["projected_tokens_per_second"] == pytest.approx(2.5 / 11e-3)
    assert row["vs_one_token_steps"] == pytest.approx(2.5 / 1.1)
    assert row["vs_hf_generate"] == pytest.approx(2.5 / 11e-3 * 0.02)
    assert "prefix 128" in result["label"] and "not a measured GPU run" in result["label"]


def test_default_acceptance_file_holds_the_shipped_drafters():
    acceptance = timing.read_acceptance(timing.REPO_ROOT / timing.DEFAULT_ACCEPTANCE)
    assert acceptance["file"] == timing.DEFAULT_ACCEPTANCE
    assert acceptance["context"] > 128
    methods = {m["method"]: m for m in acceptance["methods"]}
    assert "dynamic" in methods and "baseline" not in methods  # one-token methods are not projected
    assert all(m["accept_length"] > 1 for m in methods.values())


def test_smoke_shapes_keep_each_familys_heads():
    label, sizes = timing.model_config("llama-8b", smoke=True)
    assert "tiny" in label and sizes["num_hidden_layers"] == timing.SMOKE_LAYERS
    assert (sizes["num_attention_heads"], sizes["num_key_value_heads"]) == (32, 8)
    assert sizes["tie_word_embeddings"] is False
    assert timing.model_config("llama-8b", smoke=False)[1]["hidden_size"] == 4096
