"""Trees that change from step to step: the decoder verifies whatever tree a proposal carries (any node
count up to the drafter's declared tree), greedy output stays the base model's."""

from __future__ import annotations

import pytest
import torch
from conftest import ARCHS, hf_greedy, random_heads, tiny_model

import treespec
from treespec.drafters.base import BaseDrafter, Proposal


class RandomSubtrees(BaseDrafter):
    """Drafts the inner drafter's tree, then keeps a random prefix of its nodes (canonical order keeps
    parents first, so a prefix is a tree): 1 node up to all of them, changing every step."""

    def __init__(self, inner, seed: int):
        self.inner, self.tree = inner, inner.tree
        self.gen = torch.Generator().manual_seed(seed)
        self.sizes = []

    def propose(self, hidden, roots):
        full = self.inner.propose(hidden, roots)
        k = int(torch.randint(1, self.tree.num_nodes + 1, (1,), generator=self.gen))
        self.sizes.append(k)
        tree = treespec.Tree.from_choices(self.tree.choices[: k - 1])
        return Proposal(full.tokens[:, :k], full.probs[:, :k], tree=tree, expected_accept=1.0 + 0.1 * k)


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_greedy_output_equals_the_base_models_with_a_new_tree_every_step(arch):
    model = tiny_model(arch)
    for seed in range(2):
        heads = random_heads(model, seed=seed, sequential=bool(seed))
        inner = treespec.make_drafter(heads, treespec.default_tree(16, heads.num_heads), model)
        drafter = RandomSubtrees(inner, seed)
        prompt = torch.randint(96, (6 + seed,), generator=torch.Generator().manual_seed(seed)).tolist()
        result = treespec.generate(model, None, prompt, drafter=drafter, max_new_tokens=40, eos_token_id=[])
        assert result.token_ids == hf_greedy(model, prompt, 40)
        assert len(set(drafter.sizes)) > 3  # the node count really changed
        assert result.stats.nodes_verified == drafter.sizes[: result.stats.steps]
        predicted = [1.0 + 0.1 * k for k in drafter.sizes[: result.stats.steps]]
        assert result.stats.mean_predicted_accept_length == pytest.approx(sum(predicted) / len(predicted))


def test_a_tree_larger_than_declared_is_refused():
    model = tiny_model("llama")
    heads = random_heads(model)
    inner = treespec.make_drafter(heads, treespec.default_tree(8, heads.num_heads), model)

    class TooBig(BaseDrafter):
        tree = treespec.Tree.from_choices([[0]])

        def propose(self, hidden, roots):
            full = inner.propose(hidden, roots)
            return Proposal(full.tokens, full.probs, tree=inner.tree)

    with pytest.raises(ValueError, match="declared at most 2 nodes"):
        treespec.generate(model, None, [1, 2, 3], drafter=TooBig(), max_new_tokens=4, eos_token_id=[])
