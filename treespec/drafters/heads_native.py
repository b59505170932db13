"""Sequential Medusa heads drafting a whole static tree in one C++ call (csrc/native_heads.cpp), where the
torch path (`SequentialDrafter`) runs about twenty small operations per tree level.

    heads_native = NativeHeads.of(heads, output_weight, output_blocks, embedding)
    plan = level_plan(tree)                                   # the tree's levels, flattened once
    tokens, probs = heads_native(hidden [B, H], roots [B], plan, depth)   # -> [B, N] each

Each level d: u = before + P_d e(token), then u + silu(W u + b) per residual block, then the top-k of the
softmax of the shared output rows (the draft vocabulary's rows of the target's lm_head, read as their exact
Q8_0 / Q4_1 blocks when they have them) give the children's tokens and probabilities. Weights are read as
the heads hold them (a float32 weight of bfloat16 values from a bfloat16 copy made once). Float32 sums
throughout: the drafts equal the torch path's up to float rounding (tests/test_heads_native.py compares
the two on fresh random heads); drafts never change what is generated, only how fast.
"""

from __future__ import annotations

import torch

from .. import ops
from ..core.native import on_huge_pages, weight_slots
from ..core.packed import weight_key, weights_key
from ..core.runtime import TargetRuntime
from ..core.tree import Tree
from .heads import MedusaHeads


def native_heads_reason(heads: MedusaHeads, embedding: torch.Tensor) -> str | None:
    """None when `NativeHeads` can draft with `heads` over the target's `embedding`, else why not."""
    if not heads.sequential:
        return "independent heads (it drafts sequential ones)"
    if heads.own_lm_head:
        return "heads with their own output layers (it reads the target's shared output rows)"
    first = next(heads.parameters())
    if first.device.type != "cpu" or first.dtype != torch.float32:
        return f"{first.device.type} {first.dtype} heads (it runs float32 heads on the CPU)"
    if embedding.device.type != "cpu" or embedding.dtype not in (torch.float32, torch.bfloat16):
        return f"a {embedding.device.type} {embedding.dtype} embedding (it reads float32 or bfloat16)"
    if not ops.available("cpu"):
        return f"treespec's compiled CPU ops did not build ({ops.build_info()['error']})"
    return None


def level_plan(tree: Tree) -> torch.Tensor:
    """The tree's levels (`Tree.levels`) as the int64 vector the native call reads: [nodes, levels, then per
    level n_d, c_d, k, expanded, parents, children, row, rank]."""
    plan = [tree.num_nodes, tree.max_depth]
    for expanded, parents, children, row, rank, k in tree.levels():
        plan += [len(expanded), len(children), k]
        for part in (expanded, parents, children, row, rank):
            plan += part.tolist()
    return torch.tensor(plan, dtype=torch.long)


class NativeHeads:
    """The heads' weights bound once for native drafting (module docstring). The weights must not change
    after it is built: `of` builds another one when they did."""

    @classmethod
    def of(cls, heads: MedusaHeads, weight: torch.Tensor, blocks, embedding: torch.Tensor) -> NativeHeads:
        """The native heads over the current weights (the heads', the output rows `weight` [V', H] with their
        exact `blocks` or None, the target's `embedding`), kept in the heads' runtime: every drafter made
        from the same heads shares it."""
        runtime = TargetRuntime.of(heads)
        key = (weights_key(heads), weight_key(weight), weight_key(embedding))
        with runtime.lock:
            entry = runtime.native.get("heads")
            if entry is None or entry[0] != key:
                built = cls(heads, weight, blocks, embedding)
                entry = runtime.native["heads"] = (key, built, built.own_bytes)
            return entry[1]

    def __init__(self, heads: MedusaHeads, weight: torch.Tensor, blocks, embedding: torch.Tensor):
        reason = native_heads_reason(heads, embedding)
        if reason is not None:
            raise ValueError(f"the native heads cannot draft with these heads: {reason}")
        vocab = heads.draft_vocab
        tensors = [
            embedding.detach().contiguous(),
            torch.empty(0) if vocab is None else vocab.long().contiguous(),
        ]
        kinds = []
        for k in range(heads.num_heads):
            linears = [heads.token_proj[k], *(block.linear for block in heads.blocks[k])]
            for linear in linears:
                kind, slots = weight_slots(linear.weight, linear.bias, None, int8=False)
                kinds.append(kind)
                tensors += slots
        kind, slots = weight_slots(weight, None, blocks, int8=False)
        kinds.append(kind)
        tensors += slots
        dims = [heads.num_heads, heads.num_layers, heads.hidden_size, embedding.shape[0], weight.shape[0]]
        # every weight it reads per level, side by side on 2 MB pages (a level reads them straight after the
        # target's step has streamed ~100 MB through the caches); the embedding's rows are read one by one
        tensors = on_huge_pages(tensors, {embedding.data_ptr()})
        self._native = torch.classes.treespec.NativeHeads(dims, tensors, kinds)
        shared = {p.data_ptr() for p in heads.parameters()} | {weight.data_ptr(), embedding.data_ptr()}
        if blocks is not None:
            shared |= {t.data_ptr() for t in (blocks.q, blocks.d, blocks.m) if t is not None}
        copies = {t.data_ptr(): t.numel() * t.element_size() for t in tensors if t.numel()}
        self.own_bytes = sum(n for ptr, n in copies.items() if ptr not in shared)  # the bf16 copies, scales

    def __call__(
        self, hidden: torch.Tensor, roots: torch.Tensor, plan: torch.Tensor, depth: int | None = None
    ):
        """hidden [B, H], roots [B], plan (`level_plan`), depth: levels to draft (None: all) -> tokens [B, N]
        int64, probs [B, N] float32 (undrafted nodes: the root's token, probability 0)."""
        return self._native.propose(hidden, roots, plan, -1 if depth is None else depth)
