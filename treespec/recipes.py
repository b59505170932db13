"""Recipes: which drafters draft, whether a per-step pricer prunes their tree, and their settings, by name.

One table (`RECIPES`) is what `generate(model, prompts, drafter="NAME")`, `treespec generate --drafter
NAME`, `make demo` and `treespec bench --methods NAME` read, so each name means the same drafter
everywhere:

    recipe = RECIPES["dynamic+suffix"]          # or resolve("auto", model)
    parts = Parts.shipped(model, recipe)        # the default model's shipped heads, EAGLE layer, answers
    new_drafter = drafter_factory(recipe, parts)
    treespec.generate(model, prompt, new_drafter(), tokenizer)

Sources: "heads" (Medusa heads in their tree), "eagle" (the EAGLE-style draft layer in its tree), "suffix"
(suffix trees over the prompt, the answer and earlier answers), "recycling" (trees walked through the
target's own top-k); a prompt-lookup chain of `lookup` tokens goes beside any of them. A recipe's sources
go to one `TreePlanner` (eagle, heads, suffix, recycling, then the lookup chain, in that order), which
merges their trees every step; a dynamic recipe's planner cuts the merged tree to the nodes worth
verifying on this machine (priced on its verification cost curve). A static recipe of one source and no
lookup chain drafts that source's tree as it is.

"auto" is the best shipped recipe for the model: for the default model with its shipped heads,
"dynamic+suffix" (what the demo runs and the README's headline figure measures); for any other model
"plain" (no trained drafter ships for it: pass a `Recipe` with your own parts, or a `Drafter`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from torch import nn

from .core.drafting import Drafter
from .core.packed import BLOCK_ROWS_MAX
from .core.planner import TreePlanner
from .core.runtime import TargetRuntime
from .core.tree import Tree, default_tree
from .drafters.heads import MedusaHeads
from .drafters.lookup import PromptLookup
from .drafters.medusa import make_drafter
from .drafters.recycling import RecyclingDrafter
from .drafters.suffix import SuffixCache, SuffixDrafter

SOURCES = ("eagle", "heads", "suffix", "recycling")  # in the order a planner merges them
AUTO = "auto"
FALLBACK_TREE_NODES = 32  # heads without a tree.json draft into default_tree(32, heads)


@dataclass(frozen=True)
class Recipe:
    """Which drafters draft and how (see the module docstring).

    sources: drafters from `SOURCES`; dynamic: the planner cuts the merged tree every step on this
    machine's cost curve (else it verifies every merged node); nodes: the heads' tree size (None: their
    tree.json, else 32 nodes); lookup: a prompt-lookup chain of this many tokens (0: none); suffix_nodes /
    suffix_depth: the largest suffix tree per step; warm: the suffix cache starts from the model's shipped
    earlier answers (the default model's; a cold cache otherwise)."""

    name: str
    description: str
    sources: tuple[str, ...] = ()
    dynamic: bool = False
    nodes: int | None = None
    lookup: int = 0
    suffix_nodes: int = 16
    suffix_depth: int = 6
    warm: bool = True

    def __post_init__(self) -> None:
        unknown = [s for s in self.sources if s not in SOURCES]
        if unknown:
            raise ValueError(f"recipe {self.name!r}: unknown source(s) {unknown}; choose from {SOURCES}")
        if self.lookup < 0 or (self.nodes is not None and self.nodes < 1):
            raise ValueError(f"recipe {self.name!r}: lookup must be >= 0 and nodes >= 1")

    @property
    def shared(self) -> bool:
        """One drafter serves every call (what it learns carries over: a pricer's calibration, a suffix
        cache, a recycling table); a static heads / EAGLE / lookup drafter is built fresh per call."""
        return self.dynamic or bool({"suffix", "recycling"} & set(self.sources))


LOOKUP = 8  # prompt-lookup chain length of every recipe that has one
LONG_SUFFIX = {"suffix_nodes": 24, "suffix_depth": 16}  # under a pricer: long copies, kept where they pay

RECIPES: dict[str, Recipe] = {
    r.name: r
    for r in (
        Recipe("plain", "no drafter: one token per step on treespec's cache and attention"),
        Recipe("heads", "the Medusa heads drafting their tree.json (a static tree)", ("heads",)),
        Recipe("lookup", f"a prompt-lookup chain of {LOOKUP} tokens, no trained drafter", lookup=LOOKUP),
        Recipe("heads+lookup", "the heads' tree and a prompt-lookup chain", ("heads",), lookup=LOOKUP),
        Recipe("eagle", "the EAGLE-style draft layer drafting its tree.json", ("eagle",)),
        Recipe("eagle+lookup", "the EAGLE-style tree and a prompt-lookup chain", ("eagle",), lookup=LOOKUP),
        Recipe("suffix", "suffix trees over the prompt, the answer and earlier answers", ("suffix",)),
        Recipe("recycling", "trees walked through the target's own top-k after each token", ("recycling",)),
        Recipe(
            "dynamic",
            "heads + lookup chain, pruned every step to what pays here",
            ("heads",),
            True,
            lookup=LOOKUP,
        ),
        Recipe(
            "dynamic+suffix",
            "heads + suffix trees (warm cache), pruned every step to what pays here",
            ("heads", "suffix"),
            True,
            **LONG_SUFFIX,
        ),
        Recipe(
            "dynamic+all",
            "heads + suffix + recycling trees, pruned every step",
            ("heads", "suffix", "recycling"),
            True,
            **LONG_SUFFIX,
        ),
        Recipe("eagle+dynamic", "EAGLE + lookup chain, pruned every step", ("eagle",), True, lookup=LOOKUP),
        Recipe(
            "eagle+suffix",
            "EAGLE + suffix trees (warm cache), pruned every step",
            ("eagle", "suffix"),
            True,
            **LONG_SUFFIX,
        ),
        Recipe(
            "eagle+all",
            "EAGLE + suffix + recycling trees, pruned every step",
            ("eagle", "suffix", "recycling"),
            True,
            **LONG_SUFFIX,
        ),
        Recipe(
            "all",
            "EAGLE + heads + suffix + recycling trees, pruned every step",
            ("eagle", "heads", "suffix", "recycling"),
            True,
            **LONG_SUFFIX,
        ),
    )
}
DEFAULT_RECIPE = "dynamic+suffix"  # "auto" for the default model with its shipped heads


def names() -> list[str]:
    """Every recipe name and "auto", for option choices and messages."""
    return [AUTO, *RECIPES]


def describe() -> str:
    """The table, one recipe a line: name, then its description."""
    width = max(map(len, RECIPES))
    return "\n".join(f"{name:<{width}}  {r.description}" for name, r in RECIPES.items())


def is_default_model(model: nn.Module) -> bool:
    """The embedded default model (`load_model()` names it so)."""
    from .tools.models import DEFAULT_MODEL_NAME

    return getattr(model.config, "name_or_path", None) == DEFAULT_MODEL_NAME


def auto_name(model: nn.Module) -> str:
    """The best shipped recipe for `model`: DEFAULT_RECIPE for the default model with its shipped heads,
    else "plain"."""
    from .tools.models import default_heads_folder

    shipped = (default_heads_folder() / "config.json").is_file()
    return DEFAULT_RECIPE if is_default_model(model) and shipped else "plain"


def resolve(recipe: str | Recipe, model: nn.Module) -> Recipe:
    """A recipe by name ("auto": `auto_name(model)`), or the `Recipe` given."""
    if isinstance(recipe, Recipe):
        return recipe
    name = auto_name(model) if recipe == AUTO else recipe
    if name not in RECIPES:
        raise ValueError(
            f"unknown drafter recipe {recipe!r}; choose from {', '.join(names())}:\n{describe()}"
        )
    return RECIPES[name]


@dataclass
class Parts:
    """What a recipe's drafter is built from, each loaded once: heads (+ the static tree they draft),
    a factory of fresh EAGLE drafters, a factory of fresh global suffix caches, and the verification
    cost model (nodes, prefix) -> seconds that a dynamic recipe prices on. `suffix_drafters`: every
    SuffixDrafter built, so a caller can save what it learned."""

    model: nn.Module
    heads: MedusaHeads | None = None
    tree: Tree | None = None
    eagle: Callable[[], Drafter] | None = None
    suffix_cache: Callable[[], SuffixCache | None] | None = None
    verify_seconds: Callable[[int, int], float] | None = None
    suffix_drafters: list[SuffixDrafter] = field(default_factory=list)

    @classmethod
    def shipped(
        cls,
        model: nn.Module,
        recipe: Recipe,
        compile: bool = False,
        numerics: str = "fast",
        cost_curve: str | Path | None = None,
        **given,
    ) -> Parts:
        """The parts `recipe` needs: those `given` (heads=, tree=, eagle=, suffix_cache=, verify_seconds=),
        the rest the default model's shipped ones (heads, EAGLE layer, earlier answers) and this machine's
        cost curve for the kernels that run (`compile`, `numerics`; measured quickly on first use).
        Raises ValueError naming what to pass when a part is missing (another model's heads, say)."""
        parts = cls(model, **given)
        if "heads" in recipe.sources and parts.heads is None:
            parts.heads = _shipped_heads(model, recipe.name)
        if "eagle" in recipe.sources and parts.eagle is None:
            parts.eagle = _shipped_eagle(model, recipe.name)
        if "suffix" in recipe.sources and parts.suffix_cache is None:
            parts.suffix_cache = _shipped_answers(model) if recipe.warm else SuffixCache
        if recipe.dynamic and parts.verify_seconds is None:
            from .training.costs import verify_cost_model

            parts.verify_seconds = verify_cost_model(
                model, compile=compile, curve_file=cost_curve, numerics=numerics
            )
        return parts


def _shipped_heads(model: nn.Module, recipe: str) -> MedusaHeads:
    from .tools.models import default_heads_folder

    folder = default_heads_folder()
    if not is_default_model(model) or not (folder / "config.json").is_file():
        raise ValueError(
            f"recipe {recipe!r} drafts with Medusa heads, and trained ones ship for the default model only: "
            "pass heads= (MedusaHeads.from_pretrained(folder, model=model); scripts/train_heads.py trains "
            "them)"
        )
    return MedusaHeads.from_pretrained(folder, model=model)


def _shipped_eagle(model: nn.Module, recipe: str) -> Callable[[], Drafter]:
    from .tools import drafter_options as options

    if not is_default_model(model):
        raise ValueError(
            f"recipe {recipe!r} drafts with an EAGLE-style layer, and one ships for the default model only: "
            "pass eagle= (a function returning an EagleDrafter; scripts/train_eagle.py trains the layer)"
        )
    source = options.load_eagle_option(options.eagle_folder(None, None), model)
    return lambda: source.drafter(model)


def _shipped_answers(model: nn.Module) -> Callable[[], SuffixCache | None]:
    """A fresh suffix cache holding the default model's shipped earlier answers; a cold one for another
    model (or a checkout without them)."""
    from .tools.models import default_suffix_cache_file

    file = default_suffix_cache_file()
    if is_default_model(model) and file.is_file():
        return lambda: SuffixCache.load(file)
    return SuffixCache


def build(recipe: Recipe, parts: Parts, compile: bool = False) -> Drafter | None:
    """A new drafter for `recipe` from `parts` (None for "plain"). compile: the verification is
    compiled, so a planner's suffix tree keeps the whole tree within BLOCK_ROWS_MAX nodes (one compiled
    size class) unless the other trees are larger already."""
    sources: list[Drafter] = []
    for name in recipe.sources:
        if name == "heads":
            sources.append(_heads_drafter(recipe, parts))
        elif name == "eagle":
            sources.append(parts.eagle())
        elif name == "recycling":
            sources.append(RecyclingDrafter(parts.model.get_output_embeddings().weight.shape[0]))
        else:
            nodes, depth = recipe.suffix_nodes, recipe.suffix_depth
            if compile and recipe.dynamic and sources:
                nodes = max(2, min(nodes, BLOCK_ROWS_MAX + 1 - sum(s.tree.num_nodes for s in sources)))
                depth = min(depth, nodes - 1)
            suffix = SuffixDrafter(parts.suffix_cache(), max_nodes=nodes, max_depth=depth)
            parts.suffix_drafters.append(suffix)
            sources.append(suffix)
    if recipe.lookup:
        sources.append(PromptLookup(recipe.lookup))
    if not sources:
        return None
    if len(sources) == 1 and not recipe.lookup and not recipe.dynamic:
        return sources[0]
    return TreePlanner(sources, parts.verify_seconds if recipe.dynamic else None)


def _heads_drafter(recipe: Recipe, parts: Parts) -> Drafter:
    """The heads drafting `parts.tree`, else a `recipe.nodes` default tree, else their tree.json, else the
    32-node default tree (under a pricer: the largest tree a step may use)."""
    heads = parts.heads
    heads.check_compatible(parts.model)
    if parts.tree is not None:
        tree = parts.tree
    elif recipe.nodes is not None:
        tree = default_tree(recipe.nodes, heads.num_heads)
    else:
        tree = heads.tree or default_tree(FALLBACK_TREE_NODES, heads.num_heads)
    return make_drafter(heads, tree, parts.model)


def drafter_factory(recipe: Recipe, parts: Parts, compile: bool = False) -> Callable[[], Drafter | None]:
    """() -> the drafter for one call: the same one every call for a `shared` recipe (what it learns
    carries over), else a new one each time."""
    if recipe.shared:
        drafter = build(recipe, parts, compile)
        return lambda: drafter
    return lambda: build(recipe, parts, compile)


def recipe_drafter(
    model: nn.Module, recipe: str | Recipe, compile: bool = False, numerics: str = "fast"
) -> Drafter | None:
    """The drafter `generate(model, prompts, drafter=recipe)` runs: built once per model, recipe and
    kernels from the shipped parts, kept on the model's runtime (`TargetRuntime.recipes`) so that later
    calls reuse it, and what a shared recipe learns carries over from call to call."""
    recipe = resolve(recipe, model)
    if not recipe.sources and not recipe.lookup:
        return None
    runtime = TargetRuntime.of(model)
    key = (recipe, compile, numerics)
    with runtime.lock:
        factory = runtime.recipes.get(key)
        if factory is None:
            parts = Parts.shipped(model, recipe, compile=compile, numerics=numerics)
            factory = runtime.recipes[key] = drafter_factory(recipe, parts, compile)
    return factory()
