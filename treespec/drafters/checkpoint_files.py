"""Reading the checkpoint folders of heads and EAGLE drafters (`config.json`, `model.safetensors`): every
check runs and raises the caller's error type, naming the file, before any weight reaches a module, so a
bad folder is refused whole, never half-loaded.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import Tensor

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"


def read_checkpoint(
    folder: Path, kind: str, tag: str, version: int, error: type[ValueError]
) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """(config, tensors) of `folder`: config.json, a JSON object with format `tag` and `version`, and every
    tensor of model.safetensors on the CPU. kind: what the folder holds, for messages ("heads")."""
    if not folder.is_dir():
        raise error(f"{kind} folder {folder} does not exist (or is not a folder)")
    config_path, weights_path = folder / CONFIG_NAME, folder / WEIGHTS_NAME
    for path in (config_path, weights_path):
        if not path.is_file():
            raise error(f"{kind} folder {folder} has no {path.name}")
    try:
        config = json.loads(config_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise error(f"{config_path} is not readable JSON ({e}); the folder is corrupt") from e
    if not isinstance(config, dict):
        raise error(f"{config_path} must hold a JSON object")
    if config.get("format") != tag:
        raise error(
            f"{config_path} has format {config.get('format')!r}, expected {tag!r}: not a treespec "
            f"{kind} folder"
        )
    if config.get("version") != version:
        raise error(f"{config_path} has version {config.get('version')!r}; this treespec reads {version}")
    try:
        tensors = load_file(weights_path, device="cpu")
    except Exception as e:  # safetensors raises its own error types for a damaged file
        raise error(f"{weights_path} is not a valid safetensors file ({e}); the file is corrupt") from e
    return config, tensors


def check_tensors(
    path: Path,
    tensors: dict[str, Tensor],
    expected: dict[str, Tensor],
    vocab_size: int,
    error: type[ValueError],
) -> None:
    """Refuse the tensors read from `path` unless they have the keys and shapes of `expected` (the state
    dict of the module their config describes), floating-point weights are finite and draft_vocab holds
    distinct token ids in [0, vocab_size)."""
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise error(
            f"{path} does not match its config: missing {_few(missing)}, unexpected {_few(unexpected)}"
        )
    for name, want in expected.items():
        got = tensors[name]
        if got.shape != want.shape:
            raise error(
                f"{path} does not match its config: tensor {name} has shape {list(got.shape)}, "
                f"config says {list(want.shape)}"
            )
        if name == "draft_vocab":
            problem = draft_vocab_problem(got, vocab_size)
            if problem:
                raise error(f"{path}: draft_vocab {problem}")
        elif not got.is_floating_point():
            raise error(f"{path}: tensor {name} has non-float dtype {got.dtype}")
        elif not torch.isfinite(got).all():
            raise error(f"{path}: tensor {name} contains NaN or Inf values (corrupt checkpoint)")


def draft_vocab_problem(ids: Tensor, vocab_size: int) -> str | None:
    """What is wrong with a draft vocabulary (int64 [V'] of distinct ids in [0, V)), or None."""
    if ids.dtype != torch.long or ids.dim() != 1 or len(ids) == 0:
        return f"must be a non-empty 1-D int64 tensor of token ids, got {ids.dtype} {list(ids.shape)}"
    if ids.min() < 0 or ids.max() >= vocab_size:
        return f"must hold distinct token ids in [0, {vocab_size})"
    if len(torch.unique(ids)) != len(ids):
        return "has repeated token ids"
    return None


def _few(names: list[str], limit: int = 4) -> str:
    """A short printable list of names."""
    if not names:
        return "none"
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")
