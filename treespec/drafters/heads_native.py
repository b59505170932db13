"""Medusa heads drafting in one C++ call (csrc/native_heads.cpp): sequential heads a whole static tree, where
the torch path (`SequentialDrafter`) runs about twenty small operations per tree level; independent heads
(`MedusaDrafter`) every head's top-k, their output rows read once for all heads.

    heads_native = NativeHeads.of(heads, output_weight, output_blocks, embedding)
    plan = level_plan(tree)                                   # the tree's levels, flattened once
    tokens, probs = heads_native(hidden [B, H], roots [B], plan, depth)   # sequential: -> [B, N] each
    tokens, probs = heads_native.head_topk(hidden [B, H], count, k)       # independent: -> [B, count, k]

Each level d: u = before + P_d e(token) (independent heads: u = hidden), then u + silu(W u + b) per residual
block, then the top-k of the softmax of the shared output rows (the draft vocabulary's rows of the target's
lm_head) give the children's tokens and probabilities. Drafts never change what is generated, only how fast,
so the heads may draft in either of two numerics:

- float (`int8=False`): weights as the heads hold them (a float32 weight of bfloat16 values from a
  bfloat16 copy made once; the output rows as their exact Q8_0 / Q4_1 blocks when they have them), float32
  sums: the drafts equal the torch path's (`SequentialDrafter(native=False)`) up to float rounding.
- int8 (`int8=True`, the default where it runs): every linear as Q8_0 blocks (the output rows' own blocks;
  the heads' weights rounded to Q8_0 once) read by the int8 kernels of the native step's int8 numerics
  (csrc/int8_linear.h), each input row quantized per block of 32: a quarter of float's arithmetic, and
  half the bytes of the heads' own (bf16-valued) weights. `int8_reference` computes the same in Python
  over the kernels' scalar engine.

tests/test_heads_native.py compares both with their references on fresh random heads.
"""

from __future__ import annotations

import torch

from .. import ops
from ..core.native import on_huge_pages, q8_blocks, weight_slots
from ..core.packed import weight_key, weights_key
from ..core.runtime import TargetRuntime
from ..core.tree import Tree
from .heads import MedusaHeads


def native_heads_reason(heads: MedusaHeads, embedding: torch.Tensor | None) -> str | None:
    """None when `NativeHeads` can draft with `heads` over the target's `embedding` (sequential heads read it;
    independent ones take None), else why not."""
    if heads.own_lm_head:
        return "heads with their own output layers (it reads the target's shared output rows)"
    first = next(heads.parameters())
    if first.device.type != "cpu" or first.dtype != torch.float32:
        return f"{first.device.type} {first.dtype} heads (it runs float32 heads on the CPU)"
    if heads.sequential and embedding is None:
        return "no embedding for sequential heads"
    if embedding is not None and (
        embedding.device.type != "cpu" or embedding.dtype not in (torch.float32, torch.bfloat16)
    ):
        return f"a {embedding.device.type} {embedding.dtype} embedding (it reads float32 or bfloat16)"
    if not ops.available("cpu"):
        return f"treespec's compiled CPU ops did not build ({ops.build_info()['error']})"
    return None


def native_int8_default(heads: MedusaHeads) -> bool:
    """Whether native heads draft in int8 by default: heads of whole blocks of 32, where the int8 kernels
    have an AVX2 or AVX-512 VNNI engine (their scalar engine alone is slower than the float kernels)."""
    if heads.hidden_size % 32 or not ops.available("cpu"):
        return False
    return max(torch.ops.treespec.int8_engines(), default=0) >= 2


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
    def of(
        cls,
        heads: MedusaHeads,
        weight: torch.Tensor,
        blocks,
        embedding: torch.Tensor | None,
        int8: bool = False,
    ) -> NativeHeads:
        """The native heads over the current weights (the heads', the output rows `weight` [V', H] with their
        exact `blocks` or None, the target's `embedding`) in float or int8 numerics, kept in the heads'
        runtime: every drafter made from the same heads shares it."""
        runtime = TargetRuntime.of(heads)
        key = (weights_key(heads), weight_key(weight), None if embedding is None else weight_key(embedding))
        form = "heads-int8" if int8 else "heads"
        with runtime.lock:
            entry = runtime.native.get(form)
            if entry is None or entry[0] != key:
                built = cls(heads, weight, blocks, embedding, int8)
                entry = runtime.native[form] = (key, built, built.own_bytes)
            return entry[1]

    def __init__(
        self,
        heads: MedusaHeads,
        weight: torch.Tensor,
        blocks,
        embedding: torch.Tensor | None,
        int8: bool = False,
    ):
        reason = native_heads_reason(heads, embedding)
        if reason is None and int8 and heads.hidden_size % 32:
            reason = f"hidden size {heads.hidden_size} in int8 (it quantizes blocks of 32)"
        if reason is not None:
            raise ValueError(f"the native heads cannot draft with these heads: {reason}")
        vocab = heads.draft_vocab
        table = torch.empty(0) if embedding is None else embedding.detach().contiguous()
        tensors = [table, torch.empty(0) if vocab is None else vocab.long().contiguous()]
        kinds = []
        for k in range(heads.num_heads):
            projection = [heads.token_proj[k]] if heads.sequential else []
            linears = [*projection, *(block.linear for block in heads.blocks[k])]
            for linear in linears:
                kind, slots = weight_slots(linear.weight, linear.bias, None, int8)
                kinds.append(kind)
                tensors += slots
        kind, slots = weight_slots(weight, None, blocks, int8)
        kinds.append(kind)
        tensors += slots
        dims = [heads.num_heads, heads.num_layers, heads.hidden_size, heads.vocab_size, weight.shape[0]]
        dims.append(int(heads.sequential))
        # every weight it reads per level, side by side on 2 MB pages (a level reads them straight after the
        # target's step has streamed ~100 MB through the caches); the embedding's rows are read one by one
        self.int8 = int8
        if not int8:  # (int8: the native heads repack every weight into an arena of their own)
            tensors = on_huge_pages(tensors, {table.data_ptr()} if table.numel() else set())
        self._native = torch.classes.treespec.NativeHeads(dims, tensors, kinds, int8)
        shared = {t.data_ptr() for t in (*heads.parameters(), *heads.buffers(), table)}
        kept = [  # the copies it holds (int8: the blocks were repacked into its arena, then let go)
            t for t in tensors if t.numel() and t.data_ptr() not in shared and not (int8 and t.dim() == 2)
        ]
        self.own_bytes = self._native.own_bytes() + sum(t.numel() * t.element_size() for t in kept)

    def __call__(
        self, hidden: torch.Tensor, roots: torch.Tensor, plan: torch.Tensor, depth: int | None = None
    ):
        """hidden [B, H], roots [B], plan (`level_plan`), depth: levels to draft (None: all) -> tokens [B, N]
        int64, probs [B, N] float32 (undrafted nodes: the root's token, probability 0)."""
        return self._native.propose(hidden, roots, plan, -1 if depth is None else depth)

    def head_topk(self, hidden: torch.Tensor, count: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Independent heads: hidden [B, H] -> the k most probable draft tokens of heads 0..count-1 and their
        probabilities, tokens [B, count, k] int64 and probs [B, count, k] float32."""
        return self._native.head_topk(hidden, count, k)


@torch.no_grad()
def int8_reference(
    heads: MedusaHeads,
    tree: Tree,
    weight: torch.Tensor,
    blocks,
    embedding: torch.Tensor,
    hidden: torch.Tensor,
    roots: torch.Tensor,
    depth: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """What `NativeHeads(..., int8=True)` drafts, level by level in Python over the int8 kernels' scalar
    engine (`torch.ops.treespec.int8_linear`, engine 1): the reference its tests compare with. Same
    arguments as `NativeHeads.of` and its call (the tree instead of its plan) -> tokens, probs [B, N]."""

    def linear(x, w, bias, found=None):  # x [M, K] through w's Q8_0 blocks (or its exact `found` ones)
        if found is None:
            q, d = q8_blocks(w)
            m = None
        else:
            q, d, m = found.q, found.d.half(), None if found.m is None else found.m.half()
        return torch.ops.treespec.int8_linear(x.float().contiguous(), q, d, m, bias, 1)

    B, n, H = hidden.shape[0], tree.num_nodes, heads.hidden_size
    tokens = roots.long()[:, None].repeat(1, n)  # [B, N]
    probs = torch.zeros(B, n)
    probs[:, 0] = 1.0
    states = torch.zeros(B, n, H)
    levels = tree.levels() if depth is None else tree.levels()[: max(depth, 0)]
    for d, (expanded, parents, children, row, rank, k) in enumerate(levels):
        before = hidden.float()[:, None].expand(B, len(expanded), H) if d == 0 else states[:, parents]
        emb = embedding[tokens[:, expanded]].float()  # [B, n_d, H]
        proj = linear(emb.reshape(-1, H), heads.token_proj[d].weight, None)
        u = before.reshape(-1, H) + proj  # [B * n_d, H]
        for block in heads.blocks[d]:
            u = u + torch.nn.functional.silu(linear(u, block.linear.weight, block.linear.bias.float()))
        states[:, expanded] = u.reshape(B, -1, H)
        logits = linear(u, weight, None, blocks).reshape(B, len(expanded), -1)  # [B, n_d, V']
        top = logits.softmax(dim=-1).topk(k, dim=-1)
        tokens[:, children] = heads.token_ids(top.indices[:, row, rank])
        probs[:, children] = top.values[:, row, rank]
    return tokens, probs
