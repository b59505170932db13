"""Acceptance rules: which branch of the candidate tree the base model keeps, and the bonus token.

Every rule walks the tree from the root (the token the base model already chose) and returns
`(path, bonus)`: `path` lists the accepted nodes root first, `bonus` is the base model's own next
token after the last accepted node (it becomes the next step's root).

- greedy: a child is accepted iff it is the base model's argmax; the output is exactly the base
  model's greedy output.
- typical (Medusa's rule, not lossless): a child token x is accepted iff
  p(x) > min(threshold, alpha * exp(-entropy(p))); the deepest accepted node wins.
- sampling (lossless speculative sampling for temperature > 0): at a node with target distribution p
  the children are tried in order; child x is accepted with probability p(x); on rejection x is
  removed from p and p renormalised; if every child is rejected the bonus is drawn from what remains.
  Each child is a deterministic draft, so this keeps the output distribution exactly p.

Devices: the logits may live on any device; everything derived from them stays there. Random draws
happen on the device of the `generator` passed (a CPU generator: the [V] probability row that a draw
needs is copied to the CPU first, so a seed gives the same draws for a model on the CPU or on CUDA);
without a generator they happen on the CPU with torch's default CPU generator (`torch.manual_seed`).
The sampling rule's child-by-child loop reads single probabilities, so it runs on the draw device
(one [V] copy per visited node instead of a device sync per child).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..ops import argmax_rows

RULES = ("greedy", "typical", "sampling")


def draw_device(generator: torch.Generator | None) -> torch.device:
    """Where the rules make random draws: the generator's device, or the CPU without a generator."""
    return torch.device("cpu") if generator is None else generator.device


# generation settings `SamplingConfig.from_generation_config` refuses unless unset or at this (no-op) value
UNFOLLOWED = {
    "num_beams": 1,
    "typical_p": 1.0,
    "epsilon_cutoff": 0.0,
    "eta_cutoff": 0.0,
    "top_h": None,
    "min_new_tokens": 0,
    "min_length": 0,
    "bad_words_ids": None,
    "suppress_tokens": None,
    "begin_suppress_tokens": None,
    "sequence_bias": None,
    "forced_bos_token_id": None,
    "forced_eos_token_id": None,
    "exponential_decay_length_penalty": None,
    "encoder_repetition_penalty": 1.0,
    "guidance_scale": None,
    "watermarking_config": None,
    "renormalize_logits": False,
    "dola_layers": None,
}


@dataclass(frozen=True)
class SamplingConfig:
    """How tokens are chosen (as in HF generate): the base model's next-token distribution (temperature,
    top-k, top-p, min-p: HF's warpers in HF's order; temperature 0 is greedy), the rule that accepts drafted
    tokens (`RULES`: "sampling" is lossless, and greedy when temperature is 0; "typical" is Medusa's, not
    lossless; "greedy"), the seed of the random draws (None: torch's default generator), HF's
    `repetition_penalty` (1.0: off) and `logits_processor`: HF `LogitsProcessor`s (or callables
    `(input_ids [n, L], scores [n, V]) -> scores`) applied in order after the penalty and before temperature /
    top-k / top-p / min-p, each tree node at its own sequence (`core.processing`)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    acceptance: str = "sampling"
    seed: int | None = None
    repetition_penalty: float = 1.0
    logits_processor: Sequence[Callable] | None = None
    min_p: float = 0.0

    def __post_init__(self):
        if self.acceptance not in RULES:
            raise ValueError(f"unknown acceptance rule {self.acceptance!r}; choose one of {RULES}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1] (0 = off), got {self.min_p}")
        processors = tuple(self.logits_processor or ())
        for p in processors:
            if not callable(p):
                raise TypeError(
                    f"logits_processor takes callables (input_ids, scores) -> scores, such as HF's "
                    f"LogitsProcessor; got {type(p).__name__}"
                )
        object.__setattr__(self, "logits_processor", processors or None)  # a tuple: the config stays hashable
        if not self.repetition_penalty > 0:
            raise ValueError(
                f"repetition_penalty must be > 0 (1.0 = off; above 1 a seen token is less likely), "
                f"got {self.repetition_penalty}"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @classmethod
    def from_generation_config(cls, config, **overrides) -> SamplingConfig:
        """What HF `generate` would do with a `GenerationConfig` (e.g. `model.generation_config`, where a
        model ships its sampling settings): do_sample with temperature / top-k / top-p / min-p (HF's
        defaults 1.0 / 50 / 1.0 / 0 where unset), else greedy; repetition_penalty; no_repeat_ngram_size as
        HF's processor. overrides: fields set on top (e.g. seed). A setting treespec does not follow is
        refused, by name."""

        def get(name, default=None):
            value = getattr(config, name, None)
            return default if value is None else value

        unsupported = [name for name, value in UNFOLLOWED.items() if get(name) not in (None, value)]
        if unsupported:
            raise ValueError(
                f"treespec does not follow these generation settings: {', '.join(unsupported)}; "
                "leave them unset (or decode with HF generate)"
            )
        sample = bool(get("do_sample", False))
        fields = {  # where unset, HF's defaults
            "temperature": float(get("temperature", 1.0)) if sample else 0.0,
            "top_k": int(get("top_k", 50)) if sample else 0,
            "top_p": float(get("top_p", 1.0)) if sample else 1.0,
            "min_p": float(get("min_p", 0.0)) if sample else 0.0,
            "repetition_penalty": float(get("repetition_penalty", 1.0)),
        }
        if get("no_repeat_ngram_size"):
            from transformers import NoRepeatNGramLogitsProcessor

            fields["logits_processor"] = (NoRepeatNGramLogitsProcessor(int(get("no_repeat_ngram_size"))),)
        return cls(**(fields | overrides))

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """Next-token distribution(s): logits [..., V] -> probabilities [..., V] in float32."""
        logits = logits.float() / (self.temperature if self.temperature > 0 else 1.0)
        if self.top_k > 0 and self.top_k < logits.shape[-1]:
            kth = logits.topk(self.top_k, dim=-1).values[..., -1:]  # [..., 1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if self.top_p < 1.0:
            sorted_logits, order = logits.sort(dim=-1)  # ascending
            cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
            drop_sorted = cumulative <= 1 - self.top_p
            drop_sorted[..., -1] = False  # always keep the most likely token
            drop = drop_sorted.scatter(-1, order, drop_sorted)
            logits = logits.masked_fill(drop, float("-inf"))
        if self.min_p > 0:  # tokens below min_p x the most likely one's probability (which always stays)
            probs = logits.softmax(dim=-1)
            cut = self.min_p * probs.amax(dim=-1, keepdim=True)  # [..., 1]
            logits = logits.masked_fill(probs < cut, float("-inf"))
        return logits.softmax(dim=-1)

    def sample(self, logits: torch.Tensor, generator: torch.Generator | None = None) -> int:
        """One next token from logits [V] (any device): argmax when greedy, else a draw from `probs`
        on the generator's device (`draw_device`)."""
        if self.greedy:
            return int(logits.argmax())
        probs = self.probs(logits).to(draw_device(generator))  # [V]
        return int(torch.multinomial(probs, 1, generator=generator))


def accept_greedy(
    tokens: list[int], children: list[list[int]], logits: torch.Tensor
) -> tuple[list[int], int]:
    """tokens: [N] tree tokens; children: per node; logits: [N, V] base logits at every node.

    The deepest path whose every token is the base model's argmax after its prefix. Several children
    can carry the same token (e.g. a prompt-lookup branch beside the heads' guess): all are followed.
    """
    return greedy_path(tokens, children, argmax_rows(logits).tolist())


def greedy_path(tokens: list[int], children: list[list[int]], best: list[int]) -> tuple[list[int], int]:
    """accept_greedy from best [N]: the base model's argmax after each node (max(dim=-1).indices, the
    first maximum on ties)."""

    def deepest(node: int) -> list[int]:
        path = [node]
        for c in children[node]:
            if tokens[c] == best[node]:
                sub = [node, *deepest(c)]
                if len(sub) > len(path):
                    path = sub
        return path

    path = deepest(0)
    return path, best[path[-1]]


def accept_typical(
    tokens: list[int],
    children: list[list[int]],
    logits: torch.Tensor,
    config: SamplingConfig,
    threshold: float = 0.09,
    alpha: float = 0.3,
    generator: torch.Generator | None = None,
) -> tuple[list[int], int]:
    """Medusa's typical acceptance; falls back to greedy when temperature is 0.

    logits: [N, V] on any device; the bonus token is drawn on the generator's device (`draw_device`).
    Distributions are computed only where they are read: at the M nodes that have children (about
    half of a tree; a top-p sort over the vocabulary is costly on a CPU) and at the last accepted node.
    """
    if config.greedy:
        return accept_greedy(tokens, children, logits)
    inner = [node for node, kids in enumerate(children) if kids] or [0]  # [M] nodes whose children we test
    row = {node: i for i, node in enumerate(inner)}
    probs = config.probs(logits.index_select(0, torch.tensor(inner, device=logits.device)))  # [M, V]
    entropy = -(probs * probs.clamp_min(1e-30).log()).sum(dim=-1)  # [M]
    cutoff = torch.clamp(alpha * torch.exp(-entropy), max=threshold).tolist()  # [M]
    index = torch.tensor(tokens, device=probs.device).view(1, -1).expand(len(inner), -1)  # [M, N]
    p_token = probs.gather(1, index).tolist()  # [M][N]: p_u(token_c), read once (one sync)

    def deepest(node: int) -> list[int]:
        best: list[int] = [node]
        for c in children[node]:
            if p_token[row[node]][c] > cutoff[row[node]]:
                sub = [node] + deepest(c)
                if len(sub) > len(best):
                    best = sub
        return best

    path = deepest(0)
    last = probs[row[path[-1]]] if path[-1] in row else config.probs(logits[path[-1]])  # [V]
    last = last.to(draw_device(generator))
    bonus = int(torch.multinomial(last, 1, generator=generator))
    return path, bonus


def accept_sampling(
    tokens: list[int],
    children: list[list[int]],
    logits: torch.Tensor,
    config: SamplingConfig,
    generator: torch.Generator | None = None,
) -> tuple[list[int], int]:
    """Lossless multi-candidate speculative sampling over the tree (see module docstring).

    logits: [N, V] on any device; each visited node's [V] distribution moves to the draw device
    (`draw_device`: the generator's, the CPU without one) and the draws happen there.
    """
    device = draw_device(generator)
    node, path = 0, [0]
    while True:
        p = config.probs(logits[node]).to(device)  # [V] target distribution at this node
        accepted = None
        for c in children[node]:
            x = tokens[c]
            px = float(p[x])
            if px > 0 and float(torch.rand((), generator=generator, device=device)) < px:
                accepted = c
                break
            if px > 0:
                p[x] = 0.0  # rejected: remove x and renormalise the residual
                total = p.sum()
                if total <= 0:
                    break
                p /= total
        if accepted is None:
            return path, int(torch.multinomial(p, 1, generator=generator))
        node = accepted
        path.append(node)


def greedy_rule(rule: str, config: SamplingConfig) -> bool:
    """Whether `rule` accepts greedily under `config` (every rule does at temperature 0)."""
    return rule == "greedy" or config.greedy


def verify_rows(
    rule: str,
    tokens: list[list[int]],
    children: list[list[int]],
    logits: torch.Tensor,
    config: SamplingConfig,
    generator: torch.Generator | None = None,
    best: torch.Tensor | None = None,
) -> list[tuple[list[int], int]]:
    """`verify` for each row of a batch (tokens [A][N], logits [A, N, V], one tree): greedy acceptance
    takes every row's argmax in one call, or reads best [A, N] (logits.max(dim=-1).indices) when the
    caller has it."""
    if rule not in RULES:
        raise ValueError(f"unknown acceptance rule {rule!r}; choose one of {RULES}")
    if greedy_rule(rule, config):
        best = (argmax_rows(logits) if best is None else best).tolist()  # [A][N]
        return [greedy_path(row, children, b) for row, b in zip(tokens, best, strict=True)]
    return [verify(rule, row, children, logits[a], config, generator) for a, row in enumerate(tokens)]


def verify(
    rule: str,
    tokens: list[int],
    children: list[list[int]],
    logits: torch.Tensor,
    config: SamplingConfig,
    generator: torch.Generator | None = None,
) -> tuple[list[int], int]:
    """Dispatch to one acceptance rule; returns (accepted path of node indices, bonus token)."""
    if rule not in RULES:
        raise ValueError(f"unknown acceptance rule {rule!r}; choose one of {RULES}")
    if greedy_rule(rule, config):
        return accept_greedy(tokens, children, logits)
    if rule == "sampling":
        return accept_sampling(tokens, children, logits, config, generator)
    return accept_typical(tokens, children, logits, config, generator=generator)
