"""Medusa heads: small networks that guess several tokens ahead from the base model's last hidden state.

The base model's output layer on hidden state h_t predicts token t+1; head k (k = 0..K-1) predicts token
t+2+k. Each head is a stack of zero-initialised residual blocks followed by either its own output layer
or the base model's (shared at call time), so untrained heads reproduce the base model.

Two kinds of heads:
- independent (Medusa-1): every head reads h_t alone, so all heads run in one batched call;
- sequential (Hydra-style, `sequential=True`): head k also sees the candidate token before the one it
  guesses. With u_{-1} = h_t and x_{t+1} the base model's own next token,
      u_k = blocks_k(u_{k-1} + P_k embed(x_{t+1+k}))      logits_k = output(u_k)   (guesses x_{t+2+k})
  so a tree is drafted depth by depth, each node's children conditioned on the path to it.

An optional draft vocabulary (`draft_vocab`, the most frequent token ids of the training data) limits
the heads' output layer to those rows: a [V', H] matmul instead of [V, H] per call (V' << V).

Heads remember which base model they were made for (`model_identity`) and refuse a different one.
Checkpoints are a folder with `config.json` and `model.safetensors`; loading checks everything first.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import Tensor, nn

from ..io import atomic_write, atomic_write_text
from .checkpoint_files import CONFIG_NAME, WEIGHTS_NAME, check_tensors, draft_vocab_problem, read_checkpoint

FORMAT = "treespec.medusa_heads"
VERSION = 1  # version 1 files without the `sequential` / `draft_vocab_size` fields still load
TREE_NAME = "tree.json"
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
    return f"{identity['name']} (hidden {identity.get('hidden_size')}, vocab {identity.get('vocab_size')})"


def check_made_for(made_for: dict[str, Any], model: nn.Module, subject: str, hint: str) -> None:
    """Raise ValueError unless `model` has the sizes and weight fingerprint of the base model recorded as
    `made_for` (a `model_identity`; a missing fingerprint is not compared). subject: who was made for it,
    e.g. "these heads were trained for"; hint: what to do instead."""
    theirs = model_identity(model)
    problem = ""
    sizes = (made_for.get("hidden_size"), made_for.get("vocab_size"))
    if sizes != (theirs["hidden_size"], theirs["vocab_size"]):
        problem = " with different sizes"
    elif made_for.get("fingerprint") is not None and not fingerprints_match(
        made_for["fingerprint"], theirs["fingerprint"]
    ):
        problem = " with different weights (embedding fingerprint mismatch)"
    if problem:
        raise ValueError(
            f"{subject} {_describe(made_for)} but the model is {_describe(theirs)}{problem}; {hint}"
        )


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
        sequential: bool = False,
        draft_vocab_size: int = 0,
        exit_layer: int = 0,
        *,
        device: Any = None,
        dtype: torch.dtype | None = None,
    ):
        """exit_layer 0: heads on the base model's final hidden state (Medusa). exit_layer k > 0: an
        exit head for self-speculative drafting (`drafters.self_spec`): head 0 reads the residual stream
        after the base model's first k layers, through the final norm, and predicts the *next* token."""
        super().__init__()
        for field, value, low in (
            ("num_heads", num_heads, 1),
            ("hidden_size", hidden_size, 1),
            ("vocab_size", vocab_size, 1),
            ("num_layers", num_layers, 0),
            ("draft_vocab_size", draft_vocab_size, 0),
            ("exit_layer", exit_layer, 0),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{field} must be an integer >= {low}, got {value!r}")
        if draft_vocab_size > vocab_size:
            raise ValueError(f"draft_vocab_size {draft_vocab_size} exceeds the vocabulary ({vocab_size})")
        self.num_heads = num_heads
        self.hidden_size = hidden_size
        self.vocab_size = vocab_size
        self.num_layers = num_layers
        self.own_lm_head = bool(own_lm_head)
        self.sequential = bool(sequential)
        self.draft_vocab_size = draft_vocab_size
        self.exit_layer = exit_layer
        self.base_model = dict(base_model) if base_model is not None else None
        self.tree = None  # the candidate tree calibrated for these heads (from_pretrained: tree.json)
        self.blocks = nn.ModuleList(
            nn.Sequential(*(ResidualBlock(hidden_size, device, dtype) for _ in range(num_layers)))
            for _ in range(num_heads)
        )
        # sequential heads: P_k maps the embedding of the token before head k's guess into its input
        self.token_proj = (
            nn.ModuleList(
                nn.Linear(hidden_size, hidden_size, bias=False, device=device, dtype=dtype)
                for _ in range(num_heads)
            )
            if self.sequential
            else None
        )
        if self.token_proj is not None:
            for proj in self.token_proj:
                nn.init.zeros_(proj.weight)
        out_size = draft_vocab_size or vocab_size
        self.lm_heads = (
            nn.ModuleList(
                nn.Linear(hidden_size, out_size, bias=False, device=device, dtype=dtype)
                for _ in range(num_heads)
            )
            if self.own_lm_head
            else None
        )
        if draft_vocab_size:
            # draft index i -> token id draft_vocab[i]; set by the trainer (most frequent tokens first)
            self.register_buffer(
                "draft_vocab", torch.arange(draft_vocab_size, device=device, dtype=torch.long)
            )
        else:
            self.draft_vocab = None

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
            "sequential": self.sequential,
            "draft_vocab_size": self.draft_vocab_size,
            "exit_layer": self.exit_layer,
            "base_model": self.base_model,
            "dtype": str(first.dtype).removeprefix("torch.") if first is not None else None,
        }

    def _cast(self, x: Tensor) -> Tensor:
        first = next(self.parameters(), None)
        return x.to(first.dtype) if first is not None else x

    def advance(self, k: int, state: Tensor, token_embedding: Tensor) -> Tensor:
        """Sequential head k: u_k = blocks_k(u_{k-1} + P_k e); state, token_embedding [..., H] -> [..., H]."""
        return self.blocks[k](self._cast(state) + self.token_proj[k](self._cast(token_embedding)))

    def head_hidden(
        self, hidden: Tensor, num_heads: int | None = None, token_embeddings: Tensor | None = None
    ) -> Tensor:
        """Each head's transformed hidden state, before the output layer: [B, T, H] -> [K, B, T, H].

        num_heads: run only the first `num_heads` heads (a shallow tree needs no deeper heads).
        token_embeddings [K, B, T, H]: sequential heads only: the embedding of the token before each head's
        guess (x_{t+1+k} for head k; teacher forcing in training).
        """
        if hidden.shape[-1] != self.hidden_size:
            raise ValueError(f"hidden has size {hidden.shape[-1]} but the heads expect {self.hidden_size}")
        hidden = self._cast(hidden)
        count = len(self.blocks[:num_heads])
        if not self.sequential:
            return torch.stack([blocks(hidden) for blocks in self.blocks[:count]])  # [K, B, T, H]
        if token_embeddings is None or token_embeddings.shape[0] < count:
            raise ValueError(
                "sequential heads need token_embeddings [K, ..., H]: the embedding of the token before each "
                "head's guess (see MedusaHeads.embed_tokens)"
            )
        states, state = [], hidden
        for k in range(count):
            state = self.advance(k, state, token_embeddings[k])  # [B, T, H]
            states.append(state)
        return torch.stack(states)  # [K, B, T, H]

    def output_weight(self, lm_head: nn.Module | Tensor | None) -> Tensor | None:
        """The shared output matrix restricted to the draft vocabulary: [V', H] (V' = V without one).

        Compute it once and pass it to `logits` (which needs it); `forward` and `predict` call it
        themselves, so they take either weight. Returns None for heads with their own output layers.
        """
        if self.own_lm_head:
            return None
        if lm_head is None:
            raise ValueError(
                "these heads share the base model's output layer: pass it as lm_head "
                "(e.g. heads(hidden, model.get_output_embeddings()))"
            )
        weight = lm_head if isinstance(lm_head, Tensor) else getattr(lm_head, "weight", None)
        if weight is None:
            raise ValueError("lm_head must be a Linear layer or its weight [V, H]")
        if weight.shape[-1] != self.hidden_size or weight.shape[0] not in (
            self.vocab_size,
            self.draft_vocab_size or self.vocab_size,
        ):
            raise ValueError(
                f"lm_head weight has shape {tuple(weight.shape)} but the heads expect "
                f"[{self.vocab_size}, {self.hidden_size}]"
            )
        if self.draft_vocab is not None and weight.shape[0] == self.vocab_size:
            weight = weight[self.draft_vocab.to(weight.device)]  # [V', H]
        return weight

    def logits(self, states: Tensor, weight: Tensor | None, head: int | None = None) -> Tensor:
        """Logits over the draft vocabulary: states [K, ..., H] -> [K, ..., V'] (or [..., H] -> [..., V']
        for one `head`). weight: from `output_weight` (ignored by heads with their own output layers)."""
        if self.own_lm_head:
            if head is not None:
                return self.lm_heads[head](states)
            return torch.stack([lm(s) for lm, s in zip(self.lm_heads, states, strict=False)])
        if weight is None or weight.shape[0] != (self.draft_vocab_size or self.vocab_size):
            raise ValueError("pass the output weight from MedusaHeads.output_weight(lm_head)")
        return F.linear(states.to(weight.dtype), weight)

    def token_ids(self, index: Tensor) -> Tensor:
        """Draft-vocabulary indices -> token ids (the identity without a draft vocabulary)."""
        if self.draft_vocab is None:
            return index
        return self.draft_vocab.to(index.device)[index]

    def draft_index(self, token_ids: Tensor) -> Tensor:
        """Token ids -> draft-vocabulary indices, -100 for ids outside it (and for negative ids)."""
        if self.draft_vocab is None:
            return torch.where(token_ids >= 0, token_ids, torch.full_like(token_ids, -100))
        table = torch.full((self.vocab_size,), -100, dtype=torch.long, device=token_ids.device)
        index = torch.arange(self.draft_vocab_size, device=token_ids.device)  # [V']
        table[self.draft_vocab.to(token_ids.device)] = index
        return torch.where(token_ids >= 0, table[token_ids.clamp(min=0)], torch.full_like(token_ids, -100))

    def narrowed(self, draft_vocab_size: int) -> MedusaHeads:
        """A copy whose draft vocabulary keeps only its first `draft_vocab_size` tokens (the most frequent:
        the trainer orders them so), with the matching rows of their own output layers if they have
        them. A smaller output matrix per drafted level; measure the acceptance it costs
        (`training.calibrate.acceptance_table`) before shipping it."""
        if self.draft_vocab is None:
            raise ValueError("these heads have no draft vocabulary to narrow (they propose from all tokens)")
        if not 0 < draft_vocab_size <= self.draft_vocab_size:
            raise ValueError(
                f"draft_vocab_size must be in 1..{self.draft_vocab_size} (the current size), "
                f"got {draft_vocab_size}"
            )
        first = next(self.parameters())
        config = {k: v for k, v in self.config.items() if k not in ("format", "version", "dtype")}
        config["draft_vocab_size"] = draft_vocab_size
        narrow = type(self)(**config, device=first.device, dtype=first.dtype)
        state = {
            name: value[:draft_vocab_size] if name == "draft_vocab" or name.startswith("lm_heads.") else value
            for name, value in self.state_dict().items()
        }
        narrow.load_state_dict(state)
        narrow.tree = self.tree
        return narrow

    @staticmethod
    def embed_tokens(embedding: nn.Module | Tensor, token_ids: Tensor) -> Tensor:
        """Input embeddings of token ids (negative ids, i.e. padding, embed as token 0): [...] -> [..., H]."""
        weight = embedding if isinstance(embedding, Tensor) else embedding.weight
        return F.embedding(token_ids.clamp(min=0), weight)

    def predict(
        self, hidden: Tensor, tokens: Tensor, lm_head: nn.Module | Tensor | None, embedding: Any = None
    ) -> Tensor:
        """Teacher-forced logits at known positions (training and evaluation).

        hidden [M, H] (h_t); tokens [M, >=K] the true tokens x_{t+1}, x_{t+2}, ... (x_{t+1+k} is what
        sequential head k conditions on; -100 = past the end); embedding: the base model's input embedding
        (module or weight), needed by sequential heads. Returns [K, M, V'] logits over the draft vocabulary.
        """
        embeddings = None
        if self.sequential:
            if embedding is None:
                raise ValueError("sequential heads need the base model's input embedding")
            embeddings = self.embed_tokens(embedding, tokens[:, : self.num_heads].T)[:, None]  # [K, 1, M, H]
        return self(hidden[None], lm_head, token_embeddings=embeddings)[:, 0]  # [K, M, V']

    def forward(
        self,
        hidden: Tensor,
        lm_head: nn.Module | Tensor | None = None,
        num_heads: int | None = None,
        token_embeddings: Tensor | None = None,
    ) -> Tensor:
        """Logits of every head: hidden [B, T, H] -> [K, B, T, V'] (V' = V without a draft vocabulary).

        lm_head (the base model's output layer, or its weight [V, H]) is required when the heads share it,
        and ignored when they have their own. num_heads: only the first `num_heads` heads (K = num_heads).
        token_embeddings: for sequential heads, see `head_hidden`.
        """
        states = self.head_hidden(hidden, num_heads, token_embeddings)  # [K, B, T, H]
        return self.logits(states, self.output_weight(lm_head))  # [K, B, T, V']

    # -----------------------------------------------------------------------------------------------------
    # Building for a model, and checking the model
    # -----------------------------------------------------------------------------------------------------

    @classmethod
    def for_model(
        cls,
        model: nn.Module,
        num_heads: int = 4,
        num_layers: int = 1,
        own_lm_head: bool = False,
        sequential: bool = False,
        draft_vocab: Tensor | None = None,
        exit_layer: int = 0,
    ) -> MedusaHeads:
        """Fresh (identity) heads sized for `model`, on its output layer's device and dtype.

        draft_vocab: token ids [V'] the heads may propose (e.g. the most frequent ones); None = all.
        """
        hidden_size, vocab_size = _model_sizes(model)
        reference = _reference_weight(model)
        kind = ExitHead if exit_layer else cls
        heads = kind(
            num_heads,
            hidden_size,
            vocab_size,
            num_layers,
            own_lm_head,
            base_model=model_identity(model),
            sequential=sequential,
            draft_vocab_size=0 if draft_vocab is None else len(draft_vocab),
            exit_layer=exit_layer,
            device=reference.device,
            dtype=reference.dtype,
        )
        if draft_vocab is not None:
            ids = torch.as_tensor(draft_vocab, dtype=torch.long)
            problem = draft_vocab_problem(ids, vocab_size)
            if problem:
                raise ValueError(f"draft_vocab {problem}")
            heads.draft_vocab.copy_(ids)
        if own_lm_head:
            output = model.get_output_embeddings()
            if output is None or tuple(output.weight.shape) != (vocab_size, hidden_size):
                raise ValueError(
                    f"own_lm_head needs the model's output layer of shape [{vocab_size}, {hidden_size}]"
                )
            rows = output.weight if heads.draft_vocab is None else output.weight[heads.draft_vocab]
            with torch.no_grad():
                for head in heads.lm_heads:
                    head.weight.copy_(rows)
        return heads

    def check_compatible(self, model: nn.Module) -> None:
        """Raise ValueError unless these heads were made for `model` (sizes and weight fingerprint)."""
        ours = dict(self.base_model or {"name": "an unrecorded model"})
        ours["hidden_size"], ours["vocab_size"] = self.hidden_size, self.vocab_size
        check_made_for(ours, model, "these heads were trained for", _TRAIN_HINT)

    # -----------------------------------------------------------------------------------------------------
    # Saving and loading
    # -----------------------------------------------------------------------------------------------------

    def save_pretrained(self, folder: str | os.PathLike) -> None:
        """Write folder/config.json, folder/model.safetensors and (when the heads have one) tree.json,
        each replaced atomically."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        tensors = {name: t.detach().contiguous().cpu() for name, t in self.state_dict().items()}
        config_text = json.dumps(self.config, indent=2) + "\n"
        atomic_write(folder / WEIGHTS_NAME, lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"}))
        atomic_write_text(folder / CONFIG_NAME, config_text)
        if self.tree is not None:  # the calibrated tree travels with the heads
            self.tree.save(folder / TREE_NAME)

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
        `device` / `dtype` are given. The folder's `tree.json` (the tree calibrated for these heads,
        scripts/calibrate_tree.py), when present, becomes `heads.tree`, else `heads.tree` is None; a tree
        deeper than the heads is refused. Raises HeadsLoadError (a ValueError) naming the folder.
        """
        from ..core.tree import Tree

        folder = Path(folder)
        config, tensors = read_checkpoint(folder, "heads", FORMAT, VERSION, HeadsLoadError)
        _check_config(folder / CONFIG_NAME, config)
        tree, tree_path = None, folder / TREE_NAME
        if tree_path.is_file():
            try:
                tree = Tree.load(tree_path)
            except (OSError, ValueError) as error:
                raise HeadsLoadError(f"cannot read the tree of the heads in {folder}: {error}") from error
            if tree.max_depth > config["num_heads"]:
                raise HeadsLoadError(
                    f"{tree_path} has depth {tree.max_depth} but the heads in {folder} have only "
                    f"{config['num_heads']} (one per tree level): recalibrate the tree for these heads "
                    "(scripts/calibrate_tree.py) or remove tree.json"
                )
        kind = ExitHead if config.get("exit_layer", 0) else MedusaHeads
        if not issubclass(kind, cls):
            raise HeadsLoadError(f"{folder} holds {kind.__name__} weights; load them with {kind.__name__}")
        with torch.device("meta"):
            heads = kind(**{k: config[k] for k in _CONFIG_FIELDS if k in config})
        check_tensors(
            folder / WEIGHTS_NAME, tensors, heads.state_dict(), config["vocab_size"], HeadsLoadError
        )
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
        heads = heads.to(device=device, dtype=dtype)
        heads.tree = tree
        return heads


# ---------------------------------------------------------------------------------------------------------
# Checkpoint helpers
# ---------------------------------------------------------------------------------------------------------

_CONFIG_FIELDS = (
    "num_heads",
    "hidden_size",
    "vocab_size",
    "num_layers",
    "own_lm_head",
    "base_model",
    "sequential",
    "draft_vocab_size",
    "exit_layer",
)


class ExitHead(MedusaHeads):
    """One head on the residual stream after the base model's first `exit_layer` layers (through the final
    norm), predicting the next token: the drafter of self-speculative decoding (`drafters.self_spec`).
    Same weights and checkpoint format as MedusaHeads; `from_pretrained` gives this class for a folder
    whose config has exit_layer > 0, and Medusa drafters refuse it."""

    def __init__(self, *args, exit_layer: int = 1, **kwargs):
        super().__init__(*args, exit_layer=exit_layer, **kwargs)
        if self.exit_layer < 1 or self.num_heads != 1 or self.sequential:
            raise ValueError(
                f"an exit head is one independent head with exit_layer >= 1; got num_heads={self.num_heads}, "
                f"sequential={self.sequential}, exit_layer={self.exit_layer}"
            )

    @classmethod
    def for_model(cls, model: nn.Module, exit_layer: int = 1, **kwargs) -> ExitHead:
        """A fresh (identity) exit head on layer `exit_layer` of `model`."""
        return MedusaHeads.for_model(model, num_heads=1, exit_layer=exit_layer, **kwargs)


def _check_config(path: Path, config: dict[str, Any]) -> None:
    """The fields of a heads config.json (format and version checked by `read_checkpoint`): their types."""
    for field, low in (("num_heads", 1), ("hidden_size", 1), ("vocab_size", 1), ("num_layers", 0)):
        value = config.get(field)
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise HeadsLoadError(f"{path}: {field} must be an integer >= {low}, got {value!r}")
    if not isinstance(config.get("own_lm_head"), bool):
        raise HeadsLoadError(f"{path}: own_lm_head must be true or false, got {config.get('own_lm_head')!r}")
    if not isinstance(config.get("sequential", False), bool):
        raise HeadsLoadError(f"{path}: sequential must be true or false, got {config.get('sequential')!r}")
    exit_layer = config.get("exit_layer", 0)
    if isinstance(exit_layer, bool) or not isinstance(exit_layer, int) or exit_layer < 0:
        raise HeadsLoadError(f"{path}: exit_layer must be an integer >= 0, got {exit_layer!r}")
    draft = config.get("draft_vocab_size", 0)
    if isinstance(draft, bool) or not isinstance(draft, int) or not 0 <= draft <= config["vocab_size"]:
        raise HeadsLoadError(f"{path}: draft_vocab_size must be an integer in [0, vocab_size], got {draft!r}")
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
