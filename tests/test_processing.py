"""Logits processing over a tree (HF's `repetition_penalty`, HF logits processors): every verified node's
logits equal the logits HF's processors give a one-token step at that node's own sequence, and decoding
with them gives HF's text."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch
from conftest import hf_greedy, random_heads, tiny_model, total_variation
from transformers import LogitsProcessorList
from transformers.generation.logits_process import (
    MinNewTokensLengthLogitsProcessor,
    NoRepeatNGramLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
)

import treespec
from treespec.core.processing import TreeLogitsProcessing
from treespec.drafters.lookup import PromptLookup


def hf_greedy_penalized(model, prompt: list[int], max_new_tokens: int, penalty: float) -> list[int]:
    return hf_greedy(model, prompt, max_new_tokens, repetition_penalty=penalty)


def random_tree(rng: random.Random, nodes: int) -> treespec.Tree:
    choices: list[tuple[int, ...]] = []
    while len(choices) < nodes - 1:
        parent = rng.choice([(), *choices])
        child = (*parent, sum(1 for c in choices if c[:-1] == parent))
        if len(child) <= 5:
            choices.append(child)
    return treespec.Tree.from_choices([list(c) for c in choices])


@pytest.mark.parametrize("seed", range(6))
def test_every_node_is_penalized_as_a_one_token_step_at_its_sequence(seed):
    rng = random.Random(seed)
    vocab, rows = 40, 3
    penalty = rng.choice([0.6, 1.2, 1.7])
    tree = random_tree(rng, rng.randrange(1, 24))
    parents = tree.parents.tolist()
    histories = [[rng.randrange(vocab) for _ in range(rng.randrange(1, 30))] for _ in range(rows)]
    # node 0 is each row's root (the last token of its history); the other nodes draw from a few tokens,
    # so that branches repeat tokens, seen and unseen
    tokens = [[h[-1]] + [rng.randrange(12) for _ in range(tree.num_nodes - 1)] for h in histories]
    logits = torch.randn(rows, tree.num_nodes, vocab, generator=torch.Generator().manual_seed(seed))
    state = TreeLogitsProcessing(penalty)
    cache_rows = [2, 0, 5]
    for row, history in zip(cache_rows, histories, strict=True):
        state.start(row, history[:-1])
        state.extend(row, history[-1:])
    got = state.apply(logits, cache_rows, tokens, parents)
    hf = RepetitionPenaltyLogitsProcessor(penalty)
    for a, history in enumerate(histories):
        for node in range(tree.num_nodes):
            branch = [tokens[a][i] for i in tree.path_to(node)[1:]]  # the root's child .. the node
            sequence = torch.tensor([history + branch])
            want = hf(sequence, logits[a, node][None].clone())[0]
            assert torch.equal(got[a, node], want), (a, node)
    again = torch.randn(rows, tree.num_nodes, vocab, generator=torch.Generator().manual_seed(seed))
    assert torch.equal(logits, again)  # the logits it was given are left as they were


def small_model(arch: str = "llama"):
    """head_dim 32: the int8 numerics' blocks fit it."""
    return tiny_model(arch, dtype=torch.float32, hidden_size=64, num_attention_heads=2, num_key_value_heads=1)


def drafters(model):
    tree = treespec.default_tree(16, 4)
    return {
        "plain": None,
        "heads": treespec.make_drafter(random_heads(model), tree, model),
        "lookup": PromptLookup(2),
        "heads+suffix+lookup": treespec.TreePlanner(
            [
                treespec.make_drafter(random_heads(model, seed=1), tree, model),
                treespec.SuffixDrafter(),
                PromptLookup(2),
            ]
        ),
    }


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("penalty", [1.3, 0.7])
def test_greedy_with_a_penalty_equals_hf_greedy_with_it(arch, penalty):
    model = small_model(arch)
    prompts = [[5, 9, 14, 2, 33, 61, 5, 9, 14], [7, 7, 3, 7, 7, 3, 1]]
    wants = [hf_greedy_penalized(model, p, 40, penalty) for p in prompts]
    assert wants[0] != hf_greedy_penalized(model, prompts[0], 40, 1.0)  # the penalty changes the text
    sampling = treespec.SamplingConfig(repetition_penalty=penalty)
    settings = dict(max_new_tokens=40, eos_token_id=[], sampling=sampling)
    for name, drafter in drafters(model).items():
        for numerics in ("fast", "bitwise"):
            options = treespec.DecodeOptions(numerics=numerics)
            for prompt, want in zip(prompts, wants, strict=True):
                got = treespec.generate(model, prompt, drafter, options=options, **settings)
                assert got.token_ids == want, (name, numerics)
            batch = treespec.generate(model, prompts, drafter, options=options, **settings)
            assert [r.token_ids for r in batch] == wants, (name, numerics, "batch")


def test_int8_speculation_with_a_penalty_equals_the_int8_plain_loop():
    model = small_model()
    prompt = [5, 9, 14, 2, 33, 61, 5, 9, 14]
    settings = dict(max_new_tokens=40, eos_token_id=[], options=treespec.DecodeOptions(numerics="int8"))
    sampling = treespec.SamplingConfig(repetition_penalty=1.4)
    plain = treespec.generate(model, prompt, None, sampling=sampling, **settings)
    unpenalized = treespec.generate(model, prompt, None, **settings)
    assert plain.token_ids != unpenalized.token_ids
    for name, drafter in drafters(model).items():
        got = treespec.generate(model, prompt, drafter, sampling=sampling, **settings)
        assert got.token_ids == plain.token_ids, name


def penalized_second_token(model, prompt: list[int], penalty: float) -> torch.Tensor:
    """The exact distribution of the 2nd sampled token (temperature 1) under the penalty: [V]."""
    hf = RepetitionPenaltyLogitsProcessor(penalty)
    vocab = model.config.vocab_size
    with torch.inference_mode():
        first = hf(torch.tensor([prompt]), model(torch.tensor([prompt])).logits[:, -1].float()).softmax(-1)[0]
        sequences = torch.tensor([prompt + [x] for x in range(vocab)])  # [V, T + 1]
        second = hf(sequences, model(sequences).logits[:, -1].float()).softmax(-1)  # [V, V]
    return first @ second


def test_sampling_with_a_penalty_keeps_the_penalized_distribution():
    """temperature 1, penalty 2: the 2nd token (verified at a depth-1 node, whose branch holds the 1st
    token) follows the exact penalized marginal, and not the one that ignores the branch's token."""
    model = tiny_model("llama", dtype=torch.float32, vocab_size=10, initializer_range=0.5)
    heads = random_heads(model, std=0.5)
    tree = treespec.default_tree(16, 4)
    prompt, penalty = [1, 4, 2], 2.0
    exact = penalized_second_token(model, prompt, penalty)
    count: Counter = Counter()
    for seed in range(200):
        results = treespec.generate(
            model,
            [prompt] * 8,
            treespec.as_drafter(model, heads, tree),
            max_new_tokens=2,
            sampling=treespec.SamplingConfig(temperature=1.0, seed=seed, repetition_penalty=penalty),
            eos_token_id=[],
        )
        count.update(r.token_ids[1] for r in results)
    assert sum(count.values()) == 1600
    assert total_variation(count, exact) < 0.06  # noise at n=1600 over 10 tokens is ~0.025
    # the power: the marginal that penalizes the prompt's tokens only is far from it
    hf = RepetitionPenaltyLogitsProcessor(penalty)
    with torch.inference_mode():
        first = hf(torch.tensor([prompt]), model(torch.tensor([prompt])).logits[:, -1]).softmax(-1)[0]
        sequences = torch.tensor([prompt + [x] for x in range(10)])
        prompt_only = hf(torch.tensor([prompt] * 10), model(sequences).logits[:, -1]).softmax(-1)
    assert 0.5 * (first @ prompt_only - exact).abs().sum() > 0.1


def test_a_penalty_must_be_positive():
    with pytest.raises(ValueError, match="repetition_penalty must be > 0"):
        treespec.SamplingConfig(repetition_penalty=0.0)


class PositionBias:
    """A processor that reads the sequence's length and last token: + length / 10 at token (last + 1)."""

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        scores = scores.clone()
        rows = torch.arange(scores.shape[0])
        scores[rows, (input_ids[:, -1] + 1) % scores.shape[1]] += input_ids.shape[1] / 10
        return scores


@pytest.mark.parametrize("seed", range(4))
def test_processors_see_every_node_at_its_own_sequence(seed):
    rng = random.Random(seed)
    vocab = 30
    tree = random_tree(rng, rng.randrange(1, 24))
    history = [rng.randrange(vocab) for _ in range(rng.randrange(2, 20))]
    tokens = [[history[-1]] + [rng.randrange(8) for _ in range(tree.num_nodes - 1)]]
    logits = torch.randn(1, tree.num_nodes, vocab, generator=torch.Generator().manual_seed(seed))
    processors = [NoRepeatNGramLogitsProcessor(2), PositionBias()]
    state = TreeLogitsProcessing(1.2, processors)
    state.start(7, history[:-1])
    state.extend(7, history[-1:])
    got = state.apply(logits, [7], tokens, tree.parents.tolist())
    for node in range(tree.num_nodes):
        sequence = torch.tensor([history + [tokens[0][i] for i in tree.path_to(node)[1:]]])
        want = RepetitionPenaltyLogitsProcessor(1.2)(sequence, logits[0, node][None].clone())
        for processor in processors:
            want = processor(sequence, want)
        assert torch.equal(got[0, node], want[0]), node


def test_greedy_with_logits_processors_equals_hf_greedy_with_them():
    """No repeated 3-grams, no end token before 12 new tokens, a position-dependent bias: every drafter's
    text equals HF generate's with the same processors."""
    model = small_model()
    prompt = [5, 9, 14, 2, 33, 61, 5, 9, 14]
    eos = hf_greedy_penalized(model, prompt, 6, 1.0)[2]  # HF's 3rd token: an end token that stops early
    processors = [
        NoRepeatNGramLogitsProcessor(3),
        MinNewTokensLengthLogitsProcessor(len(prompt), 12, eos),
        PositionBias(),
    ]
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=40,
        do_sample=False,
        logits_processor=LogitsProcessorList(processors),
        eos_token_id=eos,
        pad_token_id=0,
    )
    want = out[0, len(prompt) :].tolist()
    assert len(want) >= 12 and want != hf_greedy_penalized(model, prompt, len(want), 1.0)
    sampling = treespec.SamplingConfig(logits_processor=LogitsProcessorList(processors))
    for name, drafter in drafters(model).items():
        for numerics in ("fast", "bitwise"):
            options = treespec.DecodeOptions(numerics=numerics)
            settings = dict(max_new_tokens=40, eos_token_id=eos, sampling=sampling, options=options)
            got = treespec.generate(model, prompt, drafter, **settings)
            assert got.token_ids == want, (name, numerics)


def test_a_logits_processor_must_be_callable_and_return_the_scores():
    with pytest.raises(TypeError, match="logits_processor takes callables"):
        treespec.SamplingConfig(logits_processor=[3])

    def forgetful(input_ids, scores):
        scores[:, 0] = 0.0  # changes them in place, returns nothing

    model = small_model()
    sampling = treespec.SamplingConfig(logits_processor=[forgetful])
    with pytest.raises(TypeError, match="logits processor function returned NoneType"):
        treespec.generate(model, [1, 2, 3], None, max_new_tokens=4, sampling=sampling)


def test_sampling_from_a_generation_config_follows_hf():
    from transformers import GenerationConfig

    shipped = GenerationConfig(do_sample=True, temperature=0.7, top_p=0.8, repetition_penalty=1.05)
    config = treespec.SamplingConfig.from_generation_config(shipped, seed=3)
    assert (config.temperature, config.top_k, config.top_p) == (0.7, 50, 0.8)  # HF's top-k default: 50
    assert config.repetition_penalty == 1.05 and config.seed == 3 and config.logits_processor is None
    greedy = treespec.SamplingConfig.from_generation_config(GenerationConfig(temperature=0.7))
    assert greedy.greedy and greedy.top_k == 0 and greedy.top_p == 1.0
    with pytest.raises(ValueError, match="typical_p, bad_words_ids"):
        treespec.SamplingConfig.from_generation_config(GenerationConfig(typical_p=0.5, bad_words_ids=[[3]]))
    min_p = treespec.SamplingConfig.from_generation_config(GenerationConfig(do_sample=True, min_p=0.05))
    assert min_p.min_p == 0.05 and min_p.temperature == 1.0
    # greedy with a penalty and no repeated 2-grams (each changes the text): HF generate's text with them
    model = small_model()
    prompt = [5, 9, 14, 2, 33, 61, 5, 9, 14]
    fixed = dict(max_new_tokens=30, eos_token_id=None, pad_token_id=0)
    settings = GenerationConfig(repetition_penalty=1.05, no_repeat_ngram_size=2, **fixed)
    ids, mask = torch.tensor([prompt]), torch.ones(1, len(prompt), dtype=torch.long)
    want = model.generate(ids, attention_mask=mask, generation_config=settings)
    for alone in (dict(repetition_penalty=1.05), dict(no_repeat_ngram_size=2)):
        alone = GenerationConfig(**alone, **fixed)
        assert not torch.equal(model.generate(ids, attention_mask=mask, generation_config=alone), want)
    sampling = treespec.SamplingConfig.from_generation_config(settings)
    for name, drafter in drafters(model).items():
        got = treespec.generate(model, prompt, drafter, max_new_tokens=30, eos_token_id=[], sampling=sampling)
        assert got.token_ids == want[0, len(prompt) :].tolist(), name
