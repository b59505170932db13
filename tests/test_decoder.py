"""The decoder core: prefill/step, the declared drafter interface, per-call attention state, bad input."""

from __future__ import annotations

import inspect

import pytest
import torch
from conftest import hf_greedy, random_eagle, random_heads, tiny_model

import treespec
from treespec.core.drafting import Drafter
from treespec.drafters.draft_model import DraftModelDrafter
from treespec.drafters.lookup import PromptLookup
from treespec.drafters.self_spec import SelfSpeculativeDrafter


def _declared() -> tuple[list[str], list[str]]:
    """(methods, attributes) the `Drafter` protocol declares: read from it, so this test follows it."""
    methods = [n for n, v in vars(Drafter).items() if not n.startswith("_") and inspect.isfunction(v)]
    properties = [n for n, v in vars(Drafter).items() if isinstance(v, property)]
    return methods, [*Drafter.__annotations__, *properties]


PROTOCOL_METHODS, PROTOCOL_ATTRIBUTES = _declared()


def _shipped_drafter_classes():
    """Every drafter class the package exports (so a new one cannot skip this test)."""
    exported = [getattr(treespec, name) for name in treespec.__all__]
    return [c for c in exported if inspect.isclass(c) and issubclass(c, treespec.BaseDrafter)]


def interface_violations(cls) -> list[str]:
    """What `cls` lacks of the protocol: a declared method missing or with other parameters, a declared
    attribute missing on the class (`tree` is set per instance)."""
    found = []
    for name in PROTOCOL_METHODS:
        implemented = getattr(cls, name, None)
        if not callable(implemented):
            found.append(f"{name}: missing")
        elif list(inspect.signature(getattr(Drafter, name)).parameters) != list(
            inspect.signature(implemented).parameters
        ):
            found.append(f"{name}: parameters differ")
    found += [f"{name}: missing" for name in PROTOCOL_ATTRIBUTES if name != "tree" and not hasattr(cls, name)]
    return found


def value_violations(drafter) -> list[str]:
    """Declared attributes whose value on an instance is not of the declared kind."""
    found = []
    if not isinstance(drafter.tree, treespec.Tree):
        found.append("tree")
    layers = drafter.feature_layers
    if not isinstance(layers, tuple) or not all(
        isinstance(i, int) and not isinstance(i, bool) for i in layers
    ):
        found.append("feature_layers")
    flags = ("batched", "limits_depth", "prices_steps")
    found += [name for name in flags if not isinstance(getattr(drafter, name), bool)]
    topk = drafter.target_topk
    if isinstance(topk, bool) or not isinstance(topk, int) or topk < 0:
        found.append("target_topk")
    return found


def forwarding_violations(wrapper, inner: list) -> list[str]:
    """What a wrapper (a tree planner) fails to pass on from the drafters it wraps: the
    target's top-k one of them asks for, the feature layers they read, their limits (a batch only when
    every one drafts batches)."""
    found = []
    if wrapper.target_topk < max(d.target_topk for d in inner):
        found.append("target_topk")
    if not all(set(d.feature_layers) <= set(wrapper.feature_layers) for d in inner):
        found.append("feature_layers")
    if wrapper.batched and not all(d.batched for d in inner):
        found.append("batched")
    return found


def test_the_protocol_test_covers_every_shipped_drafter():
    names = {c.__name__ for c in _shipped_drafter_classes()}
    assert {
        "RootOnlyDrafter", "MedusaDrafter", "SequentialDrafter", "PromptLookup", "DraftModelDrafter",
        "SelfSpeculativeDrafter", "EagleDrafter", "TreePlanner", "SuffixDrafter", "RecyclingDrafter",
    } <= names  # fmt: skip
    assert {"propose", "observe", "keep_rows", "verified", "scorer"} <= set(PROTOCOL_METHODS)
    assert {"tree", "feature_layers", "batched", "target_topk", "prices_steps"} <= set(PROTOCOL_ATTRIBUTES)


@pytest.mark.parametrize("cls", _shipped_drafter_classes(), ids=lambda c: c.__name__)
def test_every_drafter_implements_the_declared_interface_with_its_signatures(cls):
    assert not interface_violations(cls)


def test_the_interface_checks_catch_a_drafter_that_breaks_the_protocol():
    class Wrong:  # not a BaseDrafter: nothing inherited
        tree = treespec.Tree.from_choices([[0]])
        feature_layers = [1]  # a list, not a tuple
        batched = 1  # an int, not a bool
        limits_depth = False
        target_topk = -1
        prices_steps = None  # not a bool

        def propose(self, hidden, roots):  # max_depth missing
            raise NotImplementedError

    found = interface_violations(Wrong)
    assert "propose: parameters differ" in found and "start: missing" in found and "scorer: missing" in found
    assert set(value_violations(Wrong())) == {"feature_layers", "batched", "target_topk", "prices_steps"}

    class Forgetful(treespec.BaseDrafter):  # wraps a drafter and passes nothing on
        batched = True

        def __init__(self, inner):
            self.inner, self.tree = inner, inner.tree

    class Needs(treespec.BaseDrafter):  # one row, the target's top-4 and its layer-2 features
        target_topk, feature_layers, batched = 4, (2,), False

        def __init__(self):
            self.tree = treespec.Tree.from_choices([[0]])

    inner = Needs()
    assert forwarding_violations(Forgetful(inner), [inner]) == ["target_topk", "feature_layers", "batched"]


def test_the_wrappers_pass_on_what_their_drafters_need():
    from conftest import random_eagle

    model = tiny_model("llama", dtype=torch.float32)
    tree = treespec.default_tree(8, 4)
    layer = random_eagle(model, seed=2, draft_size=40)
    heads = treespec.make_drafter(random_heads(model), tree, model)
    eagle, recycling = (
        treespec.EagleDrafter(layer, tree, model),
        treespec.RecyclingDrafter(model.config.vocab_size),
    )
    planner = treespec.TreePlanner
    cases = [
        (planner([heads, PromptLookup(2)]), [heads]),
        (planner([eagle, PromptLookup(3)]), [eagle]),
        (planner([recycling, PromptLookup(3)]), [recycling]),
        (planner([eagle, recycling]), [eagle, recycling]),
        (planner([heads, treespec.SuffixDrafter()]), [heads]),
        (planner([eagle, recycling], lambda nodes, prefix: 1e-3), [eagle, recycling]),
        (planner([eagle, recycling, PromptLookup(2)], lambda nodes, prefix: 1e-3), [eagle, recycling]),
    ]
    for wrapper, inner in cases:
        assert not forwarding_violations(wrapper, inner), (
            type(wrapper).__name__,
            forwarding_violations(wrapper, inner),
        )
    assert planner([heads, PromptLookup(2)]).batched  # heads + lookup decode batches


def _made_drafters(model):
    """One instance of every shipped drafter on a tiny model."""
    from conftest import random_eagle

    heads, tree = random_heads(model), treespec.default_tree(8, 4)
    exit_head = treespec.MedusaHeads.for_model(model, num_heads=1, exit_layer=1)
    made = {
        "RootOnlyDrafter": treespec.RootOnlyDrafter(),
        "MedusaDrafter": treespec.make_drafter(heads, tree, model),
        "SequentialDrafter": treespec.make_drafter(random_heads(model, sequential=True), tree, model),
        "PromptLookup": PromptLookup(3),
        "DraftModelDrafter": DraftModelDrafter(tiny_model("llama", dtype=torch.float32, seed=1), gamma=3),
        "EagleDrafter": treespec.EagleDrafter(random_eagle(model, seed=2, draft_size=40), tree, model),
        "TreePlanner": treespec.TreePlanner(
            [treespec.make_drafter(heads, tree, model), treespec.SuffixDrafter(), PromptLookup(3)]
        ),
        "TreePlanner (priced)": treespec.TreePlanner(
            [treespec.make_drafter(heads, tree, model), PromptLookup(3)],
            lambda nodes, prefix: 1e-3 * (1 + 0.05 * nodes),
        ),
        "SelfSpeculativeDrafter": SelfSpeculativeDrafter(model, exit_head, gamma=3),
        "SuffixDrafter": treespec.SuffixDrafter(),
        "RecyclingDrafter": treespec.RecyclingDrafter(model.config.vocab_size),
    }
    return made


def test_every_drafter_answers_the_protocol_and_decodes_exactly_through_the_one_decoder():
    """Each shipped drafter: its protocol attributes, keep_rows, and greedy steps equal to HF's."""
    model = tiny_model("llama", dtype=torch.float32)
    prompt = [5, 9, 14, 2, 33, 61]
    want = hf_greedy(model, prompt, 16)
    for name, drafter in _made_drafters(model).items():
        assert not value_violations(drafter), (name, value_violations(drafter))
        decoder = treespec.Decoder(model, drafter, acceptance="greedy")
        out = decoder.prefill(prompt, max_new_tokens=16)
        out += decoder.step().committed[0]
        drafter.keep_rows([0])  # every drafter takes it: a batch whose only row goes on
        while len(out) < 16:
            out += decoder.step().committed[0]
        assert out[:16] == want, name


def test_every_drafter_decodes_a_sequence_that_fills_the_model():
    """prompt + max_new_tokens = max_position_embeddings: the last steps verify the root alone (a node
    would take a position past the limit), so every drafter also meets a step it did not draft for."""
    model = tiny_model("llama", dtype=torch.float32)
    limit = model.config.max_position_embeddings
    prompt = [(11 * i) % 90 + 3 for i in range(limit - 12)]
    want = hf_greedy(model, prompt, 12)
    for name, drafter in _made_drafters(model).items():
        result = treespec.generate(model, prompt, drafter, max_new_tokens=12, eos_token_id=[])
        assert result.token_ids == want, name


def test_steps_reproduce_generate_and_hf_greedy():
    model = tiny_model("llama", dtype=torch.float32)
    heads = random_heads(model, seed=1)
    prompt = [3, 17, 5, 9, 22]
    drafter = treespec.make_drafter(heads, treespec.default_tree(16, 4), model)
    decoder = treespec.Decoder(model, drafter, acceptance="greedy", kernel="sdpa")
    out = decoder.prefill(prompt, max_new_tokens=40)
    while len(out) < 40:
        step = decoder.step()
        path, committed, bonus = step.paths[0], step.committed[0], step.bonuses[0]
        assert path[0] == 0 and committed[-1] == bonus
        assert committed == [step.tokens[0][i] for i in path[1:]] + [bonus]
        out += committed
    assert out[:40] == hf_greedy(model, prompt, 40)
    assert decoder.cache.committed == len(prompt) + len(out) - 1  # the last bonus is not in the cache yet


def test_the_loop_allocates_no_cache_and_a_second_sequence_reuses_it():
    model = tiny_model("llama", dtype=torch.float32)
    decoder = treespec.Decoder(
        model, treespec.make_drafter(random_heads(model), treespec.default_tree(8, 4), model)
    )
    decoder.prefill([1, 2, 3], max_new_tokens=30)
    cache, pointers = decoder.cache, [layer.keys.data_ptr() for layer in decoder.cache.layers]
    for _ in range(5):
        decoder.step()
    decoder.prefill([4, 5], max_new_tokens=20)  # fits: the same buffers
    assert decoder.cache is cache and [layer.keys.data_ptr() for layer in cache.layers] == pointers
    assert cache.committed == 2


def test_two_decoders_on_one_model_keep_their_own_attention_settings():
    """Interleaved steps of a tree decoder (sdpa) and a plain decoder (reference kernel) on one model:
    both stay exact, and the model's own attention implementation is back afterwards."""
    model = tiny_model("llama", dtype=torch.float32)
    before = model.config._attn_implementation
    heads = random_heads(model, seed=2)
    a = treespec.Decoder(
        model, treespec.make_drafter(heads, treespec.default_tree(16, 4), model), kernel="sdpa"
    )
    b = treespec.Decoder(model, None, kernel="reference")
    outs = [a.prefill([7, 8, 9], 30), b.prefill([4, 4, 2], 30)]
    while min(len(o) for o in outs) < 30:
        for decoder, out in zip((a, b), outs, strict=True):
            if len(out) < 30:
                out += decoder.step().committed[0]
            assert model.config._attn_implementation == before
    assert outs[0][:30] == hf_greedy(model, [7, 8, 9], 30)
    assert outs[1][:30] == hf_greedy(model, [4, 4, 2], 30)
    with treespec.tree_attention_enabled(model), treespec.tree_attention_enabled(model):
        pass  # nested users: the implementation comes back once the last one leaves
    assert model.config._attn_implementation == before


def test_score_leaves_the_cache_as_it_was():
    model = tiny_model("llama", dtype=torch.float32)
    decoder = treespec.Decoder(
        model, treespec.make_drafter(random_heads(model), treespec.default_tree(8, 4), model)
    )
    decoder.prefill([1, 2, 3, 4], max_new_tokens=10)
    with torch.inference_mode():
        proposal = decoder.drafter.propose(decoder.hidden, decoder.roots)
    logits = decoder.score(proposal.tokens)
    assert logits.shape == (1, 8, model.config.vocab_size)
    assert decoder.cache.committed == decoder.cache.length == 4
    torch.testing.assert_close(decoder.score(proposal.tokens), logits)


def test_step_before_prefill_says_what_to_do():
    with pytest.raises(RuntimeError, match="prefill"):
        treespec.Decoder(tiny_model("llama")).step()


@pytest.mark.parametrize(
    "prompt, message",
    [
        ([10**7], "outside the model's vocabulary"),
        ([-1, 2], "outside the model's vocabulary"),
        (["Why", "is"], "needs tokenizer="),  # a batch of two strings, without a tokenizer
        ([1.5, 2], "token ids must be integers"),
        (torch.tensor([[0.5, 1.0]]), "must be integers"),
        ([], "empty"),
        ([[1, 2], [3, "x"]], "token ids must be integers"),  # a batch with a bad row
    ],
)
def test_bad_prompts_get_a_clear_error(prompt, message):
    model = tiny_model("llama")
    with pytest.raises(ValueError, match=message):
        treespec.generate(model, prompt, max_new_tokens=4)


def test_the_old_call_form_is_refused_and_the_drafter_goes_third_or_by_keyword():
    model = tiny_model("llama", dtype=torch.float32)
    heads = random_heads(model)
    tree = treespec.default_tree(8, 4)
    with pytest.raises(TypeError, match="is gone"):
        treespec.generate(model, heads, [1, 2], max_new_tokens=9)
    with pytest.raises(TypeError):
        treespec.generate(model, [1, 2], heads, tree=tree, max_new_tokens=9)  # no old keywords either
    drafter = treespec.TreePlanner([treespec.make_drafter(heads, tree, model), PromptLookup(2)])
    third = treespec.generate(model, [1, 2], drafter, max_new_tokens=9)
    keyword = treespec.generate(model, [1, 2], drafter=drafter, max_new_tokens=9)
    assert third.token_ids == keyword.token_ids == hf_greedy(model, [1, 2], 9)[: len(third.token_ids)]
    with pytest.raises(ValueError, match="tree= needs heads"):
        treespec.as_drafter(model, treespec.RootOnlyDrafter(), tree)


def test_the_heads_own_tree_is_the_default_and_an_explicit_tree_wins():
    model = tiny_model("llama", dtype=torch.float32)
    heads = random_heads(model)
    heads.tree = treespec.Tree.from_choices([[0], [0, 0], [1]])
    assert treespec.generate(model, [1, 2], heads, max_new_tokens=6).tree == heads.tree
    explicit = treespec.default_tree(8, 4)
    drafter = treespec.as_drafter(model, heads, explicit)
    assert treespec.generate(model, [1, 2], drafter, max_new_tokens=6).tree == explicit


def test_exit_heads_are_their_own_class(tmp_path):
    model = tiny_model("llama", num_hidden_layers=4)
    head = treespec.ExitHead.for_model(model, exit_layer=2)
    assert isinstance(head, treespec.ExitHead) and head.exit_layer == 2 and head.num_heads == 1
    head.save_pretrained(tmp_path / "exit")
    loaded = treespec.MedusaHeads.from_pretrained(tmp_path / "exit", model=model)
    assert isinstance(loaded, treespec.ExitHead)
    with pytest.raises(ValueError, match="exit heads"):
        treespec.make_drafter(loaded, treespec.default_tree(4, 1), model)
    random_heads(model).save_pretrained(tmp_path / "medusa")
    with pytest.raises(treespec.HeadsLoadError, match="MedusaHeads"):
        treespec.ExitHead.from_pretrained(tmp_path / "medusa")
    with pytest.raises(ValueError, match="one independent head"):
        treespec.ExitHead(2, 48, 96, exit_layer=1)


def test_saved_heads_keep_their_tree(tmp_path):
    model = tiny_model("llama")
    heads = random_heads(model)
    heads.tree = treespec.Tree.from_choices([[0], [1], [0, 0]])
    heads.save_pretrained(tmp_path)
    assert treespec.MedusaHeads.from_pretrained(tmp_path, model=model).tree == heads.tree


class _Listener(treespec.BaseDrafter):
    """Heads that also record what `verified` hands them (the target's top-k after every node)."""

    batched, limits_depth, target_topk = True, True, 3

    def __init__(self, inner):
        self.inner, self.tree, self.seen = inner, inner.tree, []

    def propose(self, hidden, roots, max_depth=None):
        return self.inner.propose(hidden, roots, max_depth)

    def verified(self, tokens, top_tokens):
        self.seen.append((tokens.clone(), top_tokens.clone()))


def test_verified_hands_the_targets_top_k_after_every_node_through_wrappers():
    """target_topk > 0: each step the drafter (under a lookup wrapper) gets the tree's tokens [A, N] and the
    target's top-k there; greedy, the top-1 after the root is the row's first committed token."""
    model = tiny_model("llama", dtype=torch.float32)
    listener = _Listener(treespec.make_drafter(random_heads(model), treespec.default_tree(8, 4), model))
    decoder = treespec.Decoder(model, treespec.TreePlanner([listener, PromptLookup(3)]), acceptance="greedy")
    decoder.prefill([[5, 9, 4, 7, 1], [3, 3, 8, 2, 6, 6, 1, 9, 4], [2, 7, 1, 8]], max_new_tokens=12)
    for _ in range(3):
        step = decoder.step()
        tokens, top = listener.seen[-1]
        assert tokens.tolist() == step.tokens and top.shape == (3, step.nodes, 3)
        assert top[:, 0, 0].tolist() == [committed[0] for committed in step.committed]


# int8 numerics quantize blocks of 32: a model whose sizes are multiples of 32
INT8_SHAPE = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4)


@pytest.mark.parametrize(
    "numerics,step", [("fast", "hf"), ("fast", "native"), ("bitwise", "native"), ("int8", "native")]
)
def test_a_kept_prefix_prefills_only_the_tokens_after_it(numerics, step):
    model = tiny_model("llama", dtype=torch.float32, **(INT8_SHAPE if numerics == "int8" else {}))
    drafter = treespec.make_drafter(random_heads(model, seed=1), treespec.default_tree(8, 4), model)
    decoder = treespec.Decoder(model, drafter, numerics=numerics, step=step, reuse_prefix=True)
    fresh = treespec.Decoder(model, drafter, numerics=numerics, step=step)

    def decode(decoder, prompt, n):
        out = decoder.prefill(prompt, max_new_tokens=n)
        while len(out) < n:
            out += decoder.step().committed[0]
        return out

    first = [3, 17, 5, 9, 22]
    reply = decode(decoder, first, 12)
    assert decoder.stats[0].prompt_reused == 0
    assert decoder.held[0] == first + reply[:-1]  # the last token has no K/V yet
    second = first + reply + [7, 8, 9]  # the conversation goes on
    answer = decode(decoder, second, 20)
    assert decoder.stats[0].prompt_reused == len(first) + len(reply) - 1
    assert answer[:20] == decode(fresh, second, 20)
    if numerics != "int8":  # int8: another text than the float model's
        assert answer[:20] == hf_greedy(model, second, 20)
    # a prompt that leaves the history early keeps the common part; the whole history: all but its last
    # token (whose forward gives the first new token)
    third = first[:3] + [40, 41]
    assert decode(decoder, third, 6)[:6] == decode(fresh, third, 6)[:6]
    assert decoder.stats[0].prompt_reused == 3
    decode(decoder, third, 6)
    assert decoder.stats[0].prompt_reused == len(third) - 1
    with torch.no_grad():  # the weights changed: no K/V of theirs is kept
        model.model.norm.weight.mul_(1.0)
    assert decode(decoder, third, 6)[:6] == decode(fresh, third, 6)[:6]
    assert decoder.stats[0].prompt_reused == 0
    # a batch prefills every prompt whole
    decoder.prefill([third, first], max_new_tokens=4)
    assert [s.prompt_reused for s in decoder.stats] == [0, 0]


def test_a_drafter_that_reads_the_targets_features_keeps_no_prefix():
    model = tiny_model("llama", dtype=torch.float32)
    eagle = treespec.EagleDrafter(random_eagle(model), treespec.default_tree(8, 4), model)
    decoder = treespec.Decoder(model, eagle, reuse_prefix=True)
    assert decoder.reuse_prefix is False
