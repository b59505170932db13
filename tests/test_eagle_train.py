"""Training the EAGLE-style draft layer: the loss falls, the drafter loads and decodes exactly, a killed
run resumes to the same weights, and the held-out chain acceptance counts what decoding would accept."""

from __future__ import annotations

import json
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
    # beside the weights: the record, the rank acceptance table and the best 16-node tree under it
    table = json.loads((root / "run" / "drafter" / "acceptance.json").read_text())["acceptance"]
    assert table == record["eval"]["rank_acceptance"] and len(table) == 5
    assert draft.tree == treespec.Tree.from_acceptance(table, 16)
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
    greedy = store["greedy"].unique()  # the target's tokens first, so that some guesses can be right
    others = torch.arange(0, model.config.vocab_size, 7)
    vocab = torch.cat([greedy, others[~torch.isin(others, greedy)]])[:300]
    draft = treespec.EagleDraftModel.for_model(model, vocab, feature_layers=layers).float()
    embed = model.get_input_embeddings().weight.detach().float()
    lm_draft = model.get_output_embeddings().weight.detach().float()[vocab]
    steps = 3
    ranks = len(vocab)  # every rank, so that an untrained drafter's guesses count too
    result = train_module.evaluate(draft, store, embed, lm_draft, steps, ranks=ranks)
    reached, anchors, ranked = [0] * (steps + 1), 0, [[0] * ranks for _ in range(steps)]
    starts, prompts = store["starts"], store["prompt_lengths"]
    with torch.no_grad():
        for i in range(len(starts) - 1):
            batch = train_module.make_batch(store, [i], layers, embed, lm_draft)
            outputs = draft.unrolled(batch["features"], batch["emb"], steps)
            n = int(starts[i + 1] - starts[i])
            for a in range(max(int(prompts[i]) - 2, 0), n - 2 - (steps - 1)):
                anchors += 1
                for j in range(steps):
                    logits = draft.logits(outputs[j][0, a + j])
                    order = draft.token_ids(logits.argsort(descending=True)).tolist()
                    truth = int(batch["greedy"][0, a + j])
                    if truth in order:
                        ranked[j][order.index(truth)] += 1
                    if order[0] != truth:
                        break
                    reached[j + 1] += 1
    assert result["anchors"] == anchors > 0
    expected = 1 + sum(r / anchors for r in reached[1:])
    assert result["expected_accept_length"] == pytest.approx(expected)
    by_chain = [1 + sum(r / anchors for r in reached[1 : k + 1]) for k in range(1, steps + 1)]
    assert result["expected_accept_length_by_chain"] == pytest.approx(by_chain)
    reached[0] = anchors
    rank_table = [[c / max(reached[j], 1) for c in row] for j, row in enumerate(ranked)]
    assert result["rank_acceptance"] == [pytest.approx(row) for row in rank_table]
    assert sum(map(sum, ranked)) > sum(reached[1:])  # some targets were guessed at ranks > 0


def test_a_new_round_starts_from_the_given_drafter_and_keeps_its_history(tiny_setup):
    """--init-from: round 2 starts from round 1's saved weights (0 steps: the same weights come out), its
    record lists both rounds, and a drafter of another shape is refused with what to pass instead."""
    root, model = tiny_setup
    first = train_eagle(_config(root, "round1"), model=model)
    again = train_eagle(
        _config(root, "round2", max_steps=0, init_from=str(root / "round1" / "drafter")), model=model
    )
    a = treespec.EagleDraftModel.from_pretrained(root / "round1" / "drafter")
    b = treespec.EagleDraftModel.from_pretrained(root / "round2" / "drafter")
    for (name, pa), (_, pb) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(pa, pb), name
    assert [r["steps"] for r in again["rounds"]] == [first["steps"], 0]
    assert again["rounds"][1]["init_from"] == str(root / "round1" / "drafter")
    # a third round reads round 2's record (the training.json beside its weights) and adds itself
    third = train_eagle(
        _config(root, "round3", max_steps=3, init_from=str(root / "round2" / "drafter")), model=model
    )
    assert [r["steps"] for r in third["rounds"]] == [first["steps"], 0, 3]
    with pytest.raises(ValueError, match="--draft-vocab-size"):
        train_eagle(
            _config(root, "bad", draft_vocab_size=64, init_from=str(root / "round1" / "drafter")), model=model
        )


def test_the_script_trains_and_reports(tiny_setup, capsys):
    root, _ = tiny_setup
    script = load_script("train_eagle")
    args = ["--data", str(root / "data"), "--out", str(root / "script"), "--model", str(root / "model")]
    args += ["--max-steps", "2", "--batch-tokens", "128", "--draft-vocab-size", "64", "--ttt-steps", "2"]
    assert script.main(args) == 0
    assert "expected accepted length" in capsys.readouterr().out
    assert (root / "script" / "drafter" / "model.safetensors").is_file()
