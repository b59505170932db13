"""DraftModelDrafter: a smaller causal LM that shares the tokenizer drafts a chain of gamma tokens.

The draft model keeps its own K/V in a `SpeculativeKVCache`, allocated once per generation (prompt +
max_new_tokens + gamma + 1 tokens). One step:

    draft:   encode the tokens it does not hold yet (the bonus token of the last step, normally just
             the root), then propose d1..d_gamma one token at a time; d1..d_{gamma-1} are encoded on the
             way (appended to the speculative part of its cache)
    observe: the target accepted d1..d_a and added a bonus token: keep the encoded d1..d_min(a, gamma-1)
             by moving the commit pointer (append-on-accept), drop the rest by pointer (rollback), and
             remember the tokens still to encode (the bonus, plus d_gamma when all were accepted)

so no token the drafter already holds is encoded twice. Drafting is greedy (argmax): the target's
verification decides what is emitted, so greedy output equals the target's whatever the drafter says.

`branching={depth: k}` turns the chain into a tree at no extra draft cost: at that depth the draft's
k - 1 runner-up tokens become leaves beside the chain, verified in the same forward pass (when the
chain's token is rejected there, a runner-up may still be accepted).
"""

from __future__ import annotations

import time

import torch

from ..core.attention import AttentionPlan, auto_kernel, tree_attention_enabled
from ..core.cache import CACHE_KWARG
from ..core.drafting import BaseDrafter, DrafterReport, Proposal, SequenceStart, single_row
from ..core.spec_cache import STORAGES, SpeculativeKVCache
from ..core.tree import Tree


def chain_tree(gamma: int, branching: dict[int, int] | None = None) -> Tree:
    """The root followed by a chain of gamma drafted tokens; branching {depth: k} adds the k - 1
    runner-up guesses at that depth (1..gamma) as leaves beside the chain."""
    if gamma < 1:
        raise ValueError(f"gamma (tokens drafted per step) must be >= 1, got {gamma}")
    choices = [(0,) * d for d in range(1, gamma + 1)]
    for depth, k in sorted((branching or {}).items()):
        if not 1 <= depth <= gamma or k < 1:
            raise ValueError(f"branching {{{depth}: {k}}}: need 1 <= depth <= gamma ({gamma}) and k >= 1")
        choices += [(0,) * (depth - 1) + (r,) for r in range(1, k)]
    return Tree.from_choices(choices)


def parse_branching(spec: str | None, gamma: int | None = None) -> dict[int, int]:
    """Branching from text: "1:4,3:2" -> {1: 4, 3: 2} (top-4 at depth 1, top-2 at depth 3); None or ""
    -> {}. With gamma, depths beyond it are dropped (one spec serves every gamma that tuning tries)."""
    out = {}
    for item in filter(None, (spec or "").replace(" ", "").split(",")):
        depth, _, k = item.partition(":")
        if not (depth.isdigit() and k.isdigit()):
            raise ValueError(f"branching {spec!r}: write depth:k pairs, e.g. 1:4,3:2")
        if gamma is None or int(depth) <= gamma:
            out[int(depth)] = int(k)
    return out


def accepted_prefix(tokens: list[int], drafts: list[int]) -> int:
    """How many drafts a step's committed tokens (accepted ones, then the bonus) start with."""
    n = 0
    while n < min(len(tokens) - 1, len(drafts)) and tokens[n] == drafts[n]:
        n += 1
    return n


class DraftStats:
    """What a drafter measured over one generation: tokens drafted and accepted, seconds drafting."""

    def __init__(self):
        self.drafted = 0
        self.accepted = 0
        self.seconds = 0.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafted tokens / drafted tokens."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def seconds_per_token(self) -> float:
        """Drafting time per drafted token."""
        return self.seconds / self.drafted if self.drafted else 0.0

    def as_dict(self) -> dict:
        return {
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance_rate": self.acceptance_rate,
            "seconds_per_drafted_token": self.seconds_per_token,
        }


def load_draft_model(folder, target_model, dtype=None):
    """A draft model from an HF folder (safetensors), on the target's device and dtype; the vocabulary
    must be the target's."""
    from transformers import AutoModelForCausalLM

    param = next(target_model.parameters())
    draft = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype or param.dtype).to(param.device).eval()
    check_vocabularies(draft, target_model)
    return draft


def check_vocabularies(draft_model, target_model) -> None:
    """A draft model must score the target's token ids: same vocabulary size (and the same tokenizer)."""
    v_draft = draft_model.get_output_embeddings().weight.shape[0]
    v_target = target_model.get_output_embeddings().weight.shape[0]
    if v_draft != v_target:
        raise ValueError(
            f"the draft model has a {v_draft}-token vocabulary and the target {v_target}: a draft model "
            "must share the target's tokenizer"
        )


class DraftModelDrafter(BaseDrafter):
    """A small causal LM drafts a chain (plus optional runner-up leaves) into its own speculative cache."""

    def __init__(
        self,
        draft_model,
        gamma: int = 4,
        storage: str = "model",
        kernel: str = "auto",
        branching: dict[int, int] | None = None,
    ):
        if storage not in STORAGES:
            raise ValueError(f"unknown speculative cache storage {storage!r}; choose one of {STORAGES}")
        self.model = draft_model
        self.gamma = gamma
        self.tree = chain_tree(gamma, branching)
        index = {p: i + 1 for i, p in enumerate(self.tree.choices)}
        # per depth d = 1..gamma: the chain's node, then the runner-up leaves in rank order
        self.levels = [
            [
                index[(0,) * (d - 1) + (r,)]
                for r in range(self.tree.max_rank)
                if (0,) * (d - 1) + (r,) in index
            ]
            for d in range(1, gamma + 1)
        ]
        self.storage = storage
        param = next(draft_model.parameters())
        if kernel == "auto":
            kernel = auto_kernel(param.device, param.dtype)
        self.kernel = kernel
        self.plan = AttentionPlan(kernel)  # the draft model runs causal blocks only
        self.device = param.device
        self.cache: SpeculativeKVCache | None = None
        self.todo: list[int] = []  # committed tokens the draft cache does not hold yet
        self.drafts: list[int] = []  # d1..d_gamma of the last step
        self.stats = DraftStats()

    def start(self, sequence: SequenceStart) -> None:
        """Start a sequence (prompt + the target's first token): allocates the draft cache once for the
        sequence's capacity (reused by later sequences that fit) and encodes the prompt."""
        tokens = sequence.tokens
        capacity = sequence.capacity + self.gamma + 1
        if self.cache is None or self.cache.max_len < capacity:
            self.cache = SpeculativeKVCache.for_model(self.model, capacity, self.storage, self.gamma + 1)
        self.cache.reset()
        self.stats = DraftStats()
        self.drafts = []
        self.todo = list(tokens[:-1])
        self._encode(self.todo)  # the prompt (the root is encoded by the first draft)
        self.cache.accept(len(self.todo))
        self.todo = [tokens[-1]]

    @torch.inference_mode()
    def _encode(self, tokens: list[int]) -> torch.Tensor:
        """Append `tokens` to the draft cache; returns the draft logits at the last one: [V]."""
        cache = self.cache
        ids = torch.tensor([tokens], device=self.device)  # [1, n]
        positions = torch.arange(cache.length, cache.length + len(tokens), device=self.device)[None]  # [1, n]
        with tree_attention_enabled(self.model):
            out = self.model.base_model(
                input_ids=ids,
                position_ids=positions,
                use_cache=True,
                tree_attention=self.plan,
                **{CACHE_KWARG: cache},
            )
        cache.advance(len(tokens))
        return self.model.get_output_embeddings()(out.last_hidden_state[0, -1])  # [V]

    @torch.inference_mode()
    def propose(self, hidden: torch.Tensor, roots: torch.Tensor, max_depth: int | None = None) -> Proposal:
        hidden, root = single_row(hidden, roots)  # [H], int
        if self.cache is None:
            raise RuntimeError("DraftModelDrafter.start(sequence) must run before propose()")
        if not self.todo or self.todo[-1] != root:
            raise RuntimeError(
                f"the drafter expected root {self.todo[-1:]} but got {root}: call observe() each step"
            )
        t0 = time.perf_counter()
        tokens = [root] * self.tree.num_nodes  # [N], node order of self.tree
        self.drafts = []
        for depth, nodes in enumerate(self.levels):
            logits = self._encode(self.todo if depth == 0 else self.drafts[-1:])  # [V]: d_depth -> next
            top = logits.topk(len(nodes)).indices.tolist()  # chain token first, then the runners-up
            for node, token in zip(nodes, top, strict=True):
                tokens[node] = token
            self.drafts.append(top[0])
        self.stats.seconds += time.perf_counter() - t0
        self.stats.drafted += self.gamma
        return Proposal(torch.tensor([tokens], device=hidden.device))  # [1, N]

    def observe(self, committed: list[list[int]], features: torch.Tensor | None = None) -> None:
        """Tokens the last step committed: the accepted drafts, then the bonus token. After a step that
        verified the root alone (no propose: the decoder near the model's position limit) nothing of it is
        in the draft cache: its token joins the ones the next draft encodes."""
        tokens = committed[0]
        if not self.drafts:
            self.todo = self.todo + list(tokens)
            return
        accepted = accepted_prefix(tokens, self.drafts)
        self.stats.accepted += accepted
        held = min(accepted, self.gamma - 1)  # accepted drafts already encoded
        self.cache.accept(len(self.todo) + held)  # the encoded todo tokens, then those drafts
        self.todo = list(tokens[held:])
        self.drafts = []

    def report(self) -> DrafterReport:
        memory = {} if self.cache is None else self.cache.memory_bytes()
        return DrafterReport(self.stats.as_dict(), memory)
