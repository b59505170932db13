"""Draft models: truncation of the target, distillation training, checkpoints and resume, the script."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import load_script, tiny_distill_setup, tiny_llama_over, tiny_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from treespec.training import draft_train
from treespec.training.batching import length_batches
from treespec.training.distill import load_distill_data
from treespec.training.draft_train import (
    BatchPlan,
    DraftTrainConfig,
    make_batch,
    train_draft_model,
    truncate_model,
)

# -- truncation ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "arch,overrides",
    [
        ("llama", {}),
        ("llama", {"tie_word_embeddings": True}),
        ("qwen2", {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 2}),
        ("mistral", {}),
    ],
)
@pytest.mark.parametrize("k", [1, 3])
def test_truncation_keeps_the_first_layers(arch, overrides, k):
    target = tiny_model(arch, num_hidden_layers=4, **overrides)
    draft = truncate_model(target, k)
    assert type(draft) is type(target) and draft.dtype == target.dtype and not draft.training
    assert draft.config.num_hidden_layers == k and len(draft.model.layers) == k
    assert target.config.num_hidden_layers == 4 and len(target.model.layers) == 4  # target untouched
    if getattr(target.config, "layer_types", None) is not None:
        assert draft.config.layer_types == target.config.layer_types[:k]
    tied = draft.get_output_embeddings().weight is draft.get_input_embeddings().weight
    assert tied == bool(overrides.get("tie_word_embeddings", False))

    ids = torch.randint(0, target.config.vocab_size, (2, 9))  # [B, T]
    with torch.no_grad():
        t_out = target(ids, output_hidden_states=True)
        d_out = draft(ids, output_hidden_states=True)
    # hidden_states[j] is the state after layer j (0: embeddings); the last entry is after the final norm
    assert len(d_out.hidden_states) == k + 1
    for j in range(k):
        torch.testing.assert_close(d_out.hidden_states[j], t_out.hidden_states[j], rtol=0, atol=0)
    normed = target.model.norm(t_out.hidden_states[k])  # [B, T, H]: the target's layer-k state, normed
    torch.testing.assert_close(d_out.hidden_states[k], normed)
    torch.testing.assert_close(d_out.logits, target.lm_head(normed))

    with torch.no_grad():  # copies, not shared tensors
        draft.model.layers[0].mlp.down_proj.weight.add_(1.0)
        draft.get_input_embeddings().weight.add_(1.0)
    assert not torch.equal(
        draft.model.layers[0].mlp.down_proj.weight, target.model.layers[0].mlp.down_proj.weight
    )
    assert not torch.equal(draft.get_input_embeddings().weight, target.get_input_embeddings().weight)


@pytest.mark.parametrize("bad", [0, 4, 5, -1, 2.0, True])
def test_bad_num_layers_is_refused(bad):
    target = tiny_model("llama", num_hidden_layers=4)
    with pytest.raises(ValueError, match=r"num_layers must be an integer in \[1, 4\)"):
        truncate_model(target, bad)


def test_a_model_without_decoder_layers_is_refused():
    with pytest.raises(TypeError, match="model.layers"):
        truncate_model(torch.nn.Linear(2, 2), 1)


# -- batches ---------------------------------------------------------------------------------------------


def test_batches_target_the_response_tokens_only():
    seqs = [torch.arange(10, 16), torch.arange(20, 24)]  # prompts: 4 and 2 tokens
    ids, targets = make_batch(seqs, [4, 2])
    assert ids.tolist() == [[10, 11, 12, 13, 14, 15], [20, 21, 22, 23, 0, 0]]
    assert targets.tolist() == [[-100, -100, -100, 14, 15, -100], [-100, 22, 23, -100, -100, -100]]


def test_length_batches_sort_and_cap_rows_or_padded_tokens():
    lengths = [5, 3, 9, 3, 40, 7]
    assert length_batches(lengths, max_rows=2) == [[1, 3], [0, 5], [2, 4]]  # by (length, index)
    assert length_batches(lengths, max_tokens=20) == [[1, 3, 0], [5, 2], [4]]  # 40 > 20: alone
    assert length_batches(lengths, max_tokens=20, max_rows=2) == [[1, 3], [0, 5], [2], [4]]
    assert length_batches(lengths, max_tokens=100, order=[4, 2, 0]) == [[0, 2], [4]]
    assert length_batches([], max_rows=3) == []
    with pytest.raises(ValueError, match=">= 1"):
        length_batches(lengths, max_rows=0)


def test_batch_plan_is_seeded_and_covers_every_sequence_once_per_epoch():
    lengths = [int(x) for x in torch.randint(5, 60, (100,), generator=torch.Generator().manual_seed(0))]
    plan = BatchPlan(lengths, batch_tokens=200, seed=3, pool=16)
    for e in range(2):
        epoch = plan.epoch(e)
        assert sorted(i for b in epoch for i in b) == list(range(100))
        assert all(len(b) * max(lengths[i] for i in b) <= 200 for b in epoch)
    n0 = len(plan.epoch(0))
    assert plan.batch(n0) == plan.epoch(1)[0]
    again = BatchPlan(lengths, batch_tokens=200, seed=3, pool=16)
    assert [again.batch(s) for s in range(n0 + 5)] == [plan.batch(s) for s in range(n0 + 5)]
    assert BatchPlan(lengths, 200, seed=4, pool=16).epoch(0) != plan.epoch(0)


# -- training --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_setup(tmp_path_factory):
    """A tiny random 4-layer Llama over the SmolLM2 vocabulary (tied, like SmolLM2), saved as a folder
    with its tokenizer, and its self-distillation data."""
    return tiny_distill_setup(tmp_path_factory.mktemp("draft"), num_hidden_layers=4)


def _config(root: Path, out: str, **kw) -> DraftTrainConfig:
    base = dict(
        data=str(root / "data"),
        out=str(root / out),
        num_layers=2,
        lr=1e-2,
        warmup_steps=2,
        max_steps=16,
        batch_tokens=160,
        eval_every=8,
        checkpoint_every=4,
        bf16=False,
        extra={"model": str(root / "model")},
    )
    return DraftTrainConfig(**{**base, **kw})


def test_training_lowers_the_loss_and_writes_a_loadable_model(tiny_setup):
    root, model = tiny_setup
    record = train_draft_model(_config(root, "run"), target_model=model)
    history = record["eval_history"]
    assert [e["step"] for e in history] == [0, 8, 16]
    assert history[-1]["loss"] < history[0]["loss"]
    assert record["eval_top1"] == history[-1]["top1"] and history[-1]["positions"] > 0
    assert json.loads((root / "run" / "training.json").read_text())["steps"] == 16

    folder = root / "run" / "model"
    assert (folder / "model.safetensors").is_file() and not list(folder.glob("*.bin"))
    draft = AutoModelForCausalLM.from_pretrained(folder)
    assert draft.config.num_hidden_layers == 2 and draft.dtype == torch.float32
    # the embedding / output layer are frozen (tied, equal to the target's); the layers were trained
    assert draft.lm_head.weight is draft.model.embed_tokens.weight
    torch.testing.assert_close(
        draft.model.embed_tokens.weight, model.model.embed_tokens.weight, rtol=0, atol=0
    )
    assert not torch.equal(draft.model.layers[0].mlp.up_proj.weight, model.model.layers[0].mlp.up_proj.weight)
    # the saved eval top-1 is what the loaded model scores on the eval split
    data = load_distill_data(root / "data", "eval")
    again = draft_train.evaluate_draft(draft, data.sequences, data.prompt_lengths)
    assert again["top1"] == pytest.approx(record["eval_top1"])


class _Killed(Exception):
    pass


def test_resume_gives_the_weights_of_an_uninterrupted_run(tiny_setup, monkeypatch):
    root, model = tiny_setup
    straight = train_draft_model(_config(root, "straight"), target_model=model)

    real_save = draft_train.save_checkpoint

    def save_then_die(folder, draft, optimizer, step, cfg, log, target):
        real_save(folder, draft, optimizer, step, cfg, log, target)
        if step == 8:
            raise _Killed  # the process dies right after its step-8 checkpoint

    monkeypatch.setattr(draft_train, "save_checkpoint", save_then_die)
    with pytest.raises(_Killed):
        train_draft_model(_config(root, "resumed"), target_model=model)
    monkeypatch.setattr(draft_train, "save_checkpoint", real_save)
    assert json.loads((root / "resumed" / "checkpoint" / "state.json").read_text())["step"] == 8
    resumed = train_draft_model(_config(root, "resumed"), target_model=model, resume=True)
    assert resumed["steps"] == straight["steps"] == 16
    a = AutoModelForCausalLM.from_pretrained(root / "straight" / "model").state_dict()
    b = AutoModelForCausalLM.from_pretrained(root / "resumed" / "model").state_dict()
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=0, msg=name)

    with pytest.raises(ValueError, match="other settings.*lr"):
        train_draft_model(_config(root, "resumed", lr=5e-3), target_model=model, resume=True)
    other = tiny_llama_over(AutoTokenizer.from_pretrained(root / "model"), seed=1, num_hidden_layers=4)
    with pytest.raises(ValueError, match="made by"):  # data of another model
        train_draft_model(_config(root, "other"), target_model=other.float())


def test_script_writes_a_model_and_tokenizer_that_load_offline(tiny_setup, monkeypatch, tmp_path):
    root, _ = tiny_setup
    script = load_script("make_draft_model")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "draft"
    argv = ["--data", str(root / "data"), "--out", str(out), "--model", str(root / "model")]
    argv += [
        "--num-layers",
        "1",
        "--max-steps",
        "3",
        "--batch-tokens",
        "160",
        "--no-bf16",
        "--eval-sequences",
        "2",
    ]
    assert script.main(argv) == 0
    draft = AutoModelForCausalLM.from_pretrained(out / "model")
    tokenizer = AutoTokenizer.from_pretrained(out / "model")
    assert draft.config.num_hidden_layers == 1
    ids = tokenizer("Hello there", return_tensors="pt").input_ids
    assert draft(ids).logits.shape == (1, ids.shape[1], len(tokenizer))
    assert json.loads((out / "training.json").read_text())["eval_sequences"] == 2
