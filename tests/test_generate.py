"""Greedy treespec output == transformers' greedy output, token for token; the API's edges and errors."""

from __future__ import annotations

import pytest
import torch
from conftest import ARCHS, hf_greedy, random_heads, tiny_model

import treespec
from treespec.core.decoder import Decoder
from treespec.core.generate import decode
from treespec.core.stopping import StopCondition


def _trees():
    return [
        treespec.default_tree(8, 4),
        treespec.default_tree(32, 4),
        treespec.default_tree(64, 4),
        treespec.Tree.from_choices([[0], [0, 0], [0, 0, 0], [0, 0, 0, 0]]),  # a chain
        treespec.Tree.from_choices([[0], [1], [2], [3], [4], [5], [0, 0], [1, 0], [0, 1]]),  # wide and flat
    ]


@pytest.mark.parametrize("arch", sorted(ARCHS))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_greedy_equals_hf_greedy(arch, dtype):
    model = tiny_model(arch, dtype=dtype)
    heads = random_heads(model)
    gen = torch.Generator().manual_seed(7)
    for trial in range(3):
        prompt = torch.randint(0, model.config.vocab_size, (5 + 4 * trial,), generator=gen).tolist()
        expected = hf_greedy(model, prompt, 40)
        for tree in _trees():
            got = treespec.generate(
                model, prompt, treespec.as_drafter(model, heads, tree), max_new_tokens=40, eos_token_id=[]
            )
            assert got.token_ids == expected, (arch, tree)
            assert sum(got.stats.accept_lengths) + 1 >= len(expected)  # every committed token was emitted
        base = treespec.generate_baseline(model, prompt, max_new_tokens=40, eos_token_id=[])
        assert base.token_ids == expected
        assert base.stats.mean_accept_length == 1.0


def test_heads_that_match_the_model_are_accepted():
    """Heads that copy the base model's next-token guess on a model that repeats itself accept deep."""
    model = tiny_model("llama")
    heads = random_heads(model, std=0.0)  # zero blocks: identity -> every head repeats the next-token guess
    prompt = [3, 3, 3, 3, 3, 3]
    res = treespec.generate(model, prompt, heads, max_new_tokens=30, eos_token_id=[])
    assert res.token_ids == hf_greedy(model, prompt, 30)
    assert res.stats.steps < 30


def test_eos_stops_and_is_kept():
    model = tiny_model("llama")
    heads = random_heads(model)
    prompt = [1, 2, 3, 4]
    free = hf_greedy(model, prompt, 30)
    eos = free[10]
    res = treespec.generate(model, prompt, heads, max_new_tokens=30, eos_token_id=eos)
    assert res.token_ids == free[: free.index(eos) + 1]
    assert res.token_ids == hf_greedy(model, prompt, 30, eos_token_id=eos)


def test_max_new_tokens_is_exact():
    model = tiny_model("mistral")
    heads = random_heads(model)
    for n in (1, 2, 7):
        res = treespec.generate(model, [4, 5, 6], heads, max_new_tokens=n, eos_token_id=[])
        assert len(res.token_ids) == n


def test_stats_and_memory():
    model = tiny_model("llama", dtype=torch.float32)
    heads = random_heads(model)
    tree = treespec.default_tree(16, 4)
    res = treespec.generate(
        model, [1, 2, 3], treespec.as_drafter(model, heads, tree), max_new_tokens=20, eos_token_id=[]
    )
    s = res.stats
    assert s.steps == len(s.accept_lengths) and s.new_tokens == 20
    assert 1.0 <= s.mean_accept_length <= tree.max_depth + 1
    assert len(s.per_depth_acceptance) == tree.max_depth
    assert all(0 <= a <= 1 for a in s.per_depth_acceptance)
    assert s.time_total > 0 and s.time_verify > 0
    assert s.cache_memory["speculative"] > 0 and s.cache_memory["allocated"] >= s.cache_memory["committed"]


def test_the_first_call_reports_its_one_time_setup_apart():
    """The model's first call packs its linears (and builds the native step where it runs): that time is
    `time_setup`, part of `time_total` but not of `tokens_per_second`; the next call has none."""
    model = tiny_model("llama", dtype=torch.float32)
    first, second = (
        treespec.generate(model, [1, 2, 3], None, max_new_tokens=8, eos_token_id=[]) for _ in "ab"
    )
    assert 0 < first.stats.time_setup < first.stats.time_total and second.stats.time_setup == 0
    for s in (first.stats, second.stats):
        assert s.tokens_per_second == pytest.approx(s.new_tokens / (s.time_total - s.time_setup))
    slow = treespec.GenerationStats(new_tokens=10, time_total=2.0, time_setup=1.5)
    assert slow.tokens_per_second == 20.0 and "after 1.50 s of one-time setup" in slow.summary()
    assert "setup" not in treespec.GenerationStats(new_tokens=10, time_total=2.0).summary()


class _Recorder:
    """A minimal HF-style streamer (put/end)."""

    def __init__(self):
        self.chunks: list[list[int]] = []
        self.ended = False

    def put(self, value):
        self.chunks.append(value.flatten().tolist())

    def end(self):
        self.ended = True


def test_streamer_receives_prompt_then_every_token():
    model = tiny_model("qwen2")
    heads = random_heads(model)
    rec = _Recorder()
    res = treespec.generate(model, [7, 8, 9], heads, max_new_tokens=25, eos_token_id=[], streamer=rec)
    assert rec.chunks[0] == [7, 8, 9]
    assert [t for chunk in rec.chunks[1:] for t in chunk] == res.token_ids
    assert rec.ended


def test_sampling_is_reproducible_with_a_seed():
    model = tiny_model("llama", dtype=torch.float32)
    heads = random_heads(model)
    a = treespec.generate(
        model,
        [1, 2],
        heads,
        max_new_tokens=20,
        sampling=treespec.SamplingConfig(temperature=1.0, seed=3),
        eos_token_id=[],
    )
    b = treespec.generate(
        model,
        [1, 2],
        heads,
        max_new_tokens=20,
        sampling=treespec.SamplingConfig(temperature=1.0, seed=3),
        eos_token_id=[],
    )
    assert a.token_ids == b.token_ids
    t = treespec.generate(
        model,
        [1, 2],
        heads,
        max_new_tokens=20,
        sampling=treespec.SamplingConfig(temperature=0.7, top_p=0.9, acceptance="typical", seed=3),
        eos_token_id=[],
    )
    assert len(t.token_ids) == 20


# -- bad input -------------------------------------------------------------------------------------


def test_empty_prompt_is_refused():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="prompt is empty"):
        treespec.generate(model, [])
    with pytest.raises(ValueError, match="prompt is empty"):
        treespec.generate(model, "   ", tokenizer=object())


def test_prompt_too_long_is_refused():
    model = tiny_model("llama", max_position_embeddings=64)
    heads = random_heads(model)
    with pytest.raises(treespec.CacheCapacityError, match="shorten the prompt or lower max_new_tokens"):
        treespec.generate(model, list(range(50)), heads, max_new_tokens=20)


@pytest.mark.parametrize("numerics", ["fast", "int8"])
def test_a_sequence_that_fills_the_model_gets_its_last_position(numerics):
    """prompt + max_new_tokens = max_position_embeddings: a tree block's room past the limit is the cache's
    storage, not positions (near the limit the decoder verifies the root alone), so speculation decodes
    what plain decoding does, and no node gets a position the model does not have."""
    model = tiny_model(
        "llama",
        dtype=torch.float32,
        max_position_embeddings=64,
        hidden_size=64,
        intermediate_size=64,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    heads = random_heads(model)
    prompt = [(7 * i) % 90 + 3 for i in range(44)]  # 44 + 20 = 64 positions
    options = treespec.DecodeOptions(numerics=numerics)
    plain = treespec.generate(model, prompt, None, max_new_tokens=20, eos_token_id=[], options=options)
    if numerics == "fast":
        assert plain.token_ids == hf_greedy(model, prompt, 20)
    decoder = Decoder(model, treespec.as_drafter(model, heads), numerics=numerics)
    deepest = []

    def recording(scorer):
        def call(tokens, positions, *args, **kwargs):
            deepest.append(int(positions.max()))
            return scorer(tokens, positions, *args, **kwargs)

        return call

    decoder.scorer, decoder.plain_scorer = recording(decoder.scorer), recording(decoder.plain_scorer)
    stop = StopCondition([], None, None, 20)
    assert decode(decoder, [prompt], [stop], [None])[0].token_ids == plain.token_ids
    assert decoder.tree.max_depth > 1 and max(deepest) == 62, deepest  # (trees to the end would reach 66)
    with pytest.raises(treespec.CacheCapacityError, match="needs 65 positions but the limit is 64"):
        treespec.generate(model, prompt + [5], heads, max_new_tokens=20)


def test_a_sliding_window_model_decodes_past_its_window():
    """Up to its window a sliding-window model's attention is the whole prefix (the native step runs); past
    it each node sees its own position's window (transformers' forward with treespec's attention terms):
    HF's greedy tokens either way."""
    model = tiny_model("mistral", dtype=torch.float32, max_position_embeddings=256, sliding_window=32)
    heads = random_heads(model)
    prompt = list(range(3, 23))
    for new in (12, 40):  # 32 positions: within the window; 60: past it
        result = treespec.generate(model, prompt, heads, max_new_tokens=new, eos_token_id=[])
        assert result.token_ids == hf_greedy(model, prompt, new)


def test_heads_for_another_model_are_refused():
    model_a = tiny_model("llama", seed=0)
    model_b = tiny_model("llama", seed=1)
    heads = random_heads(model_a)
    with pytest.raises(ValueError, match="trained for"):
        treespec.generate(model_b, [1, 2, 3], heads, max_new_tokens=4)


def test_tree_deeper_than_the_heads_is_refused():
    model = tiny_model("llama")
    heads = random_heads(model, num_heads=2)
    with pytest.raises(ValueError, match="levels deep"):
        treespec.generate(
            model, [1, 2], treespec.as_drafter(model, heads, treespec.default_tree(32, 4)), max_new_tokens=4
        )


def test_bad_arguments_are_refused():
    model = tiny_model("llama")
    batch = treespec.generate(model, torch.zeros(2, 3, dtype=torch.long), max_new_tokens=2)
    assert len(batch) == 2  # a [2, T] tensor is a batch of two prompts (test_batch.py)
    with pytest.raises(ValueError, match=r"one prompt is a \[T\] or \[1, T\] tensor"):
        treespec.encode_prompt(torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="temperature"):
        treespec.generate(model, [1], sampling=treespec.SamplingConfig(temperature=-1))
    with pytest.raises(ValueError, match="acceptance rule"):
        treespec.generate(model, [1], sampling=treespec.SamplingConfig(acceptance="yes"))
    with pytest.raises(ValueError, match="needs tokenizer"):
        treespec.generate(model, "hello")


def test_trace_records_each_step():
    model = tiny_model("llama")
    heads = random_heads(model)
    tree = treespec.default_tree(16, 4)
    res = treespec.generate(
        model,
        [1, 2, 3],
        treespec.as_drafter(model, heads, tree),
        max_new_tokens=30,
        eos_token_id=[],
        trace=True,
    )
    assert len(res.trace) == res.stats.steps
    emitted = [res.token_ids[0]]
    for step in res.trace:
        assert len(step["tokens"]) == len(step["draft_probs"]) == tree.num_nodes
        assert step["tokens"][0] == emitted[-1]  # the root is the previous step's bonus token
        assert step["path"] == tree.path_to(step["path"][-1])
        emitted += [step["tokens"][i] for i in step["path"][1:]] + [step["bonus"]]
    assert emitted[: len(res.token_ids)] == res.token_ids


@pytest.mark.parametrize("batch", [False, True])
def test_the_model_stays_in_treespec_mode_for_a_call_and_is_stock_after_it(batch):
    model = tiny_model("llama", dtype=torch.float32)
    before = model.config._attn_implementation
    seen = []

    class Watch:  # an HF-style streamer that records the model's mode at every put
        def put(self, ids):
            linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
            seen.append((model.config._attn_implementation, all("forward" in m.__dict__ for m in linears)))

        def end(self):
            pass

    prompts = [[3, 17, 5, 9], [4, 8, 15, 16, 23, 42]] if batch else [3, 17, 5, 9]
    streamer = [Watch(), None] if batch else Watch()
    treespec.generate(model, prompts, random_heads(model), max_new_tokens=6, streamer=streamer)
    assert seen[0][0] == before  # the prompt goes out before the call switches the model
    assert len(seen) > 2 and all(mode == ("treespec", True) for mode in seen[1:])
    assert model.config._attn_implementation == before
    assert not any("forward" in m.__dict__ for m in model.modules())
