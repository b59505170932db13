"""The one training loop (`training.loop`): schedule, log, eval and checkpoint cadence, clipping, and a
killed run that resumes to the weights of an uninterrupted one. A linear model on random data: no HF."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from treespec.training import checkpoint
from treespec.training.loop import StepOutput, TrainLoop, final_eval, resume_from, run
from treespec.training.schedule import lr_at


@dataclass
class Cfg:
    lr: float = 0.05
    warmup_steps: int = 3
    max_steps: int = 12
    eval_every: int = 5
    checkpoint_every: int = 4
    seed: int = 0


class _Killed(Exception):
    pass


def _setup(cfg: Cfg, folder, kill_at: int | None = None, resume: bool = False):
    """A linear model, its loop (batches seeded by step) and the (step, log) it starts from."""
    torch.manual_seed(cfg.seed)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    data = torch.randn(64, 4, generator=torch.Generator().manual_seed(1))  # [64, 4]
    target = data @ torch.tensor([1.0, -2.0, 0.5, 3.0])  # [64]
    seen: dict = {"lr": [], "saves": [], "evals": 0}

    def forward(step: int) -> StepOutput:
        seen["lr"].append(optimizer.param_groups[0]["lr"])
        rows = torch.randperm(64, generator=torch.Generator().manual_seed(cfg.seed + step))[:8]  # [8]
        loss = torch.nn.functional.mse_loss(model(data[rows]).squeeze(-1), target[rows])
        return StepOutput(loss, {"rows": len(rows)}, {"rows": len(rows)})

    def evaluate() -> dict:
        seen["evals"] += 1
        with torch.no_grad():
            return {"mse": float(torch.nn.functional.mse_loss(model(data).squeeze(-1), target))}

    def save(step: int, log: list) -> None:
        seen["saves"].append(step)
        checkpoint.save(folder, model.state_dict(), optimizer, step, cfg, log)
        if step == kill_at:
            raise _Killed

    step, log = resume_from(
        folder, resume, lambda: checkpoint.load(folder, model.state_dict(), optimizer, cfg)
    )
    loop = TrainLoop(cfg, optimizer, forward, evaluate, lambda r: f"mse {r['mse']:.3f}", save, "toy")
    return model, loop, step, log, seen


def test_schedule_log_eval_and_checkpoint_cadence(tmp_path):
    cfg = Cfg()
    model, loop, step, log, seen = _setup(cfg, tmp_path / "ckpt")
    result = run(loop, step, log)
    assert result.step == cfg.max_steps and result.seconds >= result.seconds_per_step > 0
    assert seen["lr"] == pytest.approx([lr_at(s, cfg) for s in range(cfg.max_steps)])
    losses = [e for e in result.log if "loss" in e]
    assert [e["step"] for e in losses] == [1, 10]
    assert list(losses[0]) == ["step", "loss", "rows", "lr"] and losses[1]["lr"] == lr_at(9, cfg)
    assert [e["step"] for e in result.log if "eval" in e] == [5, 10, 12]
    assert seen["saves"] == [4, 8, 12]
    assert final_eval(result.log, result.step, loop.evaluate, loop.describe) is result.log[-1]["eval"]
    assert seen["evals"] == 3  # the last step's evaluation is in the log: not run again
    assert result.log[-1]["eval"]["mse"] < [e for e in result.log if "eval" in e][0]["eval"]["mse"]


def test_a_killed_run_resumes_to_the_weights_of_an_uninterrupted_run(tmp_path):
    cfg = Cfg()
    straight, loop, step, log, _ = _setup(cfg, tmp_path / "straight")
    straight_log = run(loop, step, log).log
    _, loop, step, log, _ = _setup(cfg, tmp_path / "resumed", kill_at=8)
    with pytest.raises(_Killed):
        run(loop, step, log)
    resumed, loop, step, log, seen = _setup(cfg, tmp_path / "resumed", resume=True)
    assert step == 8 and [e["step"] for e in log if "eval" in e] == [5]
    result = run(loop, step, log)
    assert seen["lr"] == pytest.approx([lr_at(s, cfg) for s in range(8, cfg.max_steps)])
    for name, value in straight.state_dict().items():
        assert torch.equal(value, resumed.state_dict()[name]), name
    assert [e["step"] for e in result.log] == [e["step"] for e in straight_log]
    _, _, step, log, _ = _setup(cfg, tmp_path / "resumed")  # resume=False: a fresh start
    assert (step, log) == (0, [])


def test_resume_from_warns_when_it_replaces_a_checkpoint(tmp_path):
    cfg = Cfg(max_steps=4)
    _, loop, step, log, _ = _setup(cfg, tmp_path / "ckpt")
    run(loop, step, log)
    with pytest.warns(UserWarning, match="replaced"):
        assert resume_from(tmp_path / "ckpt", False, lambda: (99, []), warn=True) == (0, [])
    assert resume_from(tmp_path / "ckpt", True, lambda: (99, ["x"])) == (99, ["x"])
    assert resume_from(tmp_path / "none", True, lambda: (99, [])) == (0, [])


def test_gradients_are_clipped_to_the_norm(tmp_path):
    cfg = Cfg(lr=1.0, warmup_steps=0, max_steps=1, eval_every=100, checkpoint_every=100)
    model = torch.nn.Linear(3, 1, bias=False)
    before = model.weight.detach().clone()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)

    def forward(step: int) -> StepOutput:
        return StepOutput(1000.0 * model(torch.ones(1, 3)).sum())  # gradient norm ~1700

    loop = TrainLoop(
        cfg,
        optimizer,
        forward,
        lambda: {},
        str,
        lambda s, lg: None,
        clip_params=[model.weight],
        clip_norm=0.5,
    )
    run(loop)
    moved = float((model.weight.detach() - before).norm())  # lr 1 (cosine at its start): the clipped step
    assert moved == pytest.approx(0.5, rel=1e-4)
