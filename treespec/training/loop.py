"""The one training loop of every trainer: Medusa heads, the EAGLE layer and draft models.

A trainer says what differs (`TrainLoop`): the forward and loss of the step-th batch (from its own seeded
data order, so that a resumed run sees the same batches), the parameters to clip, how to evaluate and how
to write a checkpoint. The loop owns the rest:

    for step in [resumed step, max_steps):
        lr = schedule.lr_at(step); loss = forward(step); backward (through accelerate when given: DDP)
        clip; optimizer step; log {step, loss, ..., lr} every 10 steps and at step 1
        every eval_every / checkpoint_every steps and at the last: evaluate / save (main process only)

`resume_from` restores (step, log) from a checkpoint, or starts at (0, []); `final_eval` returns the
evaluation at the last step, running it if the log has none (e.g. a run resumed at its last step).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from . import checkpoint
from .schedule import lr_at


@dataclass
class StepOutput:
    """One optimizer step's forward: the loss to minimise and what the log and the bar show besides it."""

    loss: Tensor  # [] scalar
    fields: dict = field(default_factory=dict)  # more log entries (e.g. each head's loss)
    postfix: dict = field(default_factory=dict)  # more progress-bar fields


@dataclass
class TrainLoop:
    """What a trainer gives the loop. cfg: its settings (lr, warmup_steps, max_steps, eval_every,
    checkpoint_every); forward(step) -> StepOutput of the step-th batch (0-based); evaluate() -> held-out
    metrics; describe(metrics) -> one line; save(step, log) writes a checkpoint."""

    cfg: Any
    optimizer: torch.optim.Optimizer
    forward: Callable[[int], StepOutput]
    evaluate: Callable[[], dict]
    describe: Callable[[dict], str]
    save: Callable[[int, list], None]
    desc: str = "train"  # progress-bar label
    clip_params: list[Tensor] | None = None  # clip their gradient norm to clip_norm (0: no clipping)
    clip_norm: float = 0.0
    accelerator: Any = None  # accelerate.Accelerator: its backward, main-process eval and saves, barriers


@dataclass
class LoopResult:
    step: int  # the step reached (max_steps)
    log: list  # the whole log, the resumed part included
    seconds: float  # wall time of the loop in this run
    seconds_per_step: float  # forward, backward and optimizer step only (no eval or checkpoint)


def is_main(accelerator) -> bool:
    """Whether this process evaluates, saves and prints (always without accelerate)."""
    return accelerator is None or accelerator.is_main_process


def resume_from(
    folder: Path, resume: bool, load: Callable[[], tuple[int, list]], accelerator=None, warn: bool = False
) -> tuple[int, list]:
    """(step, log) to start from: `load()`'s when resuming and `folder` holds a checkpoint, else (0, []).
    warn: say so when a checkpoint is there but not resumed (the run replaces it)."""
    if resume and checkpoint.exists(folder):
        step, log = load()
        if is_main(accelerator):
            print(f"resumed from {folder} at step {step}")
        return step, log
    if warn and folder.exists():
        warnings.warn(f"{folder} exists and is replaced; pass resume=True to continue it", stacklevel=3)
    return 0, []


def evaluate_into(
    log: list, step: int, evaluate: Callable[[], dict], describe: Callable[[dict], str]
) -> dict:
    """Run `evaluate`, append {"step", "eval"} to the log and print one line."""
    from tqdm import tqdm

    result = evaluate()
    log.append({"step": step, "eval": result})
    tqdm.write(f"step {step}: {describe(result)}")
    return result


def final_eval(log: list, step: int, evaluate: Callable[[], dict], describe: Callable[[dict], str]) -> dict:
    """The log's evaluation at `step`, run now if it has none (e.g. a run resumed at its last step)."""
    done = next((e["eval"] for e in reversed(log) if "eval" in e and e["step"] == step), None)
    return done if done is not None else evaluate_into(log, step, evaluate, describe)


def _optimizer_step(loop: TrainLoop, step: int) -> StepOutput:
    """Schedule, forward, backward, clip and step at `step` (0-based)."""
    for group in loop.optimizer.param_groups:
        group["lr"] = lr_at(step, loop.cfg)
    out = loop.forward(step)
    loop.optimizer.zero_grad(set_to_none=True)
    if loop.accelerator is not None:
        loop.accelerator.backward(out.loss)
    else:
        out.loss.backward()
    if loop.clip_norm:
        torch.nn.utils.clip_grad_norm_(loop.clip_params, loop.clip_norm)
    loop.optimizer.step()
    return out


def run(loop: TrainLoop, step: int = 0, log: list | None = None) -> LoopResult:
    """Train from `step` (a resumed run's) to cfg.max_steps, appending to `log`."""
    from tqdm import tqdm

    cfg, accelerator, log = loop.cfg, loop.accelerator, [] if log is None else log
    main = is_main(accelerator)
    start, start_step, step_seconds = time.perf_counter(), step, 0.0
    bar = tqdm(
        total=cfg.max_steps, initial=step, desc=loop.desc, unit="step", dynamic_ncols=True, disable=not main
    )
    while step < cfg.max_steps:
        began = time.perf_counter()
        out = _optimizer_step(loop, step)
        step_seconds += time.perf_counter() - began
        step += 1
        bar.update(1)
        loss = float(out.loss.detach())
        if step % 10 == 0 or step == 1:
            log.append({"step": step, "loss": loss, **out.fields, "lr": lr_at(step - 1, cfg)})
        bar.set_postfix(loss=f"{loss:.3f}", **out.postfix)
        if main and (step % cfg.eval_every == 0 or step == cfg.max_steps):
            evaluate_into(log, step, loop.evaluate, loop.describe)
        if main and (step % cfg.checkpoint_every == 0 or step == cfg.max_steps):
            loop.save(step, log)
        if accelerator is not None:
            accelerator.wait_for_everyone()
    bar.close()
    seconds = time.perf_counter() - start
    return LoopResult(step, log, seconds, step_seconds / max(step - start_step, 1))
