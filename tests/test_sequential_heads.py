"""Sequential (Hydra-style) heads and the draft vocabulary: drafting against a brute-force oracle,
teacher forcing, checkpoints, and greedy exactness through `generate`."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import ARCHS, hf_greedy, random_heads, tiny_model

import treespec
from treespec.drafters.heads import HeadsLoadError


def _draft_vocab(vocab_size: int, size: int, seed: int) -> torch.Tensor:
    return torch.randperm(vocab_size, generator=torch.Generator().manual_seed(seed))[:size]  # [size]


def _oracle_tokens(heads, tree, hidden, root, lm_weight, embed_weight) -> list[int]:
    """Each node's token computed alone: run the heads along the path to its parent, take rank r."""
    tokens = [root]
    for node in range(1, tree.num_nodes):
        path = tree.path_to(node)  # root .. node
        state = hidden
        for d, ancestor in enumerate(path[:-1]):
            if heads.sequential:
                emb = embed_weight[tokens[ancestor]]
                state = heads.advance(d, state, emb)
            else:
                state = heads.blocks[d](hidden)
        logits = state.to(lm_weight.dtype) @ lm_weight.T  # [V]
        if heads.draft_vocab is not None:
            outside = torch.ones_like(logits, dtype=torch.bool)
            outside[heads.draft_vocab] = False
            logits = logits.masked_fill(outside, float("-inf"))
        rank = int(tree.rank[node])
        tokens.append(int(logits.topk(rank + 1).indices[rank]))
    return tokens


@pytest.mark.parametrize("sequential", [True, False])
@pytest.mark.parametrize("draft_size", [0, 40])
def test_drafted_tree_matches_the_per_node_oracle(sequential, draft_size):
    model = tiny_model("llama")
    vocab = model.config.vocab_size
    lm_weight = model.get_output_embeddings().weight.detach()
    embed_weight = model.get_input_embeddings().weight.detach()
    for seed in range(3):
        draft = _draft_vocab(vocab, draft_size, seed) if draft_size else None
        heads = random_heads(model, seed=seed, sequential=sequential, draft_vocab=draft)
        gen = torch.Generator().manual_seed(100 + seed)
        wide = treespec.Tree.from_choices([[0], [1], [0, 0], [0, 1], [1, 2]])
        for tree in (treespec.default_tree(32, 4), wide):
            drafter = treespec.make_drafter(heads, tree, model)
            assert isinstance(drafter, treespec.SequentialDrafter if sequential else treespec.MedusaDrafter)
            hidden = torch.randn(model.config.hidden_size, generator=gen, dtype=torch.float64)
            root = int(torch.randint(vocab, (1,), generator=gen))
            proposal = drafter.propose(hidden[None], torch.tensor([root]))
            tokens = proposal.tokens[0].tolist()
            assert tokens == _oracle_tokens(heads, tree, hidden, root, lm_weight, embed_weight)
            if draft is not None:
                assert set(tokens[1:]) <= set(draft.tolist())
            probs = proposal.probs[0]
            assert probs.shape == (tree.num_nodes,) and torch.all((probs > 0) & (probs <= 1))


@pytest.mark.parametrize("sequential", [True, False])
def test_drafters_share_the_output_rows_until_the_output_layer_changes(sequential):
    model = tiny_model("llama", dtype=torch.float32)
    vocab = model.config.vocab_size
    heads = random_heads(model, seed=5, sequential=sequential, draft_vocab=_draft_vocab(vocab, 40, 5))
    tree = treespec.default_tree(16, 4)
    embed_weight = model.get_input_embeddings().weight.detach()
    gen = torch.Generator().manual_seed(7)
    hidden = torch.randn(model.config.hidden_size, generator=gen)
    root = int(torch.randint(vocab, (1,), generator=gen))

    def drafted(drafter):
        return drafter.propose(hidden[None], torch.tensor([root])).tokens[0].tolist()

    first, second = (treespec.make_drafter(heads, tree, model) for _ in range(2))
    assert second.output is first.output  # built once, not per drafter (per generate call)
    lm_weight = model.get_output_embeddings().weight
    assert drafted(second) == _oracle_tokens(heads, tree, hidden, root, lm_weight.detach(), embed_weight)
    with torch.no_grad():
        lm_weight.mul_(-1.0)  # in place: same storage, new version
    changed = treespec.make_drafter(heads, tree, model)
    assert changed.output is not first.output
    assert drafted(changed) == _oracle_tokens(heads, tree, hidden, root, lm_weight.detach(), embed_weight)


def test_teacher_forced_logits_equal_the_drafters_on_the_true_path():
    """predict() (training) and SequentialDrafter (decoding) compute the same thing on a chain."""
    model = tiny_model("llama")
    heads = random_heads(model, sequential=True, seed=3)
    lm, emb = model.get_output_embeddings().weight, model.get_input_embeddings().weight
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(5, model.config.hidden_size, generator=gen, dtype=torch.float64)  # [M, H]
    tokens = torch.randint(model.config.vocab_size, (5, 5), generator=gen)  # [M, K+1]
    logits = heads.predict(hidden, tokens, lm, emb)  # [K, M, V]
    for m in range(5):
        state = hidden[m]
        for k in range(heads.num_heads):
            state = heads.advance(k, state, emb[tokens[m, k]])
            torch.testing.assert_close(logits[k, m], state @ lm.T)


def test_untrained_sequential_heads_equal_untrained_independent_heads():
    model = tiny_model("llama")
    seq = treespec.MedusaHeads.for_model(model, num_heads=3, sequential=True)
    ind = treespec.MedusaHeads.for_model(model, num_heads=3)
    hidden = torch.randn(4, model.config.hidden_size, dtype=torch.float64)
    tokens = torch.randint(model.config.vocab_size, (4, 4))
    lm = model.get_output_embeddings()
    torch.testing.assert_close(
        seq.predict(hidden, tokens, lm, model.get_input_embeddings()), ind.predict(hidden, tokens, lm)
    )


def test_sequential_heads_need_the_token_embeddings():
    model = tiny_model("llama")
    heads = random_heads(model, sequential=True)
    with pytest.raises(ValueError, match="token_embeddings"):
        heads(torch.randn(1, 2, model.config.hidden_size, dtype=torch.float64), model.lm_head)
    with pytest.raises(ValueError, match="input embedding"):
        no_tokens = torch.zeros(2, 5, dtype=torch.long)
        heads.predict(torch.randn(2, 48, dtype=torch.float64), no_tokens, model.lm_head)
    with pytest.raises(ValueError, match="SequentialDrafter"):
        treespec.MedusaDrafter(heads, treespec.default_tree(8, 4), model.lm_head)


def test_draft_index_maps_ids_into_the_draft_vocabulary():
    model = tiny_model("llama")
    draft = torch.tensor([7, 3, 50])
    heads = treespec.MedusaHeads.for_model(model, num_heads=2, draft_vocab=draft)
    ids = torch.tensor([[3, 7, 8], [-100, 50, 0]])
    assert heads.draft_index(ids).tolist() == [[1, 0, -100], [-100, 2, -100]]
    assert heads.token_ids(torch.tensor([2, 0, 1])).tolist() == [50, 7, 3]
    with pytest.raises(ValueError, match="repeated"):
        treespec.MedusaHeads.for_model(model, draft_vocab=torch.tensor([1, 1]))
    with pytest.raises(ValueError, match="distinct token ids"):
        treespec.MedusaHeads.for_model(model, draft_vocab=torch.tensor([1, 96]))


def test_checkpoint_round_trip_and_corrupt_draft_vocabulary(tmp_path):
    model = tiny_model("llama", dtype=torch.float32)
    heads = random_heads(model, sequential=True, draft_vocab=_draft_vocab(96, 30, 0))
    heads.save_pretrained(tmp_path / "ok")
    loaded = treespec.MedusaHeads.from_pretrained(tmp_path / "ok", model=model)
    assert loaded.sequential and loaded.draft_vocab_size == 30
    assert torch.equal(loaded.draft_vocab, heads.draft_vocab)
    for (name, a), (_, b) in zip(heads.state_dict().items(), loaded.state_dict().items(), strict=True):
        torch.testing.assert_close(a, b, msg=name)

    from safetensors.torch import load_file, save_file

    for label, bad in (("repeated", lambda v: v.fill_(5)), ("in \\[0, 96\\)", lambda v: v.add_(96))):
        folder = tmp_path / label.split()[0]
        heads.save_pretrained(folder)
        tensors = load_file(folder / "model.safetensors")
        bad(tensors["draft_vocab"])
        save_file(tensors, folder / "model.safetensors")
        with pytest.raises(HeadsLoadError, match=label):
            treespec.MedusaHeads.from_pretrained(folder)

    folder = tmp_path / "badcfg"
    heads.save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    config["draft_vocab_size"] = 1000
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(HeadsLoadError, match="draft_vocab_size"):
        treespec.MedusaHeads.from_pretrained(folder)


def test_version_1_config_without_the_new_fields_still_loads(tmp_path):
    model = tiny_model("llama", dtype=torch.float32)
    random_heads(model).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["sequential"], config["draft_vocab_size"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    loaded = treespec.MedusaHeads.from_pretrained(tmp_path, model=model)
    assert not loaded.sequential and loaded.draft_vocab is None


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_greedy_with_sequential_heads_equals_hf_greedy(arch):
    model = tiny_model(arch, dtype=torch.float32)
    gen = torch.Generator().manual_seed(11)
    for trial, draft_size in enumerate((0, 48)):
        draft = _draft_vocab(model.config.vocab_size, draft_size, trial) if draft_size else None
        heads = random_heads(model, seed=trial, sequential=True, draft_vocab=draft)
        prompt = torch.randint(0, model.config.vocab_size, (6 + 3 * trial,), generator=gen).tolist()
        expected = hf_greedy(model, prompt, 40)
        for tree in (treespec.default_tree(16, 4), treespec.default_tree(64, 4)):
            got = treespec.generate(
                model, prompt, treespec.as_drafter(model, heads, tree), max_new_tokens=40, eos_token_id=[]
            )
            assert got.token_ids == expected, (arch, tree.num_nodes, draft_size)


def test_identity_sequential_heads_accept_deep_on_a_repeating_model():
    """Zero-initialised sequential heads repeat the next-token guess; a model that repeats accepts them."""
    model = tiny_model("llama")
    heads = treespec.MedusaHeads.for_model(model, num_heads=4, sequential=True)
    prompt = [3, 3, 3, 3, 3, 3]
    res = treespec.generate(model, prompt, heads, max_new_tokens=30, eos_token_id=[])
    assert res.token_ids == hf_greedy(model, prompt, 30)
    assert res.stats.steps < 30


@pytest.mark.parametrize("own_lm_head", [False, True])
def test_narrowed_heads_keep_the_first_draft_tokens_and_their_logits(tmp_path, own_lm_head):
    model = tiny_model("llama")
    draft = _draft_vocab(model.config.vocab_size, 40, 3)
    heads = treespec.MedusaHeads.for_model(
        model, num_heads=3, sequential=True, own_lm_head=own_lm_head, draft_vocab=draft
    )
    gen = torch.Generator().manual_seed(7)
    for p in heads.parameters():  # non-zero weights, so the comparison below can fail
        p.data.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    narrow = heads.narrowed(25)
    assert narrow.draft_vocab_size == 25 and torch.equal(narrow.draft_vocab, draft[:25])
    lm = model.get_output_embeddings()
    hidden = torch.randn(6, model.config.hidden_size, generator=gen)
    tokens = torch.randint(model.config.vocab_size, (6, 3), generator=gen)
    emb = model.get_input_embeddings()
    with torch.no_grad():
        wide_logits = heads.predict(hidden, tokens, lm, emb)  # [K, 6, 40]
        narrow_logits = narrow.predict(hidden, tokens, lm, emb)  # [K, 6, 25]
    torch.testing.assert_close(narrow_logits, wide_logits[..., :25])
    narrow.save_pretrained(tmp_path / "narrow")
    loaded = treespec.MedusaHeads.from_pretrained(tmp_path / "narrow", model=model)
    assert loaded.draft_vocab_size == 25 and torch.equal(loaded.draft_vocab, draft[:25])
    with pytest.raises(ValueError, match="draft_vocab_size must be in 1..40"):
        heads.narrowed(41)
    with pytest.raises(ValueError, match="no draft vocabulary"):
        treespec.MedusaHeads.for_model(model).narrowed(10)
