"""Medusa-style drafters: heads on the base model's last hidden state fill a static candidate tree.

Node 0 is always the root, the base model's own next token; the other nodes get the heads' top-ranked
guesses. Both drafters implement `treespec.core.drafting.Drafter` (stateless: only `propose`) and draft
for a batch of rows at once.
"""

from __future__ import annotations

import torch

from ..core.drafting import BaseDrafter, Proposal, batch_rows
from ..core.packed import PackedMatrix, packed_linears, weight_key
from ..core.runtime import TargetRuntime
from ..core.tree import Tree
from .heads import ExitHead, MedusaHeads
from .heads_native import NativeHeads, level_plan, native_heads_reason, native_int8_default


class _NativeHeadsDrafter(BaseDrafter):
    """What both heads drafters share: their native heads (`drafters.heads_native`), rebuilt at a new sequence
    when the heads' weights changed since. Subclasses set heads, weight, output and embedding first."""

    native: NativeHeads | None = None

    def _init_native(self, native: bool | None, int8: bool | None) -> None:
        """native: None: where it can, False: the torch path, True: insist. int8: the native heads' numerics
        (drafting only: what is generated stays the same); None: int8 where the int8 kernels have vector
        instructions (measured: the same accepted length; the shipped heads' tree drafted in 0.67 ms a step
        against 1.18 in float, benchmarks/log/2026-12-07-f-native-heads.md)."""
        self.wants_native = native
        self.int8 = native_int8_default(self.heads) if int8 is None else int8
        self._bind_native()

    def _bind_native(self) -> None:
        """The native heads over the heads' current weights, or None (the torch path) where they cannot run
        (`wants_native` True: raise saying why not)."""
        self.native = None
        if self.wants_native is False:
            return
        reason = native_heads_reason(self.heads, self.embedding)
        if reason is None and self.output is None:
            reason = "no shared output rows"
        if reason is not None:
            if self.wants_native:
                raise ValueError(f"native=True, but the native heads cannot draft here: {reason}")
            return
        blocks = self.output.blocks.blocks if self.output.blocks is not None else None
        self.native = NativeHeads.of(self.heads, self.weight, blocks, self.embedding, self.int8)

    def _drafts_natively(self, hidden: torch.Tensor) -> bool:
        """Whether this call drafts through the native heads (CPU hidden states, no autograd)."""
        return self.native is not None and not torch.is_grad_enabled() and hidden.device.type == "cpu"

    def start(self, sequence) -> None:
        if sequence.row == 0 and self.native is not None:  # rebuilt if the weights changed since
            self._bind_native()


class MedusaDrafter(_NativeHeadsDrafter):
    """Independent Medusa heads: head k's top-r tokens fill the tree nodes at depth k+1 with rank r.

    On the CPU, float32 heads that share the target's output rows give every head's top-k in one native call
    (`drafters.heads_native`, the output rows read once for all heads); `native` and `int8` as in
    `SequentialDrafter`."""

    batched = True
    limits_depth = True
    costly_levels = True

    def __init__(
        self,
        heads: MedusaHeads,
        tree: Tree,
        lm_head: torch.nn.Module,
        native: bool | None = None,
        int8: bool | None = None,
    ):
        _check_depth(heads, tree)
        if heads.sequential:
            raise ValueError("these heads are sequential: use SequentialDrafter (make_drafter picks it)")
        self.heads = heads
        self.tree = tree
        self.weight, self.output = shared_output(heads, lm_head)  # [V', H] and states -> logits [.., V']
        self.topk = max(tree.max_rank, 1)
        device = next(heads.parameters()).device
        self.token_index = tree.token_index(self.topk).to(device)  # [N] into [root, head0 top-k, ...]
        self.depth = tree.depth.to(device)  # [N]
        self.embedding = None  # (independent heads read no embedding)
        self._init_native(native, int8)

    def propose(self, hidden: torch.Tensor, roots: torch.Tensor, max_depth: int | None = None) -> Proposal:
        """max_depth=D: heads 1..D only; the deeper nodes keep the root's token and probability 0."""
        hidden, roots = batch_rows(hidden, roots)  # [B, H], [B]
        B, depth = hidden.shape[0], self.tree.max_depth
        if max_depth is not None:
            depth = max(0, min(depth, max_depth))
        roots = roots.to(hidden.device)
        if depth == 0:
            n = self.tree.num_nodes
            probs = torch.zeros(B, n, device=hidden.device)  # [B, N]
            probs[:, 0] = 1.0
            return Proposal(roots[:, None].repeat(1, n), probs)
        if self._drafts_natively(hidden):
            tokens, values = self.native.head_topk(hidden, depth, self.topk)  # [B, K, topk] each
            guesses, values = tokens.reshape(B, -1), values.reshape(B, -1)  # [B, K*topk]
        else:
            with packed_linears(self.heads):
                states = self.heads.head_hidden(hidden[:, None], num_heads=depth)  # [K, B, 1, H]
                logits = _logits(self, states, None)  # [K, B, 1, V']
            top = logits[:, :, 0].float().softmax(dim=-1).topk(self.topk, dim=-1)  # [K, B, topk] each
            guesses = self.heads.token_ids(top.indices.transpose(0, 1).reshape(B, -1))  # [B, K*topk]
            values = top.values.transpose(0, 1).reshape(B, -1)  # [B, K*topk]
        candidates = torch.cat([roots[:, None].to(guesses.device), guesses], dim=1)  # [B, 1 + K*topk]
        probs = torch.cat([values.new_ones(B, 1), values], dim=1)
        index = self.token_index  # [N] into [root, head0 top-k, ...]
        if depth < self.tree.max_depth:  # undrafted nodes read the root's slot, then get probability 0
            undrafted = self.depth > depth  # [N]
            index = index.masked_fill(undrafted, 0)
            tokens, node_probs = candidates[:, index], probs[:, index].masked_fill(undrafted, 0.0)
            return Proposal(tokens, node_probs)
        # [B, N] each node's token and its probability under its head
        return Proposal(candidates[:, index], probs[:, index])


class SequentialDrafter(_NativeHeadsDrafter):
    """Sequential (Hydra-style) heads: the tree is drafted depth by depth.

    The children of a node at depth d are head d's top-ranked guesses given the tokens on the path to
    that node: head d runs once per depth, batched over the nodes of depth d that have children.
    `propose(..., max_depth=D)` drafts depths 1..D only (each level reads the output rows once): the
    deeper nodes keep the root's token and probability 0.

    On the CPU, float32 heads that share the target's output rows draft the whole tree in one native call
    (`drafters.heads_native`; native=None: when it can, False: the torch path, True: insist), in int8
    (`int8`, default where the CPU has the int8 kernels' vector instructions) or float numerics.
    """

    batched = True
    limits_depth = True
    costly_levels = True

    def __init__(
        self,
        heads: MedusaHeads,
        tree: Tree,
        lm_head: torch.nn.Module,
        embedding: torch.nn.Module,
        native: bool | None = None,
        int8: bool | None = None,
    ):
        _check_depth(heads, tree)
        if not heads.sequential:
            raise ValueError("these heads are independent: draft with MedusaDrafter (make_drafter picks it)")
        self.heads = heads
        self.tree = tree
        self.weight, self.output = shared_output(heads, lm_head)  # [V', H] and states -> logits [.., V']
        self.embedding = embedding.weight if hasattr(embedding, "weight") else embedding  # [V, H]
        device = next(heads.parameters()).device
        # per depth d: expanded nodes [n_d], their parents, children [c_d], child's parent row, child rank, k
        self.levels = tree.levels(device)
        self.hidden_size = heads.hidden_size
        self.dtype = next(heads.parameters()).dtype
        self.plan = level_plan(tree)  # the native call's view of the tree's levels
        self._init_native(native, int8)

    def propose(self, hidden: torch.Tensor, roots: torch.Tensor, max_depth: int | None = None) -> Proposal:
        hidden, roots = batch_rows(hidden, roots)  # [B, H], [B]
        if self._drafts_natively(hidden):
            depth = None if max_depth is None else max(max_depth, 0)
            tokens, probs = self.native(hidden, roots, self.plan, depth)  # [B, N] each
            return Proposal(tokens, probs)
        B, n = hidden.shape[0], self.tree.num_nodes
        tokens = roots.to(hidden.device)[:, None].repeat(1, n)  # [B, N] undrafted nodes: the root's token
        probs = torch.zeros(B, n, device=hidden.device)  # [B, N] undrafted nodes: 0
        probs[:, 0] = 1.0
        states = hidden.new_empty(B, n, self.hidden_size, dtype=self.dtype)  # [B, N, H] u at expanded nodes
        levels = self.levels if max_depth is None else self.levels[: max(max_depth, 0)]
        with packed_linears(self.heads):
            for d, (expanded, parents, children, row, rank, k) in enumerate(levels):
                before = hidden[:, None] if d == 0 else states[:, parents]  # [B, n_d, H] parents' states
                emb = self.heads.embed_tokens(self.embedding, tokens[:, expanded])  # [B, n_d, H]
                u = self.heads.advance(d, before, emb)  # [B, n_d, H]
                states[:, expanded] = u.to(states.dtype)
                logits = _logits(self, u, d)  # [B, n_d, V']
                top = logits.float().softmax(dim=-1).topk(k, dim=-1)  # values, indices: [B, n_d, k]
                tokens[:, children] = self.heads.token_ids(top.indices[:, row, rank])  # [B, c_d]
                probs[:, children] = top.values[:, row, rank]
        return Proposal(tokens, probs)  # [B, N] each


def shared_output(heads: MedusaHeads, lm_head) -> tuple[torch.Tensor | None, PackedMatrix | None]:
    """The heads' shared output rows [V', H] (`MedusaHeads.output_weight`) and their fast form, built once
    per heads and output layer (finding a weight's exact blocks is slow, and every drafter made for a
    `generate` call would pay it again), kept in the heads' `TargetRuntime`. Rebuilt when the output
    layer's weight or the draft vocabulary changes (storage or version). (None, None) for heads with their
    own outputs."""
    if heads.own_lm_head:
        return None, None
    source = lm_head if isinstance(lm_head, torch.Tensor) else getattr(lm_head, "weight", None)
    if source is None:
        return heads.output_weight(lm_head), None  # raises the error that says what to pass
    vocab = heads.draft_vocab
    key = (weight_key(source), None if vocab is None else weight_key(vocab))
    outputs = TargetRuntime.of(heads).outputs  # kept in the heads' runtime, per output layer
    cached = outputs.get(lm_head)
    if cached is None or cached[0] != key:
        weight = heads.output_weight(lm_head)
        cached = outputs[lm_head] = (key, weight, PackedMatrix(weight))
    return cached[1], cached[2]


def _logits(drafter, states: torch.Tensor, head: int | None) -> torch.Tensor:
    """Draft-vocabulary logits of head states [..., H] -> [..., V'] (the shared output rows through their
    prepacked copy; heads with their own output layers through those)."""
    if drafter.output is not None:
        return drafter.output(states)
    return drafter.heads.logits(states, None, head=head)


def make_drafter(heads: MedusaHeads, tree: Tree, model: torch.nn.Module) -> MedusaDrafter | SequentialDrafter:
    """The drafter that fits the heads: SequentialDrafter for sequential heads, MedusaDrafter otherwise."""
    if heads.sequential:
        return SequentialDrafter(heads, tree, model.get_output_embeddings(), model.get_input_embeddings())
    return MedusaDrafter(heads, tree, model.get_output_embeddings())


def _check_depth(heads: MedusaHeads, tree: Tree) -> None:
    if isinstance(heads, ExitHead) or heads.exit_layer:
        raise ValueError(
            f"these are exit heads (exit_layer={heads.exit_layer}) for self-speculative drafting: "
            "use treespec.SelfSpeculativeDrafter(model, heads, gamma)"
        )
    if tree.max_depth > heads.num_heads:
        raise ValueError(
            f"the tree is {tree.max_depth} levels deep but the heads predict only {heads.num_heads} "
            "tokens ahead; use a shallower tree or more heads"
        )
