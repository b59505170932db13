"""Draft-model speculation: the drafter's own cache under append-on-accept and pointer rollback,
low-precision storage, and greedy exactness whatever the draft model says."""

from __future__ import annotations

import pytest
import torch
from conftest import hf_greedy, tiny_model

import treespec
from treespec.core.spec_cache import STORAGES, SpeculativeKVCache, dequantize_int8, quantize_int8
from treespec.drafters.draft_model import DraftModelDrafter, chain_tree, check_vocabularies, parse_branching


def _fresh_kv(model, tokens: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """K/V of every layer after encoding `tokens` in one forward from an empty cache: [1, Hkv, T, D]."""
    cache = SpeculativeKVCache.for_model(model, len(tokens) + 1)
    with treespec.tree_attention_enabled(model):
        model.base_model(
            input_ids=torch.tensor([tokens]),
            cache=cache,
            use_cache=True,
            tree_attention=treespec.AttentionPlan("reference"),
        )
    cache.advance(len(tokens))
    return [cache.kv(i) for i in range(len(cache.layers))]


def test_int8_round_trip_error_is_within_half_a_step():
    gen = torch.Generator().manual_seed(0)
    for scale in (1e-3, 1.0, 50.0):
        x = (
            torch.randn(2, 3, 17, 64, generator=gen) * scale * torch.rand(2, 3, 17, 1, generator=gen)
        )  # [B, H, T, D]
        x[0, 0, 0] = 0  # an all-zero row
        q, s = quantize_int8(x)
        assert q.dtype == torch.int8 and s.shape == (2, 3, 17, 1)
        err = (dequantize_int8(q, s, torch.float32) - x).abs()  # [B, H, T, D]
        bound = x.abs().amax(-1, keepdim=True) / 127 / 2  # half a quantization step per row
        assert (err <= bound * (1 + 1e-5) + 1e-12).all()
        assert torch.equal(dequantize_int8(q, s, torch.float32)[0, 0, 0], torch.zeros(64))


@pytest.mark.parametrize("storage", ["model", "int8"])
def test_drafter_cache_equals_a_freshly_encoded_one_after_every_step(storage):
    """Append-on-accept and pointer rollback leave exactly the committed tokens' K/V in the cache."""
    target = tiny_model("llama", seed=0)
    draft = tiny_model("llama", seed=1, num_hidden_layers=1)
    drafter = DraftModelDrafter(draft, gamma=3, storage=storage, kernel="reference")
    gen = torch.Generator().manual_seed(5)
    committed = torch.randint(0, 96, (7,), generator=gen).tolist()  # prompt + root
    drafter.start(treespec.SequenceStart(committed, 64, None, "reference"))
    hidden = torch.zeros(target.config.hidden_size, dtype=torch.float64)
    for step in range(12):
        tokens = drafter.propose(hidden[None], torch.tensor([committed[-1]])).tokens[0].tolist()
        accepted = [0, 3, 1, 2][step % 4]  # all, none, some
        if step % 5 == 4:  # a committed token the drafter did not propose (e.g. a lookup branch won)
            new = [(tokens[1] + 1) % 96, int(torch.randint(0, 96, (1,), generator=gen))]
        else:
            new = tokens[1 : 1 + accepted] + [int(torch.randint(0, 96, (1,), generator=gen))]
        drafter.observe([new])
        committed += new
        cache = drafter.cache
        held = len(committed) - len(drafter.todo)  # the tokens the drafter has encoded
        assert cache.length == cache.committed == held
        assert drafter.todo[-1] == committed[-1]
        fresh = _fresh_kv(draft, committed[:held])
        for layer, (k, v) in enumerate(fresh):
            k_held, v_held = cache.kv(layer)
            tol = 1e-9 if storage == "model" else 0.02 * k.abs().max().item()
            torch.testing.assert_close(k_held, k, atol=tol, rtol=0)
            torch.testing.assert_close(
                v_held, v, atol=tol if storage == "model" else 0.02 * v.abs().max().item(), rtol=0
            )


@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("gamma", [1, 4])
def test_greedy_output_equals_the_base_models_with_every_storage(storage, gamma):
    target = tiny_model("llama", seed=0, dtype=torch.float32)
    draft = tiny_model("llama", seed=0, dtype=torch.float32, num_hidden_layers=1)  # shares layer 0
    prompt = [3, 17, 5, 9, 22, 41, 7]
    want = hf_greedy(target, prompt, 40)
    drafter = DraftModelDrafter(draft, gamma=gamma, storage=storage, kernel="sdpa")
    result = treespec.generate(
        target, prompt, drafter, max_new_tokens=40, options=treespec.DecodeOptions(kernel="sdpa")
    )
    assert result.token_ids == want
    assert result.stats.drafter["drafted"] == gamma * result.stats.steps
    assert 0 <= result.stats.acceptance_rate <= 1
    assert result.stats.draft_cache_memory["allocated"] > 0


def test_a_draft_model_that_agrees_with_the_target_is_always_accepted():
    target = tiny_model("qwen2", seed=3)
    prompt = [1, 2, 3, 4, 5]
    drafter = DraftModelDrafter(tiny_model("qwen2", seed=3), gamma=4, kernel="reference")
    result = treespec.generate(
        target, prompt, drafter, max_new_tokens=31, options=treespec.DecodeOptions(kernel="reference")
    )
    assert result.token_ids == hf_greedy(target, prompt, 31)
    assert result.stats.accept_lengths[:-1] == [5] * (len(result.stats.accept_lengths) - 1)
    assert result.stats.drafter["acceptance_rate"] > 0.9


def test_with_a_lookup_branch_the_output_is_still_the_base_models():
    target = tiny_model("mistral", seed=2)
    prompt = [4, 8, 15, 16, 23, 42, 4, 8, 15]
    drafter = DraftModelDrafter(
        tiny_model("mistral", seed=5, num_hidden_layers=1), gamma=3, kernel="reference"
    )
    result = treespec.generate(
        target,
        prompt,
        treespec.TreePlanner([drafter, treespec.PromptLookup(4)]),
        max_new_tokens=30,
        options=treespec.DecodeOptions(kernel="reference"),
        eos_token_id=[],
    )
    assert result.token_ids == hf_greedy(target, prompt, 30)


def test_bad_inputs_are_refused_clearly():
    with pytest.raises(ValueError, match="gamma"):
        DraftModelDrafter(tiny_model("llama"), gamma=0)
    with pytest.raises(ValueError, match="storage"):
        SpeculativeKVCache.for_model(tiny_model("llama"), 8, storage="int4")
    with pytest.raises(ValueError, match="storage"):
        DraftModelDrafter(tiny_model("llama"), storage="fp8")
    with pytest.raises(ValueError, match="tokenizer"):
        check_vocabularies(tiny_model("llama", vocab_size=64), tiny_model("llama"))


def test_branching_adds_the_draft_models_runners_up_as_leaves():
    tree = chain_tree(3, {1: 3, 3: 2})
    assert tree.num_nodes == 1 + 3 + 1 + 2 and tree.max_depth == 3
    draft = tiny_model("llama", seed=1, num_hidden_layers=1)
    drafter = DraftModelDrafter(draft, gamma=3, kernel="reference", branching={1: 3, 3: 2})
    committed = [5, 9, 14, 2, 33, 61]
    drafter.start(treespec.SequenceStart(committed, 32, None, "reference"))
    tokens = drafter.propose(
        torch.zeros(48, dtype=torch.float64)[None], torch.tensor([committed[-1]])
    ).tokens[0]
    chain = drafter.drafts
    for depth in (1, 2, 3):  # oracle: a fresh forward over committed + the chain so far
        logits = draft(torch.tensor([committed + chain[: depth - 1]])).logits[0, -1]  # [V]
        k = {1: 3, 2: 1, 3: 2}[depth]
        nodes = [i for i in range(tree.num_nodes) if int(drafter.tree.depth[i]) == depth]
        assert sorted(tokens[nodes].tolist()) == sorted(logits.topk(k).indices.tolist()), depth
        assert chain[depth - 1] == int(logits.argmax())
    with pytest.raises(ValueError, match="branching"):
        chain_tree(2, {3: 2})
    assert parse_branching("1:4, 3:2") == {1: 4, 3: 2} and parse_branching(None) == {}
    with pytest.raises(ValueError, match="depth:k"):
        parse_branching("1-4")


def test_runner_up_leaves_get_accepted_and_greedy_stays_exact():
    target = tiny_model("llama", seed=0, dtype=torch.float32)
    draft = tiny_model("llama", seed=7, dtype=torch.float32, num_hidden_layers=1)
    prompt = [3, 17, 5, 9, 22, 41, 7]
    want = hf_greedy(target, prompt, 40)
    accepted = {}
    for name, branching in (("chain", None), ("tree", {1: 20})):
        drafter = DraftModelDrafter(draft, gamma=2, kernel="sdpa", branching=branching)
        result = treespec.generate(target, prompt, drafter, max_new_tokens=40, eos_token_id=[])
        assert result.token_ids == want, name
        accepted[name] = result.stats.mean_accept_length
    assert accepted["tree"] > accepted["chain"]
