"""Training the EAGLE-style draft layer: the loss falls, the drafter loads and decodes exactly, a killed
run resumes to the same weights, and the held-out chain acceptance counts what decoding would accept."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import load_script, tiny_distill_setup

import treespec
from treespec.training import checkpoint
from treespec.training import eagle_train as train_module
from treespec.training.eagle_train import EagleTrainConfig, train_eagle


@pytest.fixture(scope="module")
def tiny_setup(tmp_path_factory):
    return tiny_distill_setup(tmp_path_factory.mktemp("eagle"), max_position_embeddings=512)


def _config(root: Path, out: str, **kw) -> EagleTrainConfig:
    base = dict(
        data=str(root / "data"),
        out=str(root / out),
        max_steps=12,
        batch_tokens=128,
        lr=5e-3,
        warmup_steps=2,
        ttt_steps=3,
        draft_vocab_size=128,
        eval_every=6,
        checkpoint_every=3,
        extra={"model": str(root / "model")},
    )
    return EagleTrainConfig(**{**base, **kw})


def test_training_lowers_the_loss_and_writes_a_drafter_that_decodes_exactly(tiny_setup):
    root, model = tiny_setup
    record = train_eagle(_config(root, "run", max_steps=30), model=model)
    losses = [e["loss"] for e in record["log"] if "loss" in e]
    assert losses[-1] < losses[0]
    assert len(record["eval"]["acceptance"]) == 5 and record["eval"]["anchors"] > 0
    draft = treespec.EagleDraftModel.from_pretrained(root / "run" / "drafter", model=model)
    assert draft.draft_vocab_size == 128 and draft.feature_layers == record["feature_layers"]
    drafter = treespec.EagleDrafter(draft, treespec.Tree.from_choices([[0], [1], [0, 0]]), model)
    prompt = [1, 2, 3, 4]
    res = treespec.generate(model, prompt, drafter, max_new_tokens=10, eos_token_id=[])
    plain = treespec.generate_baseline(model, prompt, max_new_tokens=10, eos_token_id=[])
    assert res.token_ids == plain.token_ids


class _Killed(Exception):
    pass


def test_a_killed_run_resumes_to_the_same_weights(tiny_setup, monkeypatch):
    root, model = tiny_setup
    train_eagle(_config(root, "straight"), model=model)
    real_save = checkpoint.save

    def save_then_die(folder, weights, optimizer, step, cfg, log, extra=None):
        real_save(folder, weights, optimizer, step, cfg, log, extra)
        if step == 6:
            raise _Killed

    monkeypatch.setattr(train_module.checkpoint, "save", save_then_die)
    with pytest.raises(_Killed):
        train_eagle(_config(root, "resumed"), model=model)
    monkeypatch.setattr(train_module.checkpoint, "save", real_save)
    train_eagle(_config(root, "resumed"), model=model, resume=True)
    a = treespec.EagleDraftModel.from_pretrained(root / "straight" / "drafter")
    b = treespec.EagleDraftModel.from_pretrained(root / "resumed" / "drafter")
    for (name, pa), (_, pb) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(pa, pb), name
    with pytest.raises(checkpoint.CheckpointError, match="other settings"):
        train_eagle(_config(root, "resumed", ttt_steps=2), model=model, resume=True)


def test_held_out_acceptance_counts_chains_like_decoding(tiny_setup):
    """The evaluation's chain counts against a direct per-anchor loop over the same unrolled outputs."""
    root, model = tiny_setup
    cfg = _config(root, "eval-check", max_steps=1)
    layers = treespec.drafters.eagle_model.default_feature_layers(model.config.num_hidden_layers)
    store = train_module.cached_features(model, cfg.data, Path(cfg.out) / "cache", "eval", layers, 512)
    vocab = torch.arange(0, model.config.vocab_size, 7)[:300]
    draft = treespec.EagleDraftModel.for_model(model, vocab, feature_layers=layers).float()
    embed = model.get_input_embeddings().weight.detach().float()
    lm_draft = model.get_output_embeddings().weight.detach().float()[vocab]
    steps = 3
    result = train_module.evaluate(draft, store, embed, lm_draft, steps)
    reached, anchors = [0] * (steps + 1), 0
    starts, prompts = store["starts"], store["prompt_lengths"]
    with torch.no_grad():
        for i in range(len(starts) - 1):
            batch = train_module.make_batch(store, [i], layers, embed, lm_draft)
            outputs = draft.unrolled(batch["features"], batch["emb"], steps)
            n = int(starts[i + 1] - starts[i])
            for a in range(max(int(prompts[i]) - 2, 0), n - 2 - (steps - 1)):
                anchors += 1
                for j in range(steps):
                    guess = int(draft.token_ids(draft.logits(outputs[j][0, a + j]).argmax()))
                    if guess != int(batch["greedy"][0, a + j]):
                        break
                    reached[j + 1] += 1
    assert result["anchors"] == anchors > 0
    expected = 1 + sum(r / anchors for r in reached[1:])
    assert result["expected_accept_length"] == pytest.approx(expected)


def test_the_script_trains_and_reports(tiny_setup, capsys):
    root, _ = tiny_setup
    script = load_script("train_eagle")
    args = ["--data", str(root / "data"), "--out", str(root / "script"), "--model", str(root / "model")]
    args += ["--max-steps", "2", "--batch-tokens", "128", "--draft-vocab-size", "64", "--ttt-steps", "2"]
    assert script.main(args) == 0
    assert "expected accepted length" in capsys.readouterr().out
    assert (root / "script" / "drafter" / "model.safetensors").is_file()
