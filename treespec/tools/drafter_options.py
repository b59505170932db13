"""Drafters from command-line options: the one implementation behind `treespec generate`, `treespec tune`
and `treespec bench`.

    --heads FOLDER / --num-heads K / --tree SPEC        Medusa heads and their candidate tree
    --draft-model FOLDER / --exit-head FOLDER           a chain drafter (draft model, self-speculative)
    --gamma N / --branching D:K,... / --storage S      its settings
    --eagle FOLDER / --eagle-tree SPEC                  an EAGLE-style draft layer and the tree it drafts

Without --heads, the default model (no --model) gets its trained heads from `default_heads_folder()`
(packaged in the wheel, or the checkout's heads/), with their calibrated tree.json as `heads.tree`;
any other model gets untrained heads and a warning. Errors a user can cause raise ValueError naming
the option's value (the CLI prints them as one line).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..core.tree import Tree, default_tree
from ..drafters.heads import MedusaHeads
from ..training.tune import default_gamma
from .models import DEFAULT_EAGLE_NAME, default_heads_folder

# ----- Medusa heads and their tree -----


def add_heads_arguments(p, tree: str | None = None) -> None:
    """--heads, --tree (default `tree`, else the heads' tree.json) and --num-heads, as `treespec generate`
    and the benchmarks take them."""
    p.add_argument(
        "--heads",
        default=None,
        help="trained heads folder (default: the default model's shipped heads, "
        f"{default_heads_folder()}; untrained heads for another --model)",
    )
    p.add_argument(
        "--tree",
        default=tree,
        help="tree JSON file, a folder with tree.json, a default tree size (8, 16, 32, 64), or "
        "'machine' (the heads' trees priced on this machine once, then kept); default: "
        + (f"{tree!r}" if tree else "the heads folder's tree.json, else the 32-node default tree"),
    )
    p.add_argument("--num-heads", type=int, default=4, help="number of untrained heads (default 4)")


def heads_folder(option: str | None, model_option: str | None) -> Path | None:
    """The heads folder to load: --heads when given (it must be a folder), else the default heads when
    the default model is used (no --model) and they exist, else None (untrained heads)."""
    if option:
        path = Path(option)
        if not path.is_dir():
            raise ValueError(f"{path}: not a heads folder (expected a directory saved by MedusaHeads)")
        return path
    default = default_heads_folder()
    return default if model_option is None and default.is_dir() else None


def eagle_folder(option: str | None, model_option: str | None) -> str:
    """The EAGLE-style drafter to load: --eagle when given, else the default model's shipped one
    (heads/smollm2-135m-instruct-eagle) when the default model is used (no --model)."""
    if option:
        return option
    shipped = default_heads_folder(DEFAULT_EAGLE_NAME)
    if model_option is not None:
        raise ValueError(
            f"the shipped EAGLE-style drafter ({shipped}) belongs to the default model: for --model "
            f"{model_option} pass --eagle FOLDER (train one with scripts/train_eagle.py)"
        )
    if not (shipped / "config.json").is_file():
        raise ValueError(f"no EAGLE-style drafter at {shipped}: pass --eagle FOLDER (scripts/train_eagle.py)")
    return str(shipped)


def load_heads(folder: Path | None, model: nn.Module, num_heads: int = 4) -> tuple[MedusaHeads, str]:
    """(heads, description): the trained heads in `folder` (with `heads.tree` from its tree.json); without
    a folder, `num_heads` untrained heads and a warning on stderr."""
    if folder is not None:
        heads = MedusaHeads.from_pretrained(folder, model=model)
        return heads, f"{folder} ({heads.num_heads} heads)"
    print(
        f"warning: no trained heads (the default ones, {default_heads_folder()}, fit the default model "
        f"only); using {num_heads} untrained heads, so expect a mean accepted length near 1 and no "
        "speedup. Pass --heads FOLDER for trained ones.",
        file=sys.stderr,
    )
    heads = MedusaHeads.for_model(model, num_heads=num_heads)
    return heads, f"untrained identity heads ({heads.num_heads})"


MACHINE = "machine"  # --tree machine: the heads' tree priced on this machine


def parse_tree(spec: str) -> Tree | int:
    """--tree: a tree JSON file, a folder holding tree.json, or a default tree size ("32", returned as
    an int for `default_tree` once the number of heads is known), or "machine" (the heads' tree priced on
    this machine, `training.costs.machine_tree`). A bad file raises ValueError now, before any model loads."""
    if spec == MACHINE:
        return MACHINE
    if spec.isdigit():
        return int(spec)
    path = Path(spec)
    if path.is_dir():
        path = path / "tree.json"
        if not path.is_file():
            raise ValueError(f"{spec}: folder has no tree.json")
    return Tree.load(path)


def pick_tree(
    choice: Tree | int | str | None,
    heads: MedusaHeads,
    source: str = "--tree",
    folder=None,
    model=None,
) -> tuple[Tree | None, str]:
    """(tree, description) for `heads`: an explicit tree (from `parse_tree`) wins; a size becomes
    `default_tree(size, heads.num_heads)`; "machine" prices the trees of the heads `folder` on `model`
    here (`training.costs.machine_tree`: measured once, then kept); None gives `heads.tree` (the heads
    folder's tree.json), which is None for heads without one (generate then uses its 32-node default
    tree)."""
    if choice == MACHINE:
        from ..training.costs import machine_tree

        if folder is None or model is None:
            raise ValueError("--tree machine needs a heads folder (trained heads with acceptance.json)")
        progress = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
        return machine_tree(model, heads, folder, progress=progress)
    if isinstance(choice, int):
        tree = default_tree(choice, heads.num_heads)
        return tree, f"default_tree({choice}, {heads.num_heads})"
    if choice is not None:
        if choice.max_depth > heads.num_heads:
            raise ValueError(
                f"{source}: the tree has depth {choice.max_depth} but the heads have {heads.num_heads} "
                "(one per tree level); give a shallower tree"
            )
        return choice, source
    if heads.tree is not None:
        return heads.tree, "the heads' tree.json"
    return None, "none"


def describe_tree(tree: Tree, source: str) -> str:
    return f"{source}: {tree.num_nodes} nodes, depth {tree.max_depth}"


# ----- chain drafters: a draft model or an exit head -----


@dataclass
class ChainSource:
    """A chain drafter's model, loaded once: the draft model (--draft-model) or the exit head
    (--exit-head). `drafter(...)` builds a fresh drafter on it for each generation."""

    kind: str  # "draft_model" or "exit_head"
    folder: Path
    module: nn.Module  # the draft model (HF causal LM) or the exit head (MedusaHeads, exit_layer > 0)
    gamma: int  # --gamma, else the folder's tune.json, else 4

    @property
    def description(self) -> str:
        if self.kind == "draft_model":
            return f"{self.folder} ({self.module.config.num_hidden_layers} layers), gamma {self.gamma}"
        return f"{self.folder} (exit layer {self.module.exit_layer}), gamma {self.gamma}"

    def drafter(self, model: nn.Module, gamma: int | None = None, storage: str = "model", branching=None):
        """A DraftModelDrafter or SelfSpeculativeDrafter drafting `gamma` tokens (default: self.gamma).
        storage and branching ("D:K,..." or {depth: k}) apply to the draft model only."""
        gamma = self.gamma if gamma is None else gamma
        if self.kind == "draft_model":
            from ..drafters.draft_model import DraftModelDrafter, parse_branching

            if isinstance(branching, str) or branching is None:
                branching = parse_branching(branching, gamma)
            return DraftModelDrafter(self.module, gamma, storage=storage, branching=branching)
        from ..drafters.self_spec import SelfSpeculativeDrafter

        if branching:
            raise ValueError("--branching applies to --draft-model only")
        return SelfSpeculativeDrafter(model, self.module, gamma)


def existing_folder(option: str, flag: str) -> Path:
    """The folder an option names; ValueError when it is not one (checked before a model loads)."""
    path = Path(option)
    if not path.is_dir():
        raise ValueError(f"{flag} {option}: no such folder")
    return path


def load_draft_model_option(folder: str, model: nn.Module, gamma: int | None = None) -> ChainSource:
    """--draft-model FOLDER: an HF causal LM with the target's vocabulary, on the target's device/dtype."""
    from ..drafters.draft_model import load_draft_model

    path = existing_folder(folder, "--draft-model")
    return ChainSource("draft_model", path, load_draft_model(path, model), default_gamma(path, gamma))


def load_exit_head_option(folder: str, model: nn.Module, gamma: int | None = None) -> ChainSource:
    """--exit-head FOLDER: an exit head (MedusaHeads with exit_layer > 0) for self-speculative drafting."""
    path = existing_folder(folder, "--exit-head")
    head = MedusaHeads.from_pretrained(path, model=model)
    return ChainSource("exit_head", path, head, default_gamma(path, gamma))


def load_chain_option(
    model: nn.Module, draft_model: str | None = None, exit_head: str | None = None, gamma: int | None = None
) -> ChainSource | None:
    """The chain drafter the options ask for (--draft-model or --exit-head, not both), or None."""
    if draft_model and exit_head:
        raise ValueError("give --draft-model or --exit-head, not both")
    if draft_model:
        return load_draft_model_option(draft_model, model, gamma)
    if exit_head:
        return load_exit_head_option(exit_head, model, gamma)
    return None


# ----- the EAGLE-style drafter -----

EAGLE_DEFAULT_CHAIN = 4  # tokens drafted when the drafter folder has no tree.json and no --eagle-tree


def add_eagle_tree_argument(p) -> None:
    """--eagle-tree, as `treespec generate` and the benchmarks take it."""
    p.add_argument(
        "--eagle-tree",
        default=None,
        help="with --eagle (or an eagle recipe): tree JSON file, folder with tree.json, or N (a chain of N "
        f"tokens); default: the drafter's tree.json, else a chain of {EAGLE_DEFAULT_CHAIN}",
    )


@dataclass
class EagleSource:
    """An EAGLE draft layer (--eagle), loaded once, and the tree it drafts (--eagle-tree, else the folder's
    tree.json, else a chain of EAGLE_DEFAULT_CHAIN tokens). `drafter(model)` builds a fresh drafter."""

    folder: Path
    module: nn.Module  # EagleDraftModel
    tree: Tree
    tree_source: str

    @property
    def description(self) -> str:
        return f"{self.folder} ({describe_tree(self.tree, self.tree_source)})"

    def drafter(self, model: nn.Module):
        from ..drafters.eagle import EagleDrafter

        return EagleDrafter(self.module, self.tree, model)


def load_eagle_option(folder: str, model: nn.Module, tree_spec: str | None = None) -> EagleSource:
    """--eagle FOLDER (treespec.EagleDraftModel.save_pretrained / scripts/train_eagle.py) and --eagle-tree: a
    tree JSON file, a folder with tree.json, or a number N (a chain of N drafted tokens)."""
    from ..drafters.eagle_model import EagleDraftModel

    path = existing_folder(folder, "--eagle")
    on_cpu = model.get_output_embeddings().weight.device.type == "cpu"
    # on CPU the drafter runs in float32 whatever the target's dtype, its weights rounded to Q8_0 blocks:
    # treespec's block kernel then reads ~1.1 bytes per weight, and beats bf16 GEMMs at these few rows
    module = EagleDraftModel.from_pretrained(path, model=model, dtype=torch.float32 if on_cpu else None)
    if on_cpu:
        module.round_to_blocks()
    if tree_spec and tree_spec.isdigit():
        depth = int(tree_spec)
        return EagleSource(
            path, module, Tree.from_choices([[0] * d for d in range(1, depth + 1)]), f"chain of {depth}"
        )
    if tree_spec:
        tree = parse_tree(tree_spec)
        return EagleSource(path, module, tree, tree_spec)
    if module.tree is not None:
        return EagleSource(path, module, module.tree, "the drafter's tree.json")
    chain = [[0] * d for d in range(1, EAGLE_DEFAULT_CHAIN + 1)]
    return EagleSource(path, module, Tree.from_choices(chain), f"chain of {EAGLE_DEFAULT_CHAIN}")
