"""Medusa heads: small networks that guess several tokens ahead from the base model's last hidden state.

The base model's output layer on hidden state h_t predicts token t+1; head k (k = 0..K-1) predicts token
t+2+k from the same h_t. Each head is a stack of zero-initialised residual blocks followed by either its
own output layer or the base model's (shared at call time), so untrained heads reproduce the base model.

Heads remember which base model they were made for (`model_identity`) and refuse a different one.
Checkpoints are a folder with `config.json` and `model.safetensors`; loading checks everything first.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

FORMAT = "treespec.medusa_heads"
VERSION = 1
CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
FINGERPRINT_SIZE = 16
FINGERPRINT_RTOL = 1e-2
FINGERPRINT_ATOL = 1e-6
_TRAIN_HINT = "load heads made for this model or train new ones with scripts/train_heads.py"


class HeadsLoadError(ValueError):
    """A heads checkpoint folder is missing, corrupt, or does not fit the model."""


# ---------------------------------------------------------------------------------------------------------
# Base model identity
# ---------------------------------------------------------------------------------------------------------


def _model_sizes(model: nn.Module) -> tuple[int, int]:
    """(hidden_size, vocab_size) from the model's (text) config."""
    config = model.config
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    return int(config.hidden_size), int(config.vocab_size)


def model_fingerprint(model: nn.Module) -> list[float]:
    """16 input-embedding values at fixed pseudo-random positions that depend only on the matrix shape."""
    weight = model.get_input_embeddings().weight  # [V, H]
    rows, cols = weight.shape
    generator = torch.Generator().manual_seed(0)
    row_idx = torch.randint(rows, (FINGERPRINT_SIZE,), generator=generator)  # [16]
    col_idx = torch.randint(cols, (FINGERPRINT_SIZE,), generator=generator)  # [16]
    with torch.no_grad():
        values = weight[row_idx.to(weight.device), col_idx.to(weight.device)]  # [16]
    return [float(v) for v in values.float().cpu().tolist()]


def fingerprints_match(a: list[float], b: list[float], rtol: float = FINGERPRINT_RTOL) -> bool:
    """True when two fingerprints agree up to the rounding of float32 / bfloat16 / float16 weights."""
    if len(a) != len(b):
        return False
    return all(math.isclose(x, y, rel_tol=rtol, abs_tol=FINGERPRINT_ATOL) for x, y in zip(a, b, strict=True))


def model_identity(model: nn.Module) -> dict[str, Any]:
    """Identity record of a base model: name, sizes, and weight fingerprint."""
    hidden_size, vocab_size = _model_sizes(model)
    name = getattr(model.config, "name_or_path", "") or type(model).__name__
    return {
        "name": str(name),
        "hidden_size": hidden_size,
        "vocab_size": vocab_size,
        "fingerprint": model_fingerprint(model),
    }


def _describe(identity: dict[str, Any]) -> str:
    return f"{identity['name']} (hidden {identity['hidden_size']}, vocab {identity['vocab_size']})"


def _reference_weight(model: nn.Module) -> Tensor:
    """The tensor whose device and dtype the heads should follow: the output layer's weight."""
    output = model.get_output_embeddings()
    if output is not None and getattr(output, "weight", None) is not None:
        return output.weight
    return next(model.parameters())


# ---------------------------------------------------------------------------------------------------------
# The heads
# ---------------------------------------------------------------------------------------------------------


class ResidualBlock(nn.Module):
    """y = x + SiLU(W x + b), with W and b zero so the block starts as the identity."""

    def __init__(self, hidden_size: int, device: Any = None, dtype: torch.dtype | None = None):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size, device=device, dtype=dtype)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: Tensor) -> Tensor:
        return x + F.silu(self.linear(x))  # [..., H]


class MedusaHeads(nn.Module):
    """K Medusa heads; head k predicts the token k+1 places after the base model's next token."""

    def __init__(
        self,
        num_heads: int,
        hidden_size: int,
        vocab_size: int,
        num_layers: int = 1,
        own_lm_head: bool = False,
        base_model: dict | None = None,
        *,
        device: Any = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        for field, value, low in (
            ("num_heads", num_heads, 1),
            ("hidden_size", hidden_size, 1),
            ("vocab_size", vocab_size, 1),
            ("num_layers", num_layers, 0),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{field} must be an integer >= {low}, got {value!r}")
        self.num_heads = num_heads
        self.hidden_size = hidden_size
        self.vocab_size = vocab_size
        self.num_layers = num_layers
        self.own_lm_head = bool(own_lm_head)
        self.base_model = dict(base_model) if base_model is not None else None
        self.blocks = nn.ModuleList(
            nn.Sequential(*(ResidualBlock(hidden_size, device, dtype) for _ in range(num_layers)))
            for _ in range(num_heads)
        )
        self.lm_heads = (
            nn.ModuleList(
                nn.Linear(hidden_size, vocab_size, bias=False, device=device, dtype=dtype)
                for _ in range(num_heads)
            )
            if self.own_lm_head
            else None
        )

    @property
    def config(self) -> dict[str, Any]:
        """The fields saved in config.json (everything needed to rebuild the module)."""
        first = next(self.parameters(), None)
        return {
            "format": FORMAT,
            "version": VERSION,
            "num_heads": self.num_heads,
            "hidden_size": self.hidden_size,
            "vocab_size": self.vocab_size,
            "num_layers": self.num_layers,
            "own_lm_head": self.own_lm_head,
            "base_model": self.base_model,
            "dtype": str(first.dtype).removeprefix("torch.") if first is not None else None,
        }

    def head_hidden(self, hidden: Tensor, num_heads: int | None = None) -> Tensor:
        """Each head's transformed hidden state, before the output layer: [B, T, H] -> [K, B, T, H].

        num_heads: run only the first `num_heads` heads (a shallow tree needs no deeper heads).
        """
        if hidden.shape[-1] != self.hidden_size:
            raise ValueError(f"hidden has size {hidden.shape[-1]} but the heads expect {self.hidden_size}")
        first = next(self.parameters(), None)
        if first is not None:
            hidden = hidden.to(first.dtype)
        return torch.stack([blocks(hidden) for blocks in self.blocks[:num_heads]])  # [K, B, T, H]

    def forward(
        self, hidden: Tensor, lm_head: nn.Module | Tensor | None = None, num_heads: int | None = None
    ) -> Tensor:
        """Logits of every head: hidden [B, T, H] -> [K, B, T, V].

        lm_head (the base model's output layer, or its weight [V, H]) is required when the heads share it,
        and ignored when they have their own. num_heads: only the first `num_heads` heads (K = num_heads).
        """
        states = self.head_hidden(hidden, num_heads)  # [K, B, T, H]
        if self.own_lm_head:
            used = self.lm_heads[: len(states)]
            logits = [head(state) for head, state in zip(used, states, strict=True)]  # K x [B, T, V]
            return torch.stack(logits)  # [K, B, T, V]
        if lm_head is None:
            raise ValueError(
                "these heads share the base model's output layer: pass it as lm_head "
                "(e.g. heads(hidden, model.get_output_embeddings()))"
            )
        weight = lm_head if isinstance(lm_head, Tensor) else getattr(lm_head, "weight", None)
        if weight is not None and tuple(weight.shape) != (self.vocab_size, self.hidden_size):
            raise ValueError(
                f"lm_head weight has shape {tuple(weight.shape)} but the heads expect "
                f"[{self.vocab_size}, {self.hidden_size}]"
            )
        if weight is not None:
            states = states.to(weight.dtype)
        if isinstance(lm_head, Tensor):
            return F.linear(states, lm_head)  # [K, B, T, V]
        return lm_head(states)  # [K, B, T, V]

    # -----------------------------------------------------------------------------------------------------
    # Building for a model, and checking the model
    # -----------------------------------------------------------------------------------------------------

    @classmethod
    def for_model(
        cls, model: nn.Module, num_heads: int = 4, num_layers: int = 1, own_lm_head: bool = False
    ) -> MedusaHeads:
        """Fresh (identity) heads sized for `model`, on its output layer's device and dtype."""
        hidden_size, vocab_size = _model_sizes(model)
        reference = _reference_weight(model)
        heads = cls(
            num_heads,
            hidden_size,
            vocab_size,
            num_layers,
            own_lm_head,
            base_model=model_identity(model),
            device=reference.device,
            dtype=reference.dtype,
        )
        if own_lm_head:
            output = model.get_output_embeddings()
            if output is None or tuple(output.weight.shape) != (vocab_size, hidden_size):
                raise ValueError(
                    f"own_lm_head needs the model's output layer of shape [{vocab_size}, {hidden_size}]"
                )
            with torch.no_grad():
                for head in heads.lm_heads:
                    head.weight.copy_(output.weight)
        return heads

    def check_compatible(self, model: nn.Module) -> None:
        """Raise ValueError unless these heads were made for `model` (sizes and weight fingerprint)."""
        theirs = model_identity(model)
        ours = dict(self.base_model or {"name": "an unrecorded model"})
        ours["hidden_size"], ours["vocab_size"] = self.hidden_size, self.vocab_size
        problem = ""
        if (ours["hidden_size"], ours["vocab_size"]) != (theirs["hidden_size"], theirs["vocab_size"]):
            problem = " with different sizes"
        elif ours.get("fingerprint") is not None and not fingerprints_match(
            ours["fingerprint"], theirs["fingerprint"]
        ):
            problem = " with different weights (embedding fingerprint mismatch)"
        if problem:
            raise ValueError(
                f"these heads were trained for {_describe(ours)} but the model is {_describe(theirs)}"
                f"{problem}; {_TRAIN_HINT}"
            )

    # -----------------------------------------------------------------------------------------------------
    # Saving and loading
    # -----------------------------------------------------------------------------------------------------

    def save_pretrained(self, folder: str | os.PathLike) -> None:
        """Write folder/config.json and folder/model.safetensors, each replaced atomically."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        tensors = {name: t.detach().contiguous().cpu() for name, t in self.state_dict().items()}
        config_text = json.dumps(self.config, indent=2) + "\n"
        _atomic_write(folder / WEIGHTS_NAME, lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"}))
        _atomic_write(folder / CONFIG_NAME, lambda tmp: Path(tmp).write_text(config_text))

    @classmethod
    def from_pretrained(
        cls,
        folder: str | os.PathLike,
        model: nn.Module | None = None,
        device: Any = None,
        dtype: torch.dtype | str | None = None,
    ) -> MedusaHeads:
        """Load heads saved by save_pretrained; every check runs before anything is loaded.

        With `model`, the heads must fit it (check_compatible) and follow its device and dtype unless
        `device` / `dtype` are given. Raises HeadsLoadError (a ValueError) naming the folder.
        """
        folder = Path(folder)
        config = _read_config(folder)
        tensors = _read_weights(folder)
        with torch.device("meta"):
            heads = cls(**{k: config[k] for k in _CONFIG_FIELDS})
        _check_tensors(folder, tensors, heads.state_dict())
        heads.load_state_dict(tensors, strict=True, assign=True)

        if model is not None:
            try:
                heads.check_compatible(model)
            except ValueError as error:
                raise HeadsLoadError(f"cannot use the heads in {folder}: {error}") from error
            reference = _reference_weight(model)
            device = reference.device if device is None else device
            dtype = reference.dtype if dtype is None else dtype
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
        return heads.to(device=device, dtype=dtype)


# ---------------------------------------------------------------------------------------------------------
# Checkpoint helpers
# ---------------------------------------------------------------------------------------------------------

_CONFIG_FIELDS = ("num_heads", "hidden_size", "vocab_size", "num_layers", "own_lm_head", "base_model")


def _atomic_write(path: Path, write: Callable[[str], Any]) -> None:
    """Write through `write(tmp_path)` into a temp file next to `path`, fsync it, then os.replace."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        with open(tmp, "rb+") as file:
            os.fsync(file.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _read_config(folder: Path) -> dict[str, Any]:
    """config.json, validated: format tag, version and field types."""
    if not folder.is_dir():
        raise HeadsLoadError(f"heads folder {folder} does not exist (or is not a folder)")
    path = folder / CONFIG_NAME
    if not path.is_file():
        raise HeadsLoadError(f"heads folder {folder} has no {CONFIG_NAME}")
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise HeadsLoadError(f"{path} is not readable JSON: {error}") from error
    if not isinstance(config, dict):
        raise HeadsLoadError(f"{path} must hold a JSON object")
    if config.get("format") != FORMAT:
        raise HeadsLoadError(
            f"{path} has format {config.get('format')!r}, expected {FORMAT!r}: not a treespec heads folder"
        )
    if config.get("version") != VERSION:
        raise HeadsLoadError(f"{path} has version {config.get('version')!r}; this treespec reads {VERSION}")
    for field, low in (("num_heads", 1), ("hidden_size", 1), ("vocab_size", 1), ("num_layers", 0)):
        value = config.get(field)
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise HeadsLoadError(f"{path}: {field} must be an integer >= {low}, got {value!r}")
    if not isinstance(config.get("own_lm_head"), bool):
        raise HeadsLoadError(f"{path}: own_lm_head must be true or false, got {config.get('own_lm_head')!r}")
    base = config.get("base_model")
    if base is not None:
        if not isinstance(base, dict):
            raise HeadsLoadError(f"{path}: base_model must be an object or null")
        sizes = (config["hidden_size"], config["vocab_size"])
        recorded = (base.get("hidden_size"), base.get("vocab_size"))
        if recorded != sizes:
            raise HeadsLoadError(
                f"{path}: base_model sizes (hidden {recorded[0]}, vocab {recorded[1]}) "
                f"disagree with the heads (hidden {sizes[0]}, vocab {sizes[1]})"
            )
        fingerprint = base.get("fingerprint")
        if fingerprint is not None and not (
            isinstance(fingerprint, list) and all(isinstance(v, (int, float)) for v in fingerprint)
        ):
            raise HeadsLoadError(f"{path}: base_model.fingerprint must be a list of numbers")
    return config


def _read_weights(folder: Path) -> dict[str, Tensor]:
    """All tensors of model.safetensors on the CPU; a truncated or corrupt file is refused."""
    path = folder / WEIGHTS_NAME
    if not path.is_file():
        raise HeadsLoadError(f"heads folder {folder} has no {WEIGHTS_NAME}")
    try:
        return load_file(path, device="cpu")
    except Exception as error:  # safetensors raises its own error types for corrupt files
        raise HeadsLoadError(f"{path} is not a valid safetensors file: {error}") from error


def _check_tensors(folder: Path, tensors: dict[str, Tensor], expected: dict[str, Tensor]) -> None:
    """Same keys, same shapes, floating point, all finite."""
    path = folder / WEIGHTS_NAME
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise HeadsLoadError(
            f"{path} does not match {folder / CONFIG_NAME}: "
            f"missing {_few(missing)}, unexpected {_few(unexpected)}"
        )
    for name, want in expected.items():
        got = tensors[name]
        if got.shape != want.shape:
            raise HeadsLoadError(
                f"{path}: tensor {name} has shape {list(got.shape)}, config says {list(want.shape)}"
            )
        if not got.is_floating_point():
            raise HeadsLoadError(f"{path}: tensor {name} has non-float dtype {got.dtype}")
        if not torch.isfinite(got).all():
            raise HeadsLoadError(f"{path}: tensor {name} contains NaN or Inf values (corrupt checkpoint)")


def _few(names: list[str], limit: int = 4) -> str:
    """A short printable list of names."""
    if not names:
        return "none"
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")
