"""Acceptance rules. Sampling must be lossless: treespec's tokens follow the base model's distribution."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from conftest import random_heads, tiny_model

import treespec
from treespec.core.acceptance import SamplingConfig, accept_greedy, accept_sampling, accept_typical

# root with 3 children (tokens 2, 0, 5); child 1 has 2 children, child 2 has 1
TREE = treespec.Tree.from_choices([[0], [1], [2], [0, 0], [0, 1], [1, 0]])
V = 8


def _tv(counts: Counter, probs: torch.Tensor) -> float:
    n = sum(counts.values())
    return 0.5 * sum(abs(counts.get(x, 0) / n - float(probs[x])) for x in range(len(probs)))


def _setup(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(TREE.num_nodes, V, generator=gen) * 1.5  # [N, V] target logits at each node
    tokens = [6, 2, 0, 5, 1, 3, 2]  # node tokens: root, depth-1 x3, depth-2 x3
    children = [TREE.children(i) for i in range(TREE.num_nodes)]
    return logits, tokens, children


def _emitted(tokens, path, bonus):
    return [tokens[i] for i in path[1:]] + [bonus]


def _wrong_rule_no_renormalise(tokens, children, logits, config, generator):
    """A plausible bug: reject a draft but keep its mass in the residual."""
    node, path = 0, [0]
    while True:
        p = config.probs(logits[node])
        nxt = None
        for c in children[node]:
            if float(torch.rand((), generator=generator)) < float(p[tokens[c]]):
                nxt = c
                break
        if nxt is None:
            return path, int(torch.multinomial(p, 1, generator=generator))
        node = nxt
        path.append(node)


@pytest.mark.parametrize(
    "config", [SamplingConfig(1.0), SamplingConfig(0.7, top_k=5), SamplingConfig(1.3, top_p=0.8)]
)
def test_sampling_rule_is_lossless(config):
    logits, tokens, children = _setup()
    gen = torch.Generator().manual_seed(1)
    n = 12000
    first, second_after = Counter(), {c: Counter() for c in children[0]}
    wrong_first = Counter()
    for _ in range(n):
        path, bonus = accept_sampling(tokens, children, logits, config, gen)
        out = _emitted(tokens, path, bonus)
        first[out[0]] += 1
        if len(path) > 1:
            second_after[path[1]][out[1]] += 1
        wpath, wbonus = _wrong_rule_no_renormalise(tokens, children, logits, config, gen)
        wrong_first[_emitted(tokens, wpath, wbonus)[0]] += 1
    p_root = config.probs(logits[0])
    bound = 0.03  # sampling noise at n=12000 over 8 tokens is ~0.01
    assert _tv(first, p_root) < bound
    for child, counts in second_after.items():
        if sum(counts.values()) > 2000:  # enough samples to test the conditional
            assert _tv(counts, config.probs(logits[child])) < 2.5 * bound
    # the test has power: the un-renormalised rule is caught
    assert _tv(wrong_first, p_root) > 2 * bound


def test_greedy_rule_walks_the_argmax_branch():
    logits, tokens, children = _setup()
    logits = torch.full((TREE.num_nodes, V), -5.0)
    logits[0, 0] = 5  # root -> token 0 (node 2)
    logits[2, 2] = 5  # node 2 -> token 2 (node 6)
    logits[6, 7] = 5  # node 6 -> bonus 7
    path, bonus = accept_greedy(tokens, children, logits)
    assert path == [0, 2, 6] and bonus == 7
    logits[0] = -5
    logits[0, 4] = 5  # no child has token 4
    assert accept_greedy(tokens, children, logits) == ([0], 4)


def test_typical_rule_takes_the_deepest_plausible_branch():
    logits, tokens, children = _setup()
    logits = torch.full((TREE.num_nodes, V), -10.0)
    logits[0, [2, 0]] = 3.0  # root: tokens 2 and 0 both plausible
    logits[1, 1] = 3.0  # node 1 (token 2) -> token 1 (node 4) plausible
    path, _ = accept_typical(
        tokens, children, logits, SamplingConfig(1.0), generator=torch.Generator().manual_seed(0)
    )
    assert path == [0, 1, 4]
    # at temperature 0 the typical rule is the greedy rule
    assert (
        accept_typical(tokens, children, logits, SamplingConfig(0.0))[0]
        == accept_greedy(tokens, children, logits)[0]
    )


def test_top_k_and_top_p_warp_like_hf():
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(2))
    for k, p in [(5, 1.0), (0, 0.7), (10, 0.5)]:
        ours = SamplingConfig(0.8, top_k=k, top_p=p).probs(logits)
        scores = logits / 0.8
        if k:
            scores = TopKLogitsWarper(k)(None, scores)
        if p < 1:
            scores = TopPLogitsWarper(p)(None, scores)
        torch.testing.assert_close(ours, scores.softmax(-1))


def test_end_to_end_sampling_matches_the_base_model():
    """The 1st and 2nd generated tokens' distributions equal the base model's exact ones."""
    model = tiny_model("llama", dtype=torch.float32, vocab_size=10, initializer_range=0.5)
    heads = random_heads(model, std=0.5)
    tree = treespec.default_tree(16, 4)
    prompt = [1, 4, 2]
    with torch.inference_mode():
        p1 = model(torch.tensor([prompt])).logits[0, -1].softmax(-1)  # [V]
        nxt = torch.tensor([prompt + [x] for x in range(10)])
        p2_given = model(nxt).logits[:, -1].softmax(-1)  # [V, V]
    p2 = p1 @ p2_given  # exact marginal of the 2nd token
    n = 1500
    first, second = Counter(), Counter()
    for seed in range(n):
        res = treespec.generate(
            model, heads, prompt, tree=tree, max_new_tokens=2, temperature=1.0, seed=seed, eos_token_id=[]
        )
        first[res.token_ids[0]] += 1
        second[res.token_ids[1]] += 1
    bound = 0.06  # noise at n=1500 over 10 tokens is ~0.025
    assert _tv(first, p1) < bound
    assert _tv(second, p2) < bound
