"""The EAGLE-style drafter: decoding-time drafting against the training-time unrolled layer (the
reference), greedy exactness through the decoder, the features handed over, and checkpoints."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import ARCHS, hf_greedy, random_eagle, tiny_model

import treespec
from treespec.core.attention import AttentionPlan
from treespec.core.cache import TreeKVCache
from treespec.core.decoder import full_forward


def target_features(model, tokens: list[int], layers) -> torch.Tensor:
    """The target's hidden states at every position of `tokens`, as the decoder hands them over."""
    cache = TreeKVCache.for_model(model, len(tokens) + 1)
    ids = torch.tensor([tokens])
    with torch.no_grad(), treespec.core.attention.tree_attention_enabled(model):
        _, features = full_forward(
            model, ids, torch.arange(len(tokens))[None], cache, AttentionPlan("sdpa"), tuple(layers)
        )
    return features  # [1, T, F]


def test_features_are_the_hidden_states_transformers_reports():
    model = tiny_model("llama")
    tokens = torch.randint(96, (9,), generator=torch.Generator().manual_seed(1)).tolist()
    features = target_features(model, tokens, (0, 1, 2))
    with torch.no_grad():
        out = model(torch.tensor([tokens]), output_hidden_states=True)
    expected = torch.cat([out.hidden_states[i] for i in (0, 1, 2)], dim=-1)
    torch.testing.assert_close(features, expected)


@pytest.mark.parametrize("draft_size", [0, 40])
def test_drafted_chain_matches_the_unrolled_training_layer(draft_size):
    """Decoding runs the layer level by level over its own cache; training unrolls it over whole
    sequences with shifted attention. On the same tokens both give the same distributions."""
    model = tiny_model("llama")
    for seed in range(3):
        draft = random_eagle(model, seed, draft_size)
        gen = torch.Generator().manual_seed(10 + seed)
        prompt = torch.randint(96, (7 + seed,), generator=gen).tolist()  # x_0 .. x_P-1
        root = int(torch.randint(96, (1,), generator=gen))
        depth = 4
        chain = treespec.Tree.from_choices([[0] * d for d in range(1, depth + 1)])
        drafter = treespec.EagleDrafter(draft, chain, model)
        features = target_features(model, prompt, draft.feature_layers)  # [1, P, F]
        drafter.start(treespec.SequenceStart(prompt + [root], 64, None, "sdpa", features))
        proposal = drafter.propose(torch.zeros(1, 48), torch.tensor([root]))
        drafted = proposal.tokens[0].tolist()  # root, y_1 .. y_depth
        assert drafted[0] == root

        # the reference: the unrolled layer over x_0 .. x_P-1, root, y_1 .. (features past P-1 unused)
        sequence = prompt + drafted
        p = len(prompt)
        padded = torch.cat([features, features[:, -1:].expand(-1, depth, -1)], dim=1)  # [1, T-1, F]
        emb = model.get_input_embeddings().weight[torch.tensor([sequence[1:]])]  # [1, T-1, H]
        with torch.no_grad():
            outputs = draft.unrolled(padded, emb, steps=depth)
        for j in range(depth):  # step j at position P-1+j guesses y_j+1
            probs = draft.logits(outputs[j][0, p - 1 + j]).softmax(-1)  # [V']
            assert int(draft.token_ids(probs.argmax())) == drafted[j + 1]
            torch.testing.assert_close(probs.max(), proposal.probs[0, j + 1].to(probs.dtype))


def test_tree_drafting_matches_chains_drafted_one_by_one():
    """In a wide tree each node is drafted as if its path were a chain (attention sees only ancestors)."""
    model = tiny_model("llama")
    draft = random_eagle(model, 3)
    prompt = torch.randint(96, (6,), generator=torch.Generator().manual_seed(4)).tolist()
    features = target_features(model, prompt, draft.feature_layers)
    tree = treespec.Tree.from_choices(
        [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [1, 0, 0], [1, 0, 1]]
    )
    drafter = treespec.EagleDrafter(draft, tree, model)
    drafter.start(treespec.SequenceStart(prompt + [5], 64, None, "sdpa", features))
    tokens = drafter.propose(torch.zeros(1, 48), torch.tensor([5])).tokens[0].tolist()
    for node in range(1, tree.num_nodes):
        path = tree.path_to(node)  # root .. node
        # a chain tree whose ranks follow this path: its last node must get the same token
        choices = [list(tree.choices[n - 1]) for n in path[1:]]
        chain = treespec.Tree.from_choices(choices)
        single = treespec.EagleDrafter(draft, chain, model)
        single.start(treespec.SequenceStart(prompt + [5], 64, None, "sdpa", features))
        chain_tokens = single.propose(torch.zeros(1, 48), torch.tensor([5])).tokens[0].tolist()
        assert chain_tokens[-1] == tokens[node], f"node {node} (path {tree.choices[node - 1]})"


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_greedy_output_equals_the_base_models(arch):
    model = tiny_model(arch)
    for seed, choices in enumerate(([[0], [0, 0], [0, 0, 0]], [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]])):
        draft = random_eagle(model, seed, draft_size=50 if seed else 0)
        drafter = treespec.EagleDrafter(draft, treespec.Tree.from_choices(choices), model)
        prompt = torch.randint(96, (5 + 3 * seed,), generator=torch.Generator().manual_seed(seed)).tolist()
        result = treespec.generate(
            model,
            prompt,
            drafter,
            max_new_tokens=40,
            sampling=treespec.SamplingConfig(acceptance="greedy"),
            eos_token_id=[],
        )
        assert result.token_ids == hf_greedy(model, prompt, 40)
        assert result.stats.drafter["steps"] == result.stats.steps


def test_greedy_with_a_lookup_branch():
    """With a prompt-lookup branch beside it the drafter still gets the features of the accepted nodes
    (the tree planner passes them through), whichever branch was accepted."""
    model = tiny_model("llama")
    draft = random_eagle(model, 1)
    prompt = [3, 4, 5, 6, 7] * 4
    result = treespec.generate(
        model,
        prompt,
        treespec.TreePlanner(
            [
                treespec.EagleDrafter(draft, treespec.Tree.from_choices([[0], [0, 0]]), model),
                treespec.PromptLookup(4),
            ]
        ),
        max_new_tokens=30,
        sampling=treespec.SamplingConfig(acceptance="greedy"),
        eos_token_id=[],
    )
    assert result.token_ids == hf_greedy(model, prompt, 30)


def test_checkpoint_round_trip_and_refusals(tmp_path):
    model = tiny_model("llama", dtype=torch.float32)
    draft = random_eagle(model, 0, draft_size=30)
    draft.tree = treespec.Tree.from_choices([[0], [1], [0, 0]])
    draft.save_pretrained(tmp_path / "d")
    loaded = treespec.EagleDraftModel.from_pretrained(tmp_path / "d", model=model)
    assert loaded.tree == draft.tree and torch.equal(loaded.draft_vocab, draft.draft_vocab)
    for (name, a), (_, b) in zip(draft.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert torch.equal(a, b), name

    other = tiny_model("llama", dtype=torch.float32, seed=5)
    with pytest.raises(treespec.EagleLoadError, match="made for"):
        treespec.EagleDraftModel.from_pretrained(tmp_path / "d", model=other)

    config = json.loads((tmp_path / "d" / "config.json").read_text())
    config["draft_vocab_size"] = 31
    (tmp_path / "d" / "config.json").write_text(json.dumps(config))
    with pytest.raises(treespec.EagleLoadError, match="does not match its config"):
        treespec.EagleDraftModel.from_pretrained(tmp_path / "d")

    (tmp_path / "d" / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(treespec.EagleLoadError, match="corrupt"):
        treespec.EagleDraftModel.from_pretrained(tmp_path / "d")


def test_observe_without_features_is_refused():
    model = tiny_model("llama")
    drafter = treespec.EagleDrafter(random_eagle(model), treespec.Tree.from_choices([[0]]), model)
    with pytest.raises(ValueError, match="features"):
        drafter.start(treespec.SequenceStart([1, 2, 3], 16, None, "sdpa"))


def test_rounded_drafter_reads_its_weights_as_blocks_and_stays_exact():
    from treespec.core.packed import linear_kinds

    model = tiny_model(
        "llama", dtype=torch.float32, hidden_size=64, intermediate_size=128, num_attention_heads=4
    )
    draft = random_eagle(model, 2, draft_size=64).round_to_blocks()
    drafter = treespec.EagleDrafter(draft, treespec.Tree.from_choices([[0], [1], [0, 0]]), model)
    prompt = [4, 5, 6, 7]
    result = treespec.generate(model, prompt, drafter, max_new_tokens=20, eos_token_id=[])
    assert result.token_ids == hf_greedy(model, prompt, 20)
    if treespec.ops.available("cpu"):  # the block kernel is there: every linear layer ran through it
        assert linear_kinds(draft) == {"blocks-q8_0": 9}


def test_a_bf16_target_gets_a_float32_block_drafter_that_keeps_the_plain_text(tmp_path):
    """On CPU `load_eagle_option` runs the drafter in float32 on Q8_0 blocks whatever the target's dtype
    (the bf16 GEMMs at a tree level's few rows cost ~2x). Its drafts are the rounded layer's own, computed
    in float32 (the reference: the same rounded weights through F.linear); with bitwise numerics a bf16
    target keeps its plain loop's text."""
    from treespec.tools.drafter_options import load_eagle_option

    model = tiny_model(
        "llama", dtype=torch.bfloat16, hidden_size=64, intermediate_size=128, num_attention_heads=4
    )
    random_eagle(model.float(), 3, draft_size=64).save_pretrained(tmp_path / "eagle")
    model.to(torch.bfloat16)
    source = load_eagle_option(str(tmp_path / "eagle"), model, "3")
    assert source.module.fc.weight.dtype == torch.float32
    again = source.module.fc.weight.clone()
    source.module.round_to_blocks()  # already on the Q8_0 grid: rounding again changes nothing
    assert torch.equal(source.module.fc.weight, again)
    prompt = [4, 5, 6, 7, 8, 9]
    options = treespec.DecodeOptions(numerics="bitwise")
    plain = treespec.generate(model, prompt, None, max_new_tokens=16, eos_token_id=[], options=options)
    fast = treespec.generate(
        model, prompt, source.drafter(model), max_new_tokens=16, eos_token_id=[], options=options
    )
    assert fast.token_ids == plain.token_ids
    features = target_features(model, prompt, source.module.feature_layers)  # [1, P, F] in bf16
    proposals = []
    for linears in ("auto", "torch"):  # the block kernel, and F.linear on the same rounded weights
        drafter = treespec.EagleDrafter(source.module, source.tree, model, linears=linears)
        drafter.start(treespec.SequenceStart([*prompt, 11], 64, None, "sdpa", features))
        proposals.append(drafter.propose(torch.zeros(1, 64), torch.tensor([11])))
    assert proposals[0].tokens.tolist() == proposals[1].tokens.tolist()
    torch.testing.assert_close(proposals[0].probs, proposals[1].probs, rtol=1e-4, atol=1e-5)


def test_a_new_drafter_starts_from_the_targets_last_layer_and_norms():
    """for_model copies the last layer's MLP, output projection and norms, the final norm and the output rows
    of the draft vocabulary, so the untrained layer sees inputs at the scale its weights were trained for."""
    model = tiny_model("llama")
    with torch.no_grad():
        for norm in (model.model.norm, model.model.layers[-1].input_layernorm):
            norm.weight.uniform_(0.2, 2.0)  # not the ones a fresh norm starts at
    vocab = torch.tensor([5, 3, 9, 1])
    draft = treespec.EagleDraftModel.for_model(model, vocab)
    last = model.model.layers[-1]
    assert torch.equal(draft.norm.weight, model.model.norm.weight)
    assert torch.equal(draft.hidden_norm.weight, last.input_layernorm.weight)
    assert torch.equal(draft.input_norm.weight, last.input_layernorm.weight)
    assert torch.equal(draft.post_norm.weight, last.post_attention_layernorm.weight)
    assert torch.equal(draft.down_proj.weight, last.mlp.down_proj.weight)
    assert torch.equal(draft.lm_head.weight, model.lm_head.weight[vocab])
