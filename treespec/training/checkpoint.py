"""Training checkpoints for every trainer (heads, EAGLE, draft models): atomic, safetensors + JSON, no pickle.

A checkpoint is a folder that is replaced whole (`treespec.io.atomic_folder`), so a killed run leaves
the previous checkpoint intact:

    state.json              format, version, step, the run's settings, its log, `extra` (e.g. the
                            target model's identity) and the optimizer's non-tensor state
    weights.safetensors     the trained tensors, by name
    optimizer.safetensors   the optimizer's tensors, as "<parameter index>.<key>" (e.g. "3.exp_avg")

`load` reads and checks everything first (format, settings, `extra`, tensor names, shapes and dtypes,
the optimizer's layout) and changes nothing unless all of it fits: a refused checkpoint raises
CheckpointError (a ValueError) naming the folder and what to do.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from ..io import atomic_folder, restore_folder

FORMAT = "treespec.training_checkpoint"
VERSION = 1
STATE_NAME = "state.json"
WEIGHTS_NAME = "weights.safetensors"
OPTIMIZER_NAME = "optimizer.safetensors"
# settings that may change when a run is resumed (they do not change the trained weights)
RESUMABLE_CHANGES = ("max_steps", "eval_every", "checkpoint_every")
_HINT = "use another --out, or delete the checkpoint folder to start again"


class CheckpointError(ValueError):
    """A checkpoint is missing, corrupt, or belongs to another run (other settings or model)."""


def exists(folder: str | Path) -> bool:
    """Whether `folder` holds a checkpoint to resume (finishing a swap a crash interrupted first)."""
    return (restore_folder(folder) / STATE_NAME).is_file()


# -- saving ------------------------------------------------------------------------------------------


def _optimizer_parts(optimizer: torch.optim.Optimizer) -> tuple[dict[str, Tensor], dict]:
    """The optimizer's state_dict split into tensors and JSON-ready values."""
    state_dict = optimizer.state_dict()
    tensors: dict[str, Tensor] = {}
    values: dict[str, dict[str, Any]] = {}
    for index, state in state_dict["state"].items():
        for key, value in state.items():
            if isinstance(value, Tensor):
                tensors[f"{index}.{key}"] = value.detach().contiguous().cpu()
            else:
                values.setdefault(str(index), {})[key] = value
    return tensors, {"param_groups": state_dict["param_groups"], "values": values}


def save(
    folder: str | Path,
    weights: Mapping[str, Tensor],
    optimizer: torch.optim.Optimizer,
    step: int,
    config: Any,
    log: list,
    extra: dict | None = None,
) -> None:
    """Write the checkpoint folder `folder` atomically. config: the run's settings (a dataclass)."""
    tensors = {name: t.detach().contiguous().cpu() for name, t in weights.items()}
    optimizer_tensors, optimizer_state = _optimizer_parts(optimizer)
    state = {
        "format": FORMAT,
        "version": VERSION,
        "step": step,
        "config": asdict(config),
        "extra": extra or {},
        "optimizer": optimizer_state,
        "log": log,
    }

    def write(tmp: Path) -> None:
        save_file(tensors, tmp / WEIGHTS_NAME)
        save_file(optimizer_tensors, tmp / OPTIMIZER_NAME)
        (tmp / STATE_NAME).write_text(json.dumps(state, indent=1) + "\n", encoding="utf-8")

    atomic_folder(folder, write)


# -- loading -----------------------------------------------------------------------------------------


def check_same_settings(ckpt: str | Path, saved: dict, cfg: Any, resumable: tuple[str, ...]) -> None:
    """Refuse to resume `ckpt` (saved with settings `saved`) under other settings than `cfg`'s (a
    dataclass), except the `resumable` ones (e.g. max_steps)."""
    saved = {k: v for k, v in saved.items() if k not in resumable}
    wanted = {k: v for k, v in asdict(cfg).items() if k not in resumable}
    if saved != wanted:
        keys = sorted(set(saved) | set(wanted))
        diff = {k: (saved.get(k), wanted.get(k)) for k in keys if saved.get(k) != wanted.get(k)}
        raise CheckpointError(
            f"{ckpt}: made with other settings {diff} (checkpoint's, now); "
            "use another --out or the same settings"
        )


def _read_state(folder: Path) -> dict:
    path = folder / STATE_NAME
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{folder}: cannot read {STATE_NAME} ({e}); {_HINT}") from e
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        found = state.get("format") if isinstance(state, dict) else None
        raise CheckpointError(
            f"{folder}: not a {FORMAT} checkpoint (format {found!r}; checkpoints of treespec versions "
            f"that pickled the optimizer are not read); {_HINT}"
        )
    if state.get("version") != VERSION:
        raise CheckpointError(
            f"{folder}: checkpoint version {state.get('version')!r}, not {VERSION}; {_HINT}"
        )
    ok = (
        isinstance(state.get("step"), int)
        and state["step"] >= 0
        and isinstance(state.get("config"), dict)
        and isinstance(state.get("extra"), dict)
        and isinstance(state.get("log"), list)
        and isinstance(state.get("optimizer"), dict)
    )
    if not ok:
        raise CheckpointError(
            f"{folder}: corrupt {STATE_NAME} (step, config, extra, log or optimizer); {_HINT}"
        )
    return state


def _read_tensors(folder: Path, name: str) -> dict[str, Tensor]:
    try:
        return load_file(folder / name)
    except Exception as e:  # noqa: BLE001 - any read failure means a missing or corrupt file
        raise CheckpointError(f"{folder}: cannot read {name} ({type(e).__name__}: {e}); {_HINT}") from e


def _check_weights(folder: Path, saved: Mapping[str, Tensor], live: Mapping[str, Tensor]) -> None:
    if set(saved) != set(live):
        missing, unexpected = sorted(set(live) - set(saved)), sorted(set(saved) - set(live))
        raise CheckpointError(
            f"{folder}: its tensors are not the trained weights (missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}); {_HINT}"
        )
    for name, tensor in live.items():
        if saved[name].shape != tensor.shape or saved[name].dtype != tensor.dtype:
            raise CheckpointError(
                f"{folder}: '{name}' is {saved[name].dtype} {list(saved[name].shape)} in the checkpoint, "
                f"{tensor.dtype} {list(tensor.shape)} here; {_HINT}"
            )


def _optimizer_state_dict(
    folder: Path, parts: dict, tensors: dict[str, Tensor], optimizer: torch.optim.Optimizer
) -> dict:
    """Rebuild the optimizer's state_dict from its two parts, checked against the live optimizer."""

    def bad(why: str) -> CheckpointError:
        return CheckpointError(f"{folder}: the optimizer state does not fit this run ({why}); {_HINT}")

    live_groups = optimizer.state_dict()["param_groups"]
    groups = parts.get("param_groups")
    if not isinstance(groups, list) or len(groups) != len(live_groups):
        raise bad(f"{len(live_groups)} parameter groups here")
    params: dict[int, Tensor] = {}
    for group, live, live_group in zip(groups, live_groups, optimizer.param_groups, strict=True):
        if not isinstance(group, dict) or group.get("params") != live["params"]:
            raise bad("the parameters of a group differ")
        params.update(zip(live["params"], live_group["params"], strict=True))
        for key, value in group.items():  # JSON made tuples lists (e.g. betas)
            if isinstance(live.get(key), tuple) and isinstance(value, list):
                group[key] = tuple(value)
    state: dict[int, dict[str, Any]] = {}
    for name, tensor in tensors.items():
        index, _, key = name.partition(".")
        if not index.isdigit() or int(index) not in params or not key:
            raise bad(f"unexpected tensor {name!r}")
        param = params[int(index)]
        if tensor.dim() > 0 and tensor.shape != param.shape:
            raise bad(f"{name!r} is {list(tensor.shape)}, its parameter {list(param.shape)}")
        state.setdefault(int(index), {})[key] = tensor
    values = parts.get("values", {})
    if not isinstance(values, dict):
        raise bad("the non-tensor state is not a mapping")
    for index, entries in values.items():
        if not index.isdigit() or int(index) not in params or not isinstance(entries, dict):
            raise bad(f"unexpected non-tensor state for parameter {index!r}")
        state.setdefault(int(index), {}).update(entries)
    return {"state": state, "param_groups": groups}


def load(
    folder: str | Path,
    weights: Mapping[str, Tensor],
    optimizer: torch.optim.Optimizer,
    cfg: Any,
    resumable: tuple[str, ...] = (),
    check_extra: Callable[[dict], None] | None = None,
) -> tuple[int, list]:
    """Restore `weights` (live tensors, filled in place), the optimizer, and return (step, log).

    Refuses (CheckpointError) before changing anything: a missing or corrupt checkpoint, one saved with
    other settings than `cfg` (except the `resumable` ones), or with other tensors; `check_extra(extra)`
    may refuse the saved `extra` (e.g. another target model) by raising.
    """
    folder = restore_folder(folder)
    state = _read_state(folder)
    check_same_settings(folder, state["config"], cfg, resumable)
    if check_extra is not None:
        check_extra(state["extra"])
    saved = _read_tensors(folder, WEIGHTS_NAME)
    _check_weights(folder, saved, weights)
    optimizer_state = _optimizer_state_dict(
        folder, state["optimizer"], _read_tensors(folder, OPTIMIZER_NAME), optimizer
    )
    optimizer.load_state_dict(optimizer_state)  # checks and casts before it assigns
    with torch.no_grad():
        for name, tensor in weights.items():
            tensor.copy_(saved[name])
    return state["step"], list(state["log"])
