"""Head training: examples, loss, checkpoints and resume, and DDP under `accelerate launch`."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from conftest import tiny_distill_setup
from safetensors.torch import load_file, save_file

import treespec
from treespec.training import checkpoint as ckpt
from treespec.training import heads_train as train_module
from treespec.training.heads_train import TrainConfig, head_examples, heads_loss, train_heads

ROOT = Path(__file__).resolve().parents[1]


def test_head_examples_align_targets():
    seq = torch.arange(10, 20)  # tokens 10..19; prompt = first 4
    hidden = torch.arange(10, dtype=torch.float32)[:, None].repeat(1, 3)  # [10, 3]: row t holds t
    x, y = head_examples([hidden], [seq], [4], num_heads=3)
    assert x[:, 0].tolist() == list(range(3, 9))  # t = last prompt token .. T-2
    assert y[0].tolist() == [14, 15, 16, 17]  # t=3: tokens t+1 .. t+1+K (head k targets column k+1)
    assert y[-1].tolist() == [19, -100, -100, -100]  # t=8: t+2 is past the end


def test_loss_weights_heads_by_decay():
    logits = torch.randn(2, 5, 7)
    targets = torch.randint(0, 7, (5, 2))
    total, per_head = heads_loss(logits, targets, decay=0.5)
    assert total.item() == pytest.approx(per_head[0] + 0.5 * per_head[1], rel=1e-5)


@pytest.fixture(scope="module")
def tiny_setup(tmp_path_factory):
    """A tiny random Llama over the SmolLM2 vocabulary, saved as a folder, and its distillation data."""
    return tiny_distill_setup(tmp_path_factory.mktemp("train"), max_position_embeddings=512)


def _config(root: Path, out: str, **kw) -> TrainConfig:
    base = dict(
        data=str(root / "data"),
        out=str(root / out),
        num_heads=3,
        lr=1e-2,
        warmup_steps=2,
        max_steps=16,
        batch_size=32,
        eval_every=8,
        checkpoint_every=4,
        bf16=False,
        extra={"model": str(root / "model")},
    )
    return TrainConfig(**{**base, **kw})


def test_training_lowers_the_loss_and_writes_loadable_heads(tiny_setup):
    root, model = tiny_setup
    record = train_heads(_config(root, "run"), model=model)
    losses = [e["loss"] for e in record["log"] if "loss" in e]
    assert losses[-1] < losses[0]
    assert len(record["eval"]["top1"]) == 3
    heads = treespec.MedusaHeads.from_pretrained(root / "run" / "heads", model=model)
    assert heads.num_heads == 3
    res = treespec.generate(model, [1, 2, 3], heads, max_new_tokens=8, eos_token_id=[])
    assert len(res.token_ids) == 8


def test_sequential_heads_with_a_draft_vocabulary_train_and_load(tiny_setup):
    root, model = tiny_setup
    cfg = _config(root, "hydra", sequential=True, draft_vocab_size=128)
    record = train_heads(cfg, model=model)
    losses = [e["loss"] for e in record["log"] if "loss" in e]
    assert losses[-1] < losses[0]
    heads = treespec.MedusaHeads.from_pretrained(root / "hydra" / "heads", model=model)
    assert heads.sequential and heads.draft_vocab_size == 128
    # the draft vocabulary is the most frequent answer tokens of the training split
    expected = train_module.draft_vocabulary(root / "data", 128, model.config.vocab_size)
    assert torch.equal(heads.draft_vocab, expected)
    data = treespec.training.distill.load_distill_data(root / "data", "train")
    answer_tokens = torch.cat([s[p:] for s, p in zip(data.sequences, data.prompt_lengths, strict=True)])
    most_common = torch.bincount(answer_tokens).argmax()
    assert most_common in heads.draft_vocab[:1]
    prompt = [1, 2, 3]
    res = treespec.generate(model, prompt, heads, max_new_tokens=8, eos_token_id=[])
    plain = treespec.generate_baseline(model, prompt, max_new_tokens=8, eos_token_id=[])
    assert res.token_ids == plain.token_ids


class _Killed(Exception):
    pass


def test_resume_continues_from_the_checkpoint(tiny_setup, monkeypatch):
    root, model = tiny_setup
    straight = train_heads(_config(root, "straight"), model=model)

    real_save = train_module.checkpoint.save

    def save_then_die(folder, tensors, optimizer, step, cfg, log, **kwargs):
        real_save(folder, tensors, optimizer, step, cfg, log, **kwargs)
        if step == 8:
            raise _Killed  # the process dies right after its step-8 checkpoint

    monkeypatch.setattr(train_module.checkpoint, "save", save_then_die)
    with pytest.raises(_Killed):
        train_heads(_config(root, "resumed"), model=model)
    monkeypatch.setattr(train_module.checkpoint, "save", real_save)
    resumed = train_heads(_config(root, "resumed"), model=model, resume=True)
    a = treespec.MedusaHeads.from_pretrained(root / "straight" / "heads")
    b = treespec.MedusaHeads.from_pretrained(root / "resumed" / "heads")
    for (name, pa), (_, pb) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        torch.testing.assert_close(pa, pb, msg=name)
    assert resumed["steps"] == straight["steps"] == 16
    with pytest.raises(ValueError, match="other settings"):
        train_heads(_config(root, "resumed", lr=5e-3), model=model, resume=True)


@pytest.mark.skipif(
    shutil.which("accelerate") is None and not (Path(sys.executable).parent / "accelerate").exists(),
    reason="accelerate's launcher is not installed",
)
def test_ddp_under_accelerate_launch(tiny_setup, tmp_path):
    root, _ = tiny_setup
    launcher = Path(sys.executable).parent / "accelerate"
    out = tmp_path / "ddp"
    cmd = [
        str(launcher) if launcher.exists() else "accelerate",
        "launch",
        "--multi_gpu",  # torchrun processes; on a CPU torch they use gloo (`--cpu` alone runs one)
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        str(ROOT / "scripts" / "train_heads.py"),
        "--data",
        str(root / "data"),
        "--out",
        str(out),
        "--model",
        str(root / "model"),
        "--num-heads",
        "3",
        "--max-steps",
        "12",
        "--batch-size",
        "32",
        "--lr",
        "1e-2",
        "--warmup-steps",
        "2",
        "--eval-every",
        "6",
        "--checkpoint-every",
        "6",
        "--no-bf16",
        "--sequential",
        "--draft-vocab-size",
        "256",
        "--threads",
        "1",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = [json.loads((out / f"rank-{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["sha256"] == ranks[1]["sha256"]  # both processes end with identical heads
    record = json.loads((out / "training.json").read_text())
    assert record["processes"] == 2
    losses = [e["loss"] for e in record["log"] if "loss" in e]
    assert losses[-1] < losses[0]


def test_an_exit_head_trains_on_a_lower_layer_and_drafts_exactly(tiny_setup):
    root, model = tiny_setup
    cfg = _config(root, "exit", num_heads=1, exit_layer=1, draft_vocab_size=128)
    record = train_heads(cfg, model=model)
    losses = [e["loss"] for e in record["log"] if "loss" in e]
    assert losses[-1] < losses[0]
    head = treespec.MedusaHeads.from_pretrained(root / "exit" / "heads", model=model)
    assert head.exit_layer == 1 and head.num_heads == 1
    # the examples pair the layer-1 state at position t+1 with the token right after it (x_{t+2})
    data = treespec.training.distill.load_distill_data(root / "data", "eval")
    seq, p = data.sequences[0], data.prompt_lengths[0]
    x, y = train_module.cached_examples(model, root / "data", root / "exit" / "cache", "eval", 1, 4096, 1)
    states = treespec.drafters.self_spec.layer_hidden_states(model, seq[None], 1)[0]  # [T, H]
    torch.testing.assert_close(x[1], states[p + 1].to(x.dtype))  # row 1: t = p, state at p + 1
    assert y[1, 1] == seq[p + 2]
    drafter = treespec.SelfSpeculativeDrafter(model, head, gamma=3)
    res = treespec.generate(model, [1, 2, 3], drafter, max_new_tokens=10, eos_token_id=[])
    plain = treespec.generate_baseline(model, [1, 2, 3], max_new_tokens=10, eos_token_id=[])
    assert res.token_ids == plain.token_ids
    with pytest.raises(ValueError, match="single head"):
        train_heads(_config(root, "bad", num_heads=2, exit_layer=1), model=model)


def test_cli_tune_writes_the_choice_and_generate_uses_it(tiny_setup, tmp_path, capsys):
    """`treespec tune` with a draft model (here: a copy of the tiny target) on the held-out prompts."""
    from treespec.tools import cli
    from treespec.training.tune import TuneResult

    root, model = tiny_setup
    draft = tmp_path / "draft"
    shutil.copytree(root / "model", draft)
    argv = ["--model", str(root / "model"), "--draft-model", str(draft), "--dtype", "float32"]
    status = cli.main(["tune", *argv, "--data", str(root / "data"), "--prompts", "2", "--max-gamma", "3"])
    assert status == 0
    out = capsys.readouterr().out
    assert "predicted speedup" in out and "measured at gamma=" in out
    result = TuneResult.load(draft)
    assert 1 <= result.gamma <= 3 and [r.gamma for r in result.table] == [1, 2, 3]
    assert result.acceptance == [1.0, 1.0, 1.0]  # the draft model is the target: everything accepted
    assert cli.main(["generate", "hello", *argv, "--max-new-tokens", "6"]) == 0
    assert cli.main(["tune", *argv[:2], "--draft-model", str(tmp_path / "missing")]) == 2


# -- checkpoints (training.checkpoint, shared with the draft-model trainer) ------------------------------


@dataclass
class _Cfg:
    lr: float = 0.1
    max_steps: int = 10
    seed: int = 0


def _trained(seed: int = 0):
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4))
    opt = torch.optim.AdamW(net.parameters(), lr=0.1)
    for _ in range(2):
        opt.zero_grad()
        net(torch.randn(5, 3)).square().sum().backward()
        opt.step()
    return net, opt


def _snapshot(net, opt) -> dict:
    state = {f"w.{k}": v.clone() for k, v in net.state_dict().items()}
    for i, s in opt.state_dict()["state"].items():
        state.update({f"o.{i}.{k}": v.clone() for k, v in s.items()})
    return state


def _assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, msg=k)


def test_checkpoint_round_trip_is_exact_and_holds_no_pickle(tmp_path):
    net, opt = _trained()
    ckpt.save(tmp_path / "ckpt", net.state_dict(), opt, 7, _Cfg(), [{"step": 7, "loss": 1.5}], {"who": 1})
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [
        "optimizer.safetensors",
        "state.json",
        "weights.safetensors",
    ]
    saved = _snapshot(net, opt)
    other, other_opt = _trained(seed=1)  # a fresh run, other values everywhere
    seen = []
    step, log = ckpt.load(
        tmp_path / "ckpt", other.state_dict(), other_opt, _Cfg(max_steps=20), ("max_steps",), seen.append
    )
    assert (step, log, seen) == (7, [{"step": 7, "loss": 1.5}], [{"who": 1}])
    _assert_same(_snapshot(other, other_opt), saved)
    assert other_opt.param_groups[0]["betas"] == (0.9, 0.999)  # a tuple again after JSON


def _corrupt_state(folder: Path, edit) -> None:
    state = json.loads((folder / "state.json").read_text())
    edit(state)
    (folder / "state.json").write_text(json.dumps(state))


def _refuse(extra):
    raise ValueError("made for another target")


@pytest.mark.parametrize(
    "corruption, match",
    [
        (lambda f: (f / "state.json").write_text("{"), "cannot read state.json"),
        (lambda f: (f / "state.json").unlink(), "cannot read state.json"),
        (lambda f: _corrupt_state(f, lambda s: s.pop("format")), "not a treespec.training_checkpoint"),
        (lambda f: _corrupt_state(f, lambda s: s.update(version=99)), "version 99"),
        (lambda f: _corrupt_state(f, lambda s: s.update(step="7")), "corrupt state.json"),
        (lambda f: _corrupt_state(f, lambda s: s["config"].update(lr=0.5)), "other settings.*lr"),
        ("extra", "another target"),
        (lambda f: (f / "weights.safetensors").write_bytes(b"garbage"), "cannot read weights"),
        (lambda f: save_file({"0.weight": torch.zeros(4, 3)}, f / "weights.safetensors"), "not the trained"),
        (lambda f: _resave_weights(f, "0.weight", torch.zeros(4, 2)), "0.weight"),
        (lambda f: _resave_weights(f, "0.weight", torch.zeros(4, 3, dtype=torch.float64)), "float64"),
        (lambda f: (f / "optimizer.safetensors").unlink(), "cannot read optimizer"),
        (lambda f: _resave_optimizer(f, "0.exp_avg", torch.zeros(2, 2)), "does not fit"),
        (lambda f: _resave_optimizer(f, "9.exp_avg", torch.zeros(1)), "does not fit"),
        (lambda f: _corrupt_state(f, lambda s: s["optimizer"]["param_groups"].append({})), "does not fit"),
    ],
)
def test_a_bad_checkpoint_is_refused_before_anything_changes(tmp_path, corruption, match):
    net, opt = _trained()
    folder = tmp_path / "ckpt"
    ckpt.save(folder, net.state_dict(), opt, 3, _Cfg(), [])
    if corruption != "extra":
        corruption(folder)
    other, other_opt = _trained(seed=1)
    before = _snapshot(other, other_opt)
    check = _refuse if corruption == "extra" else None
    with pytest.raises(ValueError, match=match):
        ckpt.load(folder, other.state_dict(), other_opt, _Cfg(), (), check)
    _assert_same(_snapshot(other, other_opt), before)  # no half-load


def _resave_weights(folder: Path, name: str, tensor: torch.Tensor) -> None:
    tensors = load_file(folder / "weights.safetensors")
    tensors[name] = tensor
    save_file(tensors, folder / "weights.safetensors")


def _resave_optimizer(folder: Path, name: str, tensor: torch.Tensor) -> None:
    tensors = load_file(folder / "optimizer.safetensors")
    tensors[name] = tensor
    save_file(tensors, folder / "optimizer.safetensors")


def test_a_checkpoint_swap_that_a_crash_interrupted_is_finished(tmp_path):
    net, opt = _trained()
    folder = tmp_path / "ckpt"
    ckpt.save(folder, net.state_dict(), opt, 3, _Cfg(), [])
    ckpt.save(folder, net.state_dict(), opt, 4, _Cfg(), [])  # replaces the step-3 one whole
    assert json.loads((folder / "state.json").read_text())["step"] == 4
    folder.rename(tmp_path / ".ckpt.old")  # killed between moving the old one aside and the new one in
    assert ckpt.exists(folder)
    assert ckpt.load(folder, net.state_dict(), opt, _Cfg())[0] == 4
    assert not ckpt.exists(tmp_path / "none")
