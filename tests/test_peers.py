"""The benchmark's vLLM peer: a clear message without vLLM's environment; the real engine when it is there."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest

from treespec.tools import bench
from treespec.tools.peers import PeerUnavailable, VllmPeer, vllm_python

VLLM_PYTHON = Path(
    os.environ.get("TREESPEC_VLLM_PYTHON", Path(__file__).parents[1] / ".venv-vllm/bin/python")
)


def start_vllm(*args, **kwargs) -> VllmPeer:
    """A VllmPeer, retried once: in some full test runs (3 of 6 clean-clone CIs, never alone) vLLM's engine
    failed to start in the second test that starts one; cause not found. The first failure's log goes to
    the warnings summary, so a run that passes still shows it."""
    try:
        return VllmPeer(*args, **kwargs)
    except PeerUnavailable as error:
        warnings.warn(f"vLLM did not start; retrying once. {error}", stacklevel=2)
        return VllmPeer(*args, **kwargs)


def test_a_missing_vllm_environment_says_how_to_make_one(tmp_path):
    with pytest.raises(PeerUnavailable, match="make vllm-env"):
        vllm_python(tmp_path / "nowhere" / "python")


def test_a_worker_that_dies_at_start_is_reported_with_its_log(tmp_path):
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho 'no vllm here' >&2\nexit 3\n")
    fake.chmod(0o755)
    log = tmp_path / "worker.log"
    with pytest.raises(PeerUnavailable, match="exited \\(code 3\\)"):
        VllmPeer(tmp_path, "float32", python=fake, log=log)
    assert "no vllm here" in log.read_text()


def test_a_worker_that_dies_at_start_without_a_log_file_is_quoted_in_the_error(tmp_path):
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho 'first line' >&2\necho 'no vllm here' >&2\nexit 3\n")
    fake.chmod(0o755)
    with pytest.raises(PeerUnavailable, match="(?s)exited \\(code 3\\).*first line\nno vllm here"):
        VllmPeer(tmp_path, "float32", python=fake)


def test_a_long_worker_log_is_quoted_from_its_first_error(tmp_path):
    fake = tmp_path / "python"
    noise = "".join(f"echo 'noise {i}' >&2\n" for i in range(40))
    tail = "".join(f"echo 'tail {i}' >&2\n" for i in range(80))
    fake.write_text(f"#!/bin/sh\n{noise}echo 'ERROR the root cause' >&2\n{tail}exit 1\n")
    fake.chmod(0o755)
    with pytest.raises(PeerUnavailable) as error:
        VllmPeer(tmp_path, "float32", python=fake)
    message = str(error.value)
    assert "ERROR the root cause" in message and "tail 79" in message and "..." in message
    assert "noise" not in message and "tail 40" not in message


def test_bench_knows_the_vllm_methods():
    args = bench.parse_args(["--methods", "hf,vllm,vllm_ngram", "--vllm-ngram", "3"])
    assert args.methods == ["hf", "vllm", "vllm_ngram"] and args.vllm_ngram == 3


@pytest.mark.integration
@pytest.mark.skipif(not VLLM_PYTHON.is_file(), reason="no vLLM environment (make vllm-env)")
def test_vllm_greedy_equals_treespec_plain_greedy_and_its_batches_answer_the_same(smollm2):
    import treespec
    from treespec.core.tokens import eos_token_ids
    from treespec.tools.models import default_model_folder

    model, tokenizer = smollm2
    ids = treespec.encode_prompt("Name three primary colors.", tokenizer)
    other = treespec.encode_prompt("What is 2+2? Answer with a number only.", tokenizer)  # ends early
    stop = eos_token_ids(model, tokenizer)
    peer = start_vllm(default_model_folder(), "float32", python=VLLM_PYTHON)
    try:
        theirs = peer.run(ids, 24)["token_ids"]
        batch = peer.run_batch([other, ids], 24, 0.0, None, stop)  # distillation answers
        sampled = [peer.run_batch([ids, other], 24, 0.9, seed, stop) for seed in (7, 7, 8)]
        name, sampled_name = peer.engine_name(), peer.engine_name(0.9)
    finally:
        peer.close()
    ours = treespec.generate(
        model, ids, tokenizer=tokenizer, max_new_tokens=24, sampling=treespec.SamplingConfig(temperature=0.0)
    )
    assert theirs == list(ours.token_ids)
    assert batch[1] == theirs
    short = treespec.generate(
        model,
        other,
        tokenizer=tokenizer,
        max_new_tokens=24,
        sampling=treespec.SamplingConfig(temperature=0.0),
    )
    assert batch[0][-1] in stop and batch[0] == list(short.token_ids)  # the stop token kept, as generate does
    # sampling follows the engine's seed, not each request's (the CPU build fails on per-request seeds):
    # three calls draw three samples, and the manifest's engine name says so
    assert len({str(answers) for answers in sampled}) > 1
    assert all(len(a) == 2 and all(0 < len(x) <= 24 for x in a) for a in sampled)
    assert name.startswith("vllm ") and "not per shard" in sampled_name and "not per shard" not in name


@pytest.mark.integration
@pytest.mark.skipif(not VLLM_PYTHON.is_file(), reason="no vLLM environment (make vllm-env)")
def test_vllm_serves_an_exported_eagle_drafter_without_changing_its_output(smollm2, tmp_path):
    """The EAGLE-3 export loads in vLLM's CPU build; its speculative greedy output equals treespec's plain
    greedy output, and vLLM counts the drafted tokens."""
    import torch

    import treespec
    from treespec.tools.export import export_eagle3
    from treespec.tools.models import default_model_folder

    model, tokenizer = smollm2
    draft = treespec.EagleDraftModel.for_model(
        model, torch.arange(2048)
    )  # untrained: the layout is the point
    folder = export_eagle3(draft, model, tmp_path / "eagle3", dtype=torch.float32)
    ids = treespec.encode_prompt("Name three primary colors.", tokenizer)
    peer = start_vllm(default_model_folder(), "float32", python=VLLM_PYTHON, draft=folder, draft_tokens=2)
    try:
        theirs = peer.run(ids, 16)["token_ids"]
        metrics = peer.spec_metrics()
    finally:
        peer.close()
    ours = treespec.generate(
        model, ids, tokenizer=tokenizer, max_new_tokens=16, sampling=treespec.SamplingConfig(temperature=0.0)
    )
    assert theirs == list(ours.token_ids)
    assert metrics["draft_tokens"] == 2 * metrics["drafts"] > 0
