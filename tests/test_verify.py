"""Acceptance rules. Sampling must be lossless: treespec's tokens follow the base model's distribution."""

from __future__ import annotations

import functools
from collections import Counter

import pytest
import torch
from conftest import random_heads, tiny_model

import treespec
from treespec.core.acceptance import (
    RULES,
    SamplingConfig,
    accept_greedy,
    accept_sampling,
    accept_typical,
    verify,
)

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
    "config",
    [
        SamplingConfig(1.0),
        SamplingConfig(0.7, top_k=5),
        SamplingConfig(1.3, top_p=0.8),
        SamplingConfig(1.0, min_p=0.2),
    ],
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


def test_top_k_top_p_and_min_p_warp_like_hf():
    from transformers.generation.logits_process import MinPLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(2))
    for k, p, min_p in [(5, 1.0, 0.0), (0, 0.7, 0.0), (10, 0.5, 0.0), (0, 1.0, 0.2), (20, 0.9, 0.1)]:
        ours = SamplingConfig(0.8, top_k=k, top_p=p, min_p=min_p).probs(logits)
        scores = logits / 0.8
        if k:
            scores = TopKLogitsWarper(k)(None, scores)
        if p < 1:
            scores = TopPLogitsWarper(p)(None, scores)
        if min_p:
            kept = (scores > float("-inf")).sum()
            scores = MinPLogitsWarper(min_p)(None, scores)
            assert (scores > float("-inf")).sum() < kept  # min-p removed tokens here
        torch.testing.assert_close(ours, scores.softmax(-1))
    with pytest.raises(ValueError, match="min_p must be in"):
        SamplingConfig(1.0, min_p=1.5)


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
            model,
            prompt,
            treespec.as_drafter(model, heads, tree),
            max_new_tokens=2,
            sampling=treespec.SamplingConfig(temperature=1.0, seed=seed),
            eos_token_id=[],
        )
        first[res.token_ids[0]] += 1
        second[res.token_ids[1]] += 1
    bound = 0.06  # noise at n=1500 over 10 tokens is ~0.025
    assert _tv(first, p1) < bound
    assert _tv(second, p2) < bound


# ---- devices ---------------------------------------------------------------------------------------
# CUDA is not available to the unit tests, so a second device is simulated: `FakeCudaMode` (a
# TorchFunctionMode) lets tensors marked as "on cuda" report device cuda:0 while they compute on the CPU,
# and raises what real CUDA raises when an op mixes them with CPU tensors (other than 0-dim ones, which
# CUDA ops accept) or draws from a generator of the other device. `.to("cuda")` / creation with
# device="cuda" marks, `.to("cpu")` / `.cpu()` unmarks, results of ops on marked tensors are marked.

_FAKE = "_treespec_fake_cuda"


def _is_cuda_device(d) -> bool:
    return d is not None and not isinstance(d, torch.dtype) and torch.device(d).type == "cuda"


def _tensors(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from _tensors(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from _tensors(y)


class FakeCudaGenerator(torch.Generator):
    """A CPU generator that says it is a CUDA one (what `torch.Generator(device="cuda")` would be)."""

    @property
    def device(self):
        return torch.device("cuda", 0)


class FakeCudaMode(torch.overrides.TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.calls = 0

    @staticmethod
    def mark(t: torch.Tensor) -> torch.Tensor:
        setattr(t, _FAKE, True)
        return t

    @staticmethod
    def marked(t: torch.Tensor) -> bool:
        return getattr(t, _FAKE, False)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        self.calls += 1
        getter = getattr(func, "__self__", None)  # property getters arrive as descriptor.__get__
        if getter is torch.Tensor.device:
            return torch.device("cuda", 0) if self.marked(args[0]) else func(*args)
        if getter is torch.Tensor.is_cuda:
            return self.marked(args[0])
        # where does this op run? an explicit device (creation ops, .to, .cuda, .cpu), else its inputs'
        target = None
        if "device" in kwargs:
            target = _is_cuda_device(kwargs["device"])
            kwargs["device"] = "cpu" if kwargs["device"] is not None else None
        if func in (torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.cpu):
            if func is torch.Tensor.cuda:
                target = True
            elif func is torch.Tensor.cpu:
                target = False
            rest = []
            for a in args[1:]:
                if isinstance(a, (str, torch.device)):
                    target, a = _is_cuda_device(a), "cpu"
                elif isinstance(a, torch.Tensor):
                    target = self.marked(a)
                rest.append(a)
            args = (args[0], *rest)
            if func is torch.Tensor.cuda:
                func, args, target = torch.Tensor.clone, args[:1], True
        inputs = list(_tensors(args)) + list(_tensors(kwargs))
        on_cuda = any(self.marked(t) for t in inputs) if target is None else target
        if target is None and on_cuda:
            for t in inputs:
                if not self.marked(t) and t.dim() > 0:
                    raise RuntimeError(
                        f"{getattr(func, '__name__', func)}: expected all tensors to be on the same device, "
                        "but found at least two devices, cuda:0 and cpu!"
                    )
        generator = kwargs.get("generator")
        if generator is not None and (generator.device.type == "cuda") != on_cuda:
            raise RuntimeError(
                f"{getattr(func, '__name__', func)}: expected a '{'cuda' if on_cuda else 'cpu'}' device "
                f"type for generator but found '{generator.device.type}'"
            )
        out = func(*args, **kwargs)
        if func in (torch.Tensor.to, torch.Tensor.cpu) and out is args[0] and self.marked(out) != on_cuda:
            out = out.clone()  # returned self (everything is on the CPU here); a real device move copies
        for t in _tensors(out if isinstance(out, (tuple, list)) else [out]):
            if on_cuda:
                self.mark(t)
            elif self.marked(t):
                delattr(t, _FAKE)
        return out


def _on_fake_cuda(t: torch.Tensor) -> torch.Tensor:
    return FakeCudaMode.mark(t.clone())


def test_fake_cuda_mode_catches_what_cuda_rejects():
    """The detector has power: the mismatches the rules used to make raise under it, fixes do not."""
    probs = _on_fake_cuda(torch.rand(4, 8).softmax(-1))
    gen = torch.Generator().manual_seed(0)
    with FakeCudaMode():
        assert probs.device.type == "cuda" and probs[0].device.type == "cuda"
        with pytest.raises(RuntimeError, match="generator"):
            torch.multinomial(probs[0], 1, generator=gen)  # a CPU generator on CUDA probabilities
        with pytest.raises(RuntimeError, match="generator"):
            torch.rand((), generator=FakeCudaGenerator(), device="cpu")
        with pytest.raises(RuntimeError, match="same device"):
            probs.gather(1, torch.tensor([1, 2]).view(1, -1).expand(4, -1))  # a CPU index
        index = torch.tensor([1, 2], device=probs.device)
        assert FakeCudaMode.marked(index) and FakeCudaMode.marked(probs.gather(1, index.expand(4, -1)))
        row = probs[0].to("cpu")
        assert row.device.type == "cpu" and not FakeCudaMode.marked(row)
        assert FakeCudaMode.marked(probs) and probs.cpu() is not probs  # a move copies


def _verify_rule(rule, tokens, children, logits, generator, config):
    return verify(rule, tokens, children, logits, config, generator)


def _rules(config):
    """Every entry point that turns logits into tokens, as f(tokens, children, logits, generator)."""
    return {
        "greedy": lambda t, ch, lg, g: accept_greedy(t, ch, lg),
        "typical": lambda t, ch, lg, g: accept_typical(t, ch, lg, config, generator=g),
        "sampling": lambda t, ch, lg, g: accept_sampling(t, ch, lg, config, g),
        **{f"verify_{r}": functools.partial(_verify_rule, r, config=config) for r in RULES},
        "sample": lambda t, ch, lg, g: config.sample(lg[0], g),
    }


@pytest.mark.parametrize("generator", [None, "cpu", "cuda"])
@pytest.mark.parametrize("config", [SamplingConfig(1.0), SamplingConfig(0.7, top_k=5, top_p=0.9)])
def test_rules_keep_to_the_logits_device(config, generator):
    """Logits on a (simulated) CUDA device: no op mixes devices, whatever the generator's device, and a
    seeded generator gives the same tokens as with the logits on the CPU (the draws happen on the
    generator's device, or on the CPU without one)."""
    logits, tokens, children = _setup(3)
    make = {
        None: lambda s: None,
        "cpu": lambda s: torch.Generator().manual_seed(s),
        "cuda": lambda s: FakeCudaGenerator().manual_seed(s),
    }[generator]
    for name, rule in _rules(config).items():
        for seed in range(20):
            expected = rule(tokens, children, logits, torch.Generator().manual_seed(seed))
            mode = FakeCudaMode()
            if generator is None:
                torch.manual_seed(seed)
            with mode:
                got = rule(tokens, children, _on_fake_cuda(logits), make(seed))
            assert mode.calls > 0
            if generator is not None:
                assert got == expected, (name, seed)


def test_sampling_rule_reproducible_with_a_seed():
    logits, tokens, children = _setup(4)
    config = SamplingConfig(1.0)
    runs = [
        [accept_sampling(tokens, children, logits, config, gen) for _ in range(50)]
        for gen in (torch.Generator().manual_seed(7), torch.Generator().manual_seed(7))
    ]
    assert runs[0] == runs[1]


def _typical_reference(tokens, children, logits, config, threshold=0.09, alpha=0.3, generator=None):
    """Medusa's typical rule written out over every node's distribution (the fast one skips leaves)."""
    probs = config.probs(logits)  # [N, V]
    entropy = -(probs * probs.clamp_min(1e-30).log()).sum(dim=-1)  # [N]
    cutoff = torch.clamp(alpha * torch.exp(-entropy), max=threshold)  # [N]

    def deepest(node):
        best = [node]
        for c in children[node]:
            if probs[node, tokens[c]] > cutoff[node]:
                sub = [node, *deepest(c)]
                if len(sub) > len(best):
                    best = sub
        return best

    path = deepest(0)
    return path, int(torch.multinomial(probs[path[-1]], 1, generator=generator))


@pytest.mark.parametrize("tree", [TREE, treespec.default_tree(16, 4), treespec.Tree.from_choices([])])
def test_typical_rule_matches_the_reference(tree):
    children = [tree.children(i) for i in range(tree.num_nodes)]
    gen = torch.Generator().manual_seed(5)
    for trial in range(40):
        logits = torch.randn(tree.num_nodes, 40, generator=gen) * 4  # [N, V]
        tokens = torch.randint(0, 40, (tree.num_nodes,), generator=gen).tolist()
        for node in range(tree.num_nodes):  # make about half the drafts the parent's favourite
            for c in children[node]:
                if torch.rand((), generator=gen) < 0.5:
                    tokens[c] = int(logits[node].argmax())
        for config in (SamplingConfig(1.0), SamplingConfig(0.7, top_k=8), SamplingConfig(0.9, top_p=0.8)):
            ours = accept_typical(
                tokens, children, logits, config, generator=torch.Generator().manual_seed(trial)
            )
            ref = _typical_reference(
                tokens, children, logits, config, generator=torch.Generator().manual_seed(trial)
            )
            assert ours == ref, (trial, config)
