"""Self-speculative drafting: the base model's first k layers and a trained exit head draft a chain.

No second model and no second cache: drafting runs the lower layers [0, k) of the base model itself, one
token at a time, writing their K/V into the base model's own TreeKVCache at the positions the
verification will use. Verification then runs only the upper layers [k, L) over the drafted tokens,
starting from the layer-k hidden states kept from drafting, so the lower-layer work of every drafted
token is done once:

    draft:   x_0 = root; for i in 0..gamma:  h_k[i] = layers[0:k](x_i at position c + i)   (K/V -> cache)
                                            x_{i+1} = argmax exit_head(norm(h_k[i]))       (i < gamma)
    verify:  hidden = norm(layers[k:L](h_k[0..gamma], positions c..c+gamma))             (K/V -> cache)

The lower layers see exactly the tokens and positions a full forward would, so the result equals a full
verification up to float rounding (tested); greedy output equals the base model's. The exit head is an
`ExitHead` (one head on layer k, in the MedusaHeads checkpoint format), trained by the same pipeline
(`scripts/train_heads.py --exit-layer k`). The model must be a Llama-style transformers decoder
(`model.model.layers`, `rotary_emb`, `norm`): Llama, Qwen2, Mistral.
"""

from __future__ import annotations

import time

import torch

from ..core.attention import AttentionPlan
from ..core.cache import CACHE_KWARG
from ..core.drafting import BaseDrafter, DrafterReport, Proposal, Scorer, SequenceStart, single_row
from .draft_model import DraftStats, accepted_prefix, chain_tree
from .heads import ExitHead


def decoder_parts(model):
    """(embedding, decoder layers, rotary embedding, final norm) of a Llama-style HF causal LM."""
    inner = model.base_model
    parts = [getattr(inner, name, None) for name in ("embed_tokens", "layers", "rotary_emb", "norm")]
    if any(p is None for p in parts):
        raise ValueError(
            f"self-speculative drafting runs the decoder layer by layer and needs a Llama-style model "
            f"(embed_tokens, layers, rotary_emb, norm); {type(model).__name__} is not one"
        )
    return parts


def run_layers(model, hidden, positions, cache, start: int, stop: int, plan: AttentionPlan | None = None):
    """Decoder layers [start, stop) over hidden [1, n, H] at positions [1, n] -> [1, n, H] (pre-norm).

    With a cache the layers read and write their K/V there (treespec attention must be enabled);
    without one they attend causally within the block (plain prefill, used for training data).
    """
    _, layers, rotary, _ = decoder_parts(model)
    position_embeddings = rotary(hidden, position_ids=positions)
    extra = {} if cache is None else {"tree_attention": plan or AttentionPlan()}
    for layer in layers[start:stop]:
        hidden = layer(
            hidden,
            attention_mask=None,
            position_embeddings=position_embeddings,
            position_ids=positions,
            use_cache=cache is not None,
            **{CACHE_KWARG: cache},
            **extra,
        )
    return hidden


@torch.inference_mode()
def layer_hidden_states(model, ids: torch.Tensor, layer: int) -> torch.Tensor:
    """norm(residual stream after the first `layer` layers): ids [B, T] -> [B, T, H] (causal, no cache)."""
    embed, _, _, norm = decoder_parts(model)
    positions = torch.arange(ids.shape[1], device=ids.device)[None]  # [1, T]
    return norm(run_layers(model, embed(ids), positions, None, 0, layer))  # [B, T, H]


class SelfSpeculativeDrafter(BaseDrafter):
    """Chain drafter over the base model's first `exit_head.exit_layer` layers; verification reuses them."""

    def __init__(self, model, exit_head: ExitHead, gamma: int = 4):
        k = exit_head.exit_layer
        embed, layers, _, norm = decoder_parts(model)
        if not 0 < k < len(layers):
            raise ValueError(
                f"these heads have exit_layer={k}; an exit head for self-speculative drafting needs "
                f"1 <= exit_layer < {len(layers)} (train one with scripts/train_heads.py --exit-layer K)"
            )
        exit_head.check_compatible(model)
        self.model, self.exit_head, self.gamma, self.exit_layer = model, exit_head, gamma, k
        self.num_layers = len(layers)
        self.embed, self.norm = embed, norm
        self.tree = chain_tree(gamma)
        self.weight = exit_head.output_weight(model.get_output_embeddings())  # [V', H]
        # the target's TreeKVCache, given by the decoder through start(); the drafter owns no cache
        self.target_cache = None
        self.plan = AttentionPlan()  # one token at a time: causal
        self.lower: torch.Tensor | None = None  # [1, gamma + 1, H] layer-k states of the drafted chain
        self.drafts: list[int] = []
        self.stats = DraftStats()

    def start(self, sequence: SequenceStart) -> None:
        """Start a sequence (after the target's prefill): draft into the target's cache."""
        self.target_cache, self.plan = sequence.cache, AttentionPlan(sequence.kernel)
        self.stats = DraftStats()
        self.drafts = []
        hidden = self.embed.weight
        self.lower = hidden.new_empty(1, self.gamma + 1, hidden.shape[1])  # allocated once per generation

    @torch.inference_mode()
    def propose(self, hidden: torch.Tensor, roots: torch.Tensor, max_depth: int | None = None) -> Proposal:
        hidden, root = single_row(hidden, roots)  # [H], int
        if self.target_cache is None:
            raise RuntimeError("SelfSpeculativeDrafter.start(sequence) must run before propose()")
        t0 = time.perf_counter()
        cache, c = self.target_cache, self.target_cache.committed
        tokens = [root]
        probs = [1.0]
        for i in range(self.gamma + 1):
            ids = torch.tensor([[tokens[i]]], device=hidden.device)  # [1, 1]
            positions = torch.tensor([[c + i]], device=hidden.device)  # [1, 1]
            h = run_layers(self.model, self.embed(ids), positions, cache, 0, self.exit_layer, self.plan)
            cache.commit_all()  # the write pointer moves on; the upper layers' slots stay empty for now
            self.lower[:, i] = h[:, 0]
            if i < self.gamma:
                state = self.exit_head.head_hidden(self.norm(h), num_heads=1)  # [1, 1, 1, H]
                p = self.exit_head.logits(state, self.weight)[0, 0, 0].float().softmax(-1)  # [V']
                best = p.max(-1)
                tokens.append(int(self.exit_head.token_ids(best.indices)))
                probs.append(float(best.values))
        cache.rollback(c)  # lower-layer K/V of the chain stay in place for the verification to read
        self.drafts = tokens[1:]
        self.stats.seconds += time.perf_counter() - t0
        self.stats.drafted += self.gamma
        return Proposal(torch.tensor([tokens], device=hidden.device), torch.tensor([probs]))  # [1, N]

    def scorer(self) -> Scorer:
        return self.verify_upper_layers

    def verify_upper_layers(self, ids, positions, cache, plan: AttentionPlan) -> torch.Tensor:
        """The upper layers over the drafted chain, from the kept layer-k states: -> [1, N, H] (final norm).

        Same contract as the decoder's full forward; `ids` were embedded and run through the lower layers
        while drafting (the chain's plan is causal, which is what a chain's tree mask says)."""
        n = ids.shape[1]
        h = run_layers(
            self.model, self.lower[:, :n], positions, cache, self.exit_layer, self.num_layers, plan
        )
        return self.norm(h)  # [1, N, H]

    def observe(self, committed: list[list[int]], features: torch.Tensor | None = None) -> None:
        """Tokens the last step committed: counts the accepted drafts (the cache is the target's; a step
        that verified the root alone drafted nothing)."""
        self.stats.accepted += accepted_prefix(committed[0], self.drafts)
        self.drafts = []

    def report(self) -> DrafterReport:
        return DrafterReport(self.stats.as_dict())
