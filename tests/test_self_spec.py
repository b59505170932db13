"""Self-speculative drafting: lower-layer K/V written while drafting are reused by a verification that
runs only the upper layers; it equals a full verification and keeps greedy output exact."""

from __future__ import annotations

import functools

import pytest
import torch
from conftest import ARCHS, hf_greedy, tiny_model

import treespec
from treespec.core.decoder import full_forward
from treespec.drafters.self_spec import SelfSpeculativeDrafter, layer_hidden_states


def _exit_head(model, layer: int, seed: int = 0, std: float = 0.3) -> treespec.MedusaHeads:
    head = treespec.MedusaHeads.for_model(model, num_heads=1, exit_layer=layer)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p.dtype) * std)
    return head


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_upper_layer_verification_equals_a_full_verification(arch):
    model = tiny_model(arch, num_hidden_layers=4)
    drafter = SelfSpeculativeDrafter(model, _exit_head(model, 2), gamma=3)
    prompt = [5, 9, 14, 2, 33, 61, 7, 8]
    decoder = treespec.Decoder(model, drafter, kernel="sdpa", acceptance="greedy")
    decoder.prefill(prompt, max_new_tokens=8)
    cache = decoder.cache
    with torch.inference_mode():
        tokens = drafter.propose(decoder.hidden, decoder.roots).tokens  # [1, 4]
        ours = decoder.score(tokens, drafter.scorer())
        ours_kv = [[t[:, :, :12].clone() for t in (layer.keys, layer.values)] for layer in cache.layers]
        full = decoder.score(tokens, functools.partial(full_forward, model))
        full_kv = [[t[:, :, :12] for t in (layer.keys, layer.values)] for layer in cache.layers]
    torch.testing.assert_close(ours, full, atol=1e-10, rtol=1e-10)
    for a, b in zip(ours_kv, full_kv, strict=True):  # every layer's K/V of the chain, lower and upper
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("arch", sorted(ARCHS))
@pytest.mark.parametrize("gamma", [1, 3])
def test_greedy_output_equals_the_base_models(arch, gamma):
    model = tiny_model(arch, num_hidden_layers=4, dtype=torch.float32)
    prompt = [3, 17, 5, 9, 22, 41, 7]
    drafter = SelfSpeculativeDrafter(model, _exit_head(model, 1 + gamma % 2), gamma=gamma)
    result = treespec.generate(model, prompt, drafter, max_new_tokens=40, eos_token_id=[])
    assert result.token_ids == hf_greedy(model, prompt, 40)
    assert result.stats.drafter["drafted"] == gamma * result.stats.steps
    # no cache of its own: the speculation costs only the target's block of gamma + 1 slots
    assert result.stats.draft_cache_memory == {}
    assert result.stats.speculative_memory == result.stats.cache_memory["speculative"]


def test_layer_hidden_states_are_the_models_own():
    model = tiny_model("llama", num_hidden_layers=4)
    ids = torch.tensor([[4, 7, 1, 9, 30]])
    states = model(ids, output_hidden_states=True).hidden_states  # [embeddings, after layer 0, ...]
    ours = layer_hidden_states(model, ids, 2)  # [1, 5, H]
    torch.testing.assert_close(ours, model.model.norm(states[2]), atol=1e-10, rtol=1e-10)


def test_bad_exit_heads_are_refused():
    model = tiny_model("llama", num_hidden_layers=4)
    with pytest.raises(ValueError, match="exit_layer"):
        SelfSpeculativeDrafter(model, _exit_head(model, 0), gamma=2)
    with pytest.raises(ValueError, match="exit_layer"):
        SelfSpeculativeDrafter(model, _exit_head(model, 4), gamma=2)
    with pytest.raises(ValueError, match="exit heads"):
        treespec.make_drafter(_exit_head(model, 2), treespec.default_tree(4, 1), model)
    with pytest.raises(ValueError, match="self-speculative"):
        treespec.TreePlanner(
            [SelfSpeculativeDrafter(model, _exit_head(model, 2), gamma=2), treespec.PromptLookup(4)]
        )
