"""The llama.cpp peer (llama-cpp-python in .venv-llamacpp, `make llamacpp-env`): a clear message without its
environment; with it, the worker's greedy answers, the bench's llamacpp methods and the demo's line.
The tests that need the environment skip without it (CI does not build it: the build takes minutes)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from conftest import load_script

from treespec.tools import bench
from treespec.tools.peers import LlamaCppPeer, PeerUnavailable, find_llamacpp_python, llamacpp_python

LLAMACPP_PYTHON = Path(
    os.environ.get("TREESPEC_LLAMACPP_PYTHON", Path(__file__).parents[1] / ".venv-llamacpp/bin/python")
)
needs_llamacpp = pytest.mark.skipif(
    not LLAMACPP_PYTHON.is_file(), reason="no llama.cpp environment (make llamacpp-env)"
)


def test_a_missing_llamacpp_environment_says_how_to_make_one(tmp_path, monkeypatch):
    nowhere = tmp_path / "nowhere" / "python"
    assert find_llamacpp_python(nowhere) is None
    with pytest.raises(PeerUnavailable, match="make llamacpp-env"):
        llamacpp_python(nowhere)
    with pytest.raises(PeerUnavailable, match="make llamacpp-env"):
        LlamaCppPeer(python=nowhere)
    monkeypatch.setenv("TREESPEC_LLAMACPP_PYTHON", str(nowhere))
    with pytest.raises(PeerUnavailable, match=f"no llama.cpp environment at {nowhere}"):
        LlamaCppPeer()


def test_a_llamacpp_worker_that_dies_at_start_is_reported_with_its_log(tmp_path):
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho 'no llama_cpp here' >&2\nexit 4\n")
    fake.chmod(0o755)
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(PeerUnavailable, match="(?s)llama.cpp worker exited \\(code 4\\).*no llama_cpp here"):
        LlamaCppPeer(gguf, python=fake)


def test_bench_knows_the_llamacpp_methods_for_the_default_model_only(capsys):
    args = bench.parse_args(["--methods", "hf,llamacpp,llamacpp_lookup", "--llamacpp-lookup", "6"])
    assert args.methods == ["hf", "llamacpp", "llamacpp_lookup"] and args.llamacpp_lookup == 6
    with pytest.raises(SystemExit) as info:
        bench.parse_args(["--methods", "hf,llamacpp", "--model", "some/other-model"])
    assert info.value.code == 2
    assert "default model" in capsys.readouterr().err


def test_the_first_difference_is_counted_and_shown(capsys):
    q = {"question_id": 1, "category": "c"}
    results = {
        "hf": {"token_ids": [1, 2, 3, 4], "seconds": 1.0},
        "llamacpp": {"token_ids": [1, 2, 9, 4], "seconds": 0.5},
        "llamacpp_lookup": {"token_ids": [1, 2, 3, 4], "seconds": 0.5},
    }
    methods = list(results)
    record = bench.make_record(q, [5, 6], results, methods)
    assert record["methods"]["llamacpp"]["first_diff"] == 2
    assert record["methods"]["llamacpp_lookup"]["first_diff"] is None
    summary = bench.summarize([record, record], methods)
    assert summary[-1]["methods"]["llamacpp"]["first_diff_mean"] == 2.0
    assert summary[-1]["methods"]["llamacpp_lookup"]["first_diff_mean"] is None
    table = bench.format_tables(summary, methods)
    assert "diff@(llamacpp)" in table and "diff@(llamacpp_lookup)" not in table


@pytest.mark.integration
@needs_llamacpp
def test_the_llamacpp_worker_answers_greedy_and_the_same_twice(smollm2):
    import treespec
    from treespec.core.tokens import eos_token_ids

    model, tokenizer = smollm2
    ids = treespec.encode_prompt("Name three primary colors.", tokenizer)
    short = treespec.encode_prompt("What is 2+2? Answer with a number only.", tokenizer)
    stop = eos_token_ids(model, tokenizer)
    answers = {}
    for lookup in (0, 4):
        peer = LlamaCppPeer(lookup=lookup, stop_token_ids=stop, python=LLAMACPP_PYTHON)
        try:
            first, again = peer.run(ids, 12), peer.run(ids, 12)
            # a conversation's next turn: the K/V of the shared prefix kept (llama-cpp-python's prefix match)
            turn = peer.run(ids + first["token_ids"] + short[1:], 8, keep_prefix=True)
            ended = peer.run(short, 24)
            info = peer.info
        finally:
            peer.close()
        assert info["ready"] and info["lookup"] == lookup and info["threads"] >= 1
        assert info["model"].endswith(".gguf") and info["llama_cpp_python"]
        assert first["token_ids"] == again["token_ids"]  # greedy, nothing kept from the call before
        assert 1 <= len(turn["token_ids"]) <= 8 and turn["seconds"] > 0
        assert len(first["token_ids"]) == 12 and first["seconds"] > 0
        vocab = model.get_output_embeddings().weight.shape[0]
        assert all(isinstance(t, int) and 0 <= t < vocab for t in first["token_ids"])
        assert not set(first["token_ids"][:-1]) & set(stop)
        # a short answer ends on the model's end token, kept at the end as HF keeps it
        assert ended["token_ids"][-1] in stop and len(ended["token_ids"]) < 24
        answers[lookup] = first["token_ids"]
    # the same GGUF weights as HF's float32 model, the same prompt ids (no BOS added): the answers start
    # alike (llama.cpp computes on the Q4_1 blocks with 8-bit activations, so they may part later)
    hf = bench.hf_greedy(model, tokenizer, ids, 12)
    assert answers[0][:3] == hf[:3] and answers[4][:3] == hf[:3]


@pytest.mark.integration
@needs_llamacpp
def test_bench_runs_the_llamacpp_methods(tmp_path, capsys):
    out = tmp_path / "b.json"
    argv = ["--num-prompts", "2", "--max-new-tokens", "16", "--dtype", "float32", "--out", str(out)]
    argv += ["--methods", "hf,llamacpp,llamacpp_lookup", "--llamacpp-python", str(LLAMACPP_PYTHON)]
    bench.main(argv)
    result = json.loads(out.read_text())
    assert len(result["prompts"]) == 2
    for p in result["prompts"]:
        for m in ("llamacpp", "llamacpp_lookup"):
            entry = p["methods"][m]
            assert 1 <= entry["new_tokens"] <= 16 and entry["tokens_per_second"] > 0
            assert entry["library_seconds"] > 0
            assert isinstance(entry["identical_to_hf"], bool)
            assert (entry["first_diff"] is None) == entry["identical_to_hf"]
    overall = result["summary"][-1]["methods"]
    for m in ("llamacpp", "llamacpp_lookup"):
        assert 0 <= overall[m]["identical_to_hf"] <= 2 and overall[m]["speedup"] > 0
        assert "first_diff_mean" in overall[m]
    peers = result["config"]["peers"]
    assert peers["llamacpp"]["lookup"] == 0 and peers["llamacpp_lookup"]["lookup"] == 10
    assert peers["llamacpp"]["threads"] == result["config"]["threads"]
    printed = capsys.readouterr().out
    assert "same(llamacpp)" in printed and "same(llamacpp_lookup)" in printed


@pytest.mark.integration
@needs_llamacpp
def test_the_demo_prints_the_llamacpp_line(capsys, monkeypatch):
    monkeypatch.setenv("TREESPEC_LLAMACPP_PYTHON", str(LLAMACPP_PYTHON))
    demo = load_script("demo")
    argv = ["--prompt", "Name three primary colors.", "--max-new-tokens", "8", "--dtype", "float32"]
    assert demo.main(argv) == 0
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if line.startswith("llama.cpp        :"))
    assert "tokens/s" in line and "x HF generate" in line
