"""Recipes: one table of named drafter configurations, built the same way for generate, the CLI, the demo
and the benchmark; every recipe decodes exactly (greedy == HF) on tiny models."""

from __future__ import annotations

import pytest
import torch
from conftest import hf_greedy, random_eagle, random_heads, tiny_model

import treespec
from treespec import recipes
from treespec.recipes import RECIPES, Parts, Recipe


def _parts(model, recipe: Recipe) -> Parts:
    """Parts for a tiny model: random heads and EAGLE layer, a cold suffix cache, a linear cost model."""
    tree = treespec.default_tree(8, 4)
    eagle = random_eagle(model, seed=2, draft_size=40)
    return Parts(
        model,
        heads=random_heads(model),
        tree=None if recipe.dynamic else tree,
        eagle=lambda: treespec.EagleDrafter(eagle, tree, model),
        suffix_cache=treespec.SuffixCache,
        verify_seconds=lambda nodes, prefix: 1e-3 * (1 + 0.05 * nodes),
    )


def test_the_table_names_the_recipes_the_tools_use_each_with_one_line():
    assert {"plain", "heads", "heads+lookup", "dynamic", "dynamic+suffix", "eagle+suffix", "all"} <= set(
        RECIPES
    )
    for name, recipe in RECIPES.items():
        assert recipe.name == name and recipe.description and "\n" not in recipe.description
    assert recipes.DEFAULT_RECIPE in RECIPES
    assert recipes.names()[0] == "auto" and set(recipes.names()[1:]) == set(RECIPES)
    assert all(name in recipes.describe() for name in RECIPES)


def test_a_bad_recipe_is_refused_with_what_to_do():
    with pytest.raises(ValueError, match="unknown source"):
        Recipe("x", "a source that does not exist", ("medusa",))
    model = tiny_model("llama", dtype=torch.float32)
    with pytest.raises(ValueError, match="choose from auto, plain"):
        recipes.resolve("fastest", model)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("name", list(RECIPES))
def test_every_recipe_decodes_exactly(arch, name):
    model = tiny_model(arch, dtype=torch.float32)
    recipe = RECIPES[name]
    prompt = [5, 9, 14, 2, 5, 9, 14, 33]
    new_drafter = recipes.drafter_factory(recipe, _parts(model, recipe))
    for _ in range(2):  # a shared drafter serves the second call too
        out = treespec.generate(model, prompt, new_drafter(), max_new_tokens=14, eos_token_id=[])
        assert out.token_ids == hf_greedy(model, prompt, 14), name
    if name == "plain":
        assert new_drafter() is None
    else:
        assert (new_drafter() is new_drafter()) == recipe.shared


def test_the_source_order_and_the_lookup_chain_follow_the_recipe():
    model = tiny_model("llama", dtype=torch.float32)
    drafter = recipes.build(RECIPES["all"], _parts(model, RECIPES["all"]))
    assert isinstance(drafter, treespec.TreePlanner) and drafter.priced
    kinds = [treespec.EagleDrafter, treespec.MedusaDrafter, treespec.SuffixDrafter, treespec.RecyclingDrafter]
    assert [type(s) for s in drafter.sources] == kinds
    static = recipes.build(RECIPES["heads+lookup"], _parts(model, RECIPES["heads+lookup"]))
    assert isinstance(static, treespec.TreePlanner) and not static.priced
    assert (
        isinstance(static.sources[-1], treespec.PromptLookup) and static.sources[-1].length == recipes.LOOKUP
    )
    heads = recipes.build(RECIPES["heads"], _parts(model, RECIPES["heads"]))
    assert isinstance(heads, treespec.MedusaDrafter)  # one static source: its tree as it is


def test_auto_is_plain_for_a_model_with_no_shipped_drafter_and_the_default_for_the_default_model():
    model = tiny_model("llama", dtype=torch.float32)
    assert recipes.resolve("auto", model).name == "plain"
    prompt = [3, 17, 5, 9]
    assert treespec.generate(model, prompt, max_new_tokens=8, eos_token_id=[]).token_ids == hf_greedy(
        model, prompt, 8
    )
    from treespec.tools.models import DEFAULT_MODEL_NAME, default_heads_folder

    model.config.name_or_path = DEFAULT_MODEL_NAME  # as load_model() names the default model
    shipped = (default_heads_folder() / "config.json").is_file()
    assert recipes.auto_name(model) == (recipes.DEFAULT_RECIPE if shipped else "plain")


def test_generate_takes_a_name_or_a_recipe_and_keeps_a_shared_drafter_on_the_model():
    model = tiny_model("llama", dtype=torch.float32)
    prompt = [3, 17, 5, 9, 3, 17]
    want = hf_greedy(model, prompt, 10)
    for drafter in ("suffix", RECIPES["recycling"], "lookup", "plain"):
        assert (
            treespec.generate(model, prompt, drafter, max_new_tokens=10, eos_token_id=[]).token_ids == want
        ), drafter
    first = treespec.as_drafter(model, "suffix")
    assert isinstance(first, treespec.SuffixDrafter) and treespec.as_drafter(model, "suffix") is first
    assert treespec.as_drafter(model, "lookup") is not treespec.as_drafter(model, "lookup")  # built per call
    treespec.TargetRuntime.of(model).close()
    assert treespec.as_drafter(model, "suffix") is not first  # a closed runtime forgets it


def test_a_recipe_whose_parts_ship_for_the_default_model_only_says_what_to_pass():
    model = tiny_model("llama", dtype=torch.float32)
    with pytest.raises(ValueError, match="pass heads="):
        treespec.generate(model, [1, 2, 3], "heads", max_new_tokens=4)
    with pytest.raises(ValueError, match="pass eagle="):
        treespec.generate(model, [1, 2, 3], "eagle", max_new_tokens=4)


def test_the_readme_lists_every_recipe_with_its_description():
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    for name, recipe in RECIPES.items():
        assert f"| `{name}` | {recipe.description} |" in readme, name
