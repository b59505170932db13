"""Tree attention, plugged into transformers through its AttentionInterface.

One forward over n new tokens sees keys [0, L) with L = c + n: the committed prefix [0, c) is
visible to every new token; inside the new block [c, L) token i sees token j only where
`tree_mask[i, j]` (j is i or one of its ancestors). With no tree mask the block is causal (a chain),
which covers prefill (c = 0), chunked prefill and one-token decoding (n = 1) with the same code.

The per-call state travels as the `tree_attention=` keyword of the model's forward, an `AttentionPlan`
(kernel, tree mask, its packed bits), built once per tree (FlashInfer's plan/run split: host metadata once
per step, the kernel per layer). transformers passes unknown keywords down to the attention function, so
no state is hung on the HF modules and two decoders on one model never see each other's settings.

- `tree_attention_reference`: explicit matmul + softmax in float32; the oracle every faster path is
  tested against.
- `tree_attention_sdpa`: torch's scaled_dot_product_attention with a boolean [n, L] mask; the
  fast path in plain torch.
- `tree_attention_compiled`: the compiled kernels of csrc/ (treespec.ops; built on first use): K/V read
  in place from the cache, GQA heads never expanded, the tree mask as packed ancestor bits, the output
  written directly in the [B, n, H, D] layout transformers wants. Causal prefill from an empty cache
  stays on SDPA (or flash-attn on CUDA when it is installed); inputs the kernels do not take, or a
  failed build, fall back to SDPA with a warning.
- `tree_attention_exact`: the row-invariant kernel of csrc/exact_attention_cpu.cpp ("bitwise" numerics):
  a node's output has the bits a one-token step at the same position gets, whatever the tree or batch.
  Causal prefill from an empty cache stays on SDPA (plain and speculative decoding share the prefill).
- `attention_with_terms`: what some architectures add to softmax attention, passed by transformers as
  keywords (`ScoreTerms`: Gemma 2's score soft-capping, gpt-oss's sinks, a sliding window once a query
  is past it): explicit matmul + softmax in float32, as transformers' eager attention computes them (a
  window alone: SDPA with it in the mask).

A model whose decoder layers do not pass keywords on to their attention (Falcon) still gets the plan: the
decoder runs each forward inside `attention_forward(plan)`, which also counts the attention calls, so a
model that computes attention without this interface is found out (`core.support`).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from .. import ops
from .runtime import TargetRuntime
from .tree import Tree, pack_bits

ATTN_IMPLEMENTATION = "treespec"


@dataclass(frozen=True, eq=False)
class AttentionPlan:
    """What one forward's attention needs besides q/k/v: the kernel and the visibility of the new block.

    mask: [n, n] bool (node i sees node j) or None for a causal block (prefill, a chain, one token);
    bits: the same mask packed as [n, ceil(n / 64)] int64 words (the compiled kernel reads these).
    rows, prefix_lens: int64 [A] CPU tensors for a forward over some rows of a batch whose rows have
    their own committed lengths (`TreeKVCache`): query row a is cache row rows[a] and sees that row's
    keys [0, prefix_lens[a] + n) only. None: every row's prefix is L - n (one sequence).
    depth: the tree's largest node depth (None: read off the mask when needed).
    """

    kernel: str = "sdpa"
    mask: torch.Tensor | None = None
    bits: torch.Tensor | None = None
    rows: torch.Tensor | None = None
    prefix_lens: torch.Tensor | None = None
    depth: int | None = None

    def deepest(self, n: int) -> int:
        """The largest depth among the block's n tokens (a causal block: its last token's index)."""
        if self.mask is None:
            return n - 1
        return self.depth if self.depth is not None else int(self.mask.sum(1).max()) - 1

    @classmethod
    def for_tree(cls, tree: Tree | None, kernel: str, device) -> AttentionPlan:
        """The plan of a forward over `tree`'s nodes (None or a root-only tree: causal)."""
        if kernel not in KERNELS:
            raise ValueError(f"unknown attention kernel {kernel!r}; choose one of {sorted(KERNELS)}")
        if tree is None or tree.num_nodes == 1:
            return cls(kernel)
        return cls(kernel, tree.ancestor_mask.to(device), tree.ancestor_bits.to(device), depth=tree.max_depth)


def block_mask(tree_mask: torch.Tensor | None, n: int, kv_len: int, device) -> torch.Tensor:
    """Boolean [n, kv_len] visibility of n new tokens over keys [0, kv_len): prefix + tree block."""
    if tree_mask is None:
        tree_mask = torch.ones(n, n, dtype=torch.bool, device=device).tril_()  # a chain: causal
    prefix = torch.ones(n, kv_len - n, dtype=torch.bool, device=device)
    return torch.cat([prefix, tree_mask.to(device)], dim=1)  # [n, L]


@dataclass(frozen=True, eq=False)
class ScoreTerms:
    """What an architecture adds to softmax attention (transformers passes each as a keyword):

    softcap: scores -> softcap * tanh(scores / softcap) before the mask (Gemma 2's `softcap`);
    sinks: [H] one more logit per query head in the softmax's denominator, with no value (gpt-oss's `s_aux`);
    window: a query at position p sees keys at positions j with p - j < window (`sliding_window` layers).
    """

    softcap: float | None = None
    sinks: torch.Tensor | None = None
    window: int | None = None

    @classmethod
    def of(cls, keywords: dict) -> ScoreTerms | None:
        """The terms among an attention call's keywords; None when it has none."""
        softcap, sinks, window = (
            keywords.get("softcap"),
            keywords.get("s_aux"),
            keywords.get("sliding_window"),
        )
        if not softcap and sinks is None and not window:
            return None
        return cls(softcap or None, sinks, window or None)

    def needed(self, last_position: int) -> bool:
        """Whether these terms change anything for queries up to `last_position` (a window only matters
        once a query is `window` positions past the first key)."""
        return bool(self.softcap) or self.sinks is not None or last_position >= (self.window or 1 << 62)


def block_positions(tree_mask: torch.Tensor | None, n: int, kv_len: int, device) -> torch.Tensor:
    """Positions of keys [0, kv_len) whose last n are the new block (a tree's nodes at the committed length
    plus their depth, a chain's tokens one after another): int64 [kv_len]."""
    depth = torch.arange(n, device=device) if tree_mask is None else tree_mask.to(device).sum(1) - 1  # [n]
    return torch.cat([torch.arange(kv_len - n, device=device), kv_len - n + depth])


def attention_with_terms(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    tree_mask: torch.Tensor | None,
    scaling: float,
    terms: ScoreTerms,
) -> torch.Tensor:
    """Tree attention with an architecture's `ScoreTerms` (the contract of `tree_attention_reference`):
    query [B, H, n, D], key/value [B, Hkv, L, D] -> [B, H, n, D]. A window alone runs as SDPA with the
    window in its mask; soft-capping or sinks as explicit matmul + softmax in float32 (float64 models:
    float64)."""
    B, H, n, D = query.shape
    Hkv, L = key.shape[1], key.shape[2]
    G = H // Hkv
    visible = block_mask(tree_mask, n, L, query.device)  # [n, L]
    if terms.window is not None:
        positions = block_positions(tree_mask, n, L, query.device)  # [L]
        visible = visible & (positions[-n:, None] - positions[None, :] < terms.window)
    if not terms.softcap and terms.sinks is None:  # a window alone: SDPA with the mask
        return F.scaled_dot_product_attention(
            query, key, value, attn_mask=visible, scale=scaling, enable_gqa=G > 1
        )
    wide = torch.promote_types(query.dtype, torch.float32)  # float32, or float64 for float64 models
    q = query.to(wide).reshape(B, Hkv, G * n, D)  # query heads of one KV group side by side
    scores = q @ key.to(wide).transpose(-1, -2) * scaling  # [B, Hkv, G*n, L]
    if terms.softcap:
        scores = torch.tanh(scores / terms.softcap) * terms.softcap
    scores = scores.masked_fill(~visible.repeat(G, 1), float("-inf"))
    if terms.sinks is not None:  # head h = kv head h // G, group member h % G
        sinks = (
            terms.sinks.to(wide).reshape(1, Hkv, G, 1, 1).expand(B, Hkv, G, n, 1).reshape(B, Hkv, G * n, 1)
        )
        probs = torch.softmax(torch.cat([scores, sinks], dim=-1), dim=-1)[..., :-1]  # [B, Hkv, G*n, L]
    else:
        probs = torch.softmax(scores, dim=-1)  # [B, Hkv, G*n, L]
    out = probs @ value.to(wide)  # [B, Hkv, G*n, D]
    return out.reshape(B, H, n, D).to(query.dtype)


def tree_attention_reference(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    tree_mask: torch.Tensor | None,
    scaling: float,
) -> torch.Tensor:
    """Reference tree attention.

    query: [B, H, n, D]; key, value: [B, Hkv, L, D] with H a multiple of Hkv (GQA, not expanded);
    tree_mask: [n, n] bool or None (causal). Returns [B, H, n, D] in query's dtype.
    """
    B, H, n, D = query.shape
    Hkv, L = key.shape[1], key.shape[2]
    G = H // Hkv
    q = query.float().reshape(B, Hkv, G * n, D)  # query heads of one KV group side by side
    scores = q @ key.float().transpose(-1, -2) * scaling  # [B, Hkv, G*n, L]
    visible = block_mask(tree_mask, n, L, query.device).repeat(G, 1)  # [G*n, L]
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1)  # [B, Hkv, G*n, L]
    out = probs @ value.float()  # [B, Hkv, G*n, D]
    return out.reshape(B, H, n, D).to(query.dtype)


def tree_attention_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    tree_mask: torch.Tensor | None,
    scaling: float,
) -> torch.Tensor:
    """Same contract as `tree_attention_reference`, through torch SDPA (GQA handled by SDPA)."""
    n, L = query.shape[2], key.shape[2]
    gqa = query.shape[1] != key.shape[1]
    if n == 1 or (tree_mask is None and n == L):
        # decode (sees everything) or prefill from an empty cache (plain causal): no mask needed
        return F.scaled_dot_product_attention(
            query, key, value, is_causal=n > 1, scale=scaling, enable_gqa=gqa
        )
    mask = block_mask(tree_mask, n, L, query.device)  # [n, L]
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling, enable_gqa=gqa)


def _causal_prefill(query, key, value, scaling):
    """Plain causal attention over a block that starts at position 0: flash-attn (CUDA) or SDPA."""
    if query.is_cuda and query.dtype in (torch.float16, torch.bfloat16):
        try:
            from flash_attn import flash_attn_func
        except ImportError:
            flash_attn_func = None
        if flash_attn_func is not None and query.shape[-1] <= 256:
            # flash-attn takes [B, L, H, D] with any strides but the last, and returns [B, n, H, D]
            q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
            out = flash_attn_func(q, k, v, softmax_scale=scaling, causal=True)
            return out.transpose(1, 2)
    return tree_attention_sdpa(query, key, value, None, scaling)


def tree_attention_compiled(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    tree_mask: torch.Tensor | None,
    scaling: float,
    bits: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same contract as `tree_attention_reference`, through the compiled op of treespec.ops.
    bits: `tree_mask` packed (`Tree.ancestor_bits`); packed here when not given.

    Returns [B, H, n, D] as a transposed view of the op's contiguous [B, n, H, D] output, so
    `treespec_attention` hands that buffer to transformers without a copy.
    """
    n, L = query.shape[2], key.shape[2]
    # prefill from an empty cache: off the CPU flash-attn or SDPA; on the CPU the op below, whose query tiles
    # keep every thread busy (SDPA took 1.18-1.34x its time per layer at 256-4000 tokens on the Zen 4 EPYC)
    if tree_mask is None and n == L and n > 1 and query.device.type != "cpu":
        return _causal_prefill(query, key, value, scaling)
    reason = ops.unsupported_reason(query, key)
    if reason is None and not ops.available(query.device):
        if not ops.build_info()["ok"]:  # ops.load warned once, with the cause
            return tree_attention_sdpa(query, key, value, tree_mask, scaling)
        reason = f"{query.device.type} tensors (the extension was built without {query.device.type} support)"
    if reason is not None:
        # warnings' default filter shows each distinct reason once
        warnings.warn(
            f"treespec: the compiled tree attention does not take {reason}; using SDPA for these calls",
            RuntimeWarning,
            stacklevel=2,
        )
        return tree_attention_sdpa(query, key, value, tree_mask, scaling)
    if tree_mask is not None and bits is None:
        bits = pack_bits(tree_mask.cpu()).to(tree_mask.device)
    out = torch.ops.treespec.tree_attention(query, key, value, bits, float(scaling))  # [B, n, H, D]
    return out.transpose(1, 2)


def tree_attention_exact(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    tree_mask: torch.Tensor | None,
    scaling: float,
    bits: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same contract as `tree_attention_compiled`, through the row-invariant op (CPU, float32/bfloat16; K/V
    may be bf16 under float32 queries, widened exactly as the op reads them)."""
    n, L = query.shape[2], key.shape[2]
    if tree_mask is None and n == L and n > 1:  # prefill from an empty cache
        return tree_attention_sdpa(query, key.to(query.dtype), value.to(query.dtype), None, scaling)
    require_exact_ops(query)
    if tree_mask is not None and bits is None:
        bits = pack_bits(tree_mask.cpu())
    out = torch.ops.treespec.tree_attention_exact(query, key, value, bits, float(scaling))  # [B, n, H, D]
    return out.transpose(1, 2)


def require_exact_ops(tensor: torch.Tensor) -> None:
    """Refuse what the row-invariant kernels do not take, saying what to do instead."""
    if tensor.device.type != "cpu" or tensor.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(
            f'numerics="bitwise" runs on CPU tensors in float32 or bfloat16, not {tensor.device.type} '
            f'{tensor.dtype}; use numerics="fast" there'
        )
    if not ops.available("cpu"):
        raise ops.ExtensionUnavailable(
            'numerics="bitwise" needs treespec\'s compiled CPU ops, which did not build here '
            f'({ops.build_info()["error"]}); install a C++ compiler and ninja, or use numerics="fast"'
        )


KERNELS = {
    "reference": tree_attention_reference,
    "sdpa": tree_attention_sdpa,
    "compiled": tree_attention_compiled,
    "exact": tree_attention_exact,
}


def auto_kernel(device: torch.device, dtype: torch.dtype) -> str:
    """What kernel="auto" means for a model on `device` in `dtype`: on the CPU "compiled" when treespec's
    extension builds and takes the dtype, else "sdpa". On CUDA "sdpa": the CUDA kernel is correct but
    slower than torch SDPA with a dense mask on most shapes measured on an H200 (docs/kernels.md), so it
    runs only when asked for (kernel="compiled")."""
    device = torch.device(device)
    if device.type != "cpu":
        return "sdpa"
    return "compiled" if ops.dtype_supported(device, dtype) and ops.available(device) else "sdpa"


@dataclass(eq=False)
class ForwardRecord:
    """One forward's attention: the plan its layers follow, and how many attention calls it made."""

    plan: AttentionPlan
    calls: int = 0
    planless: int = 0  # calls that came without the plan keyword (the layers did not pass it on)
    windowed: int = 0  # calls that named a sliding window


_FORWARD: ContextVar[ForwardRecord | None] = ContextVar("treespec_forward", default=None)


@contextlib.contextmanager
def attention_forward(plan: AttentionPlan) -> Iterator[ForwardRecord]:
    """Run one forward of the model under `plan`: attention calls that arrive without the plan (decoder
    layers that do not pass keywords on) take it from here, and the record counts every call."""
    record = ForwardRecord(plan)
    token = _FORWARD.set(record)
    try:
        yield record
    finally:
        _FORWARD.reset(token)


def treespec_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    tree_attention: AttentionPlan | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The function registered as attn_implementation "treespec".

    transformers calls it with q [B, H, n, D], k/v [B, Hkv, L, D] and expects [B, n, H, D]. It builds
    no HF mask for this implementation: visibility comes from the `tree_attention` plan only (no plan:
    a causal block through SDPA), so padded batches are not supported here. kwargs: the architecture's
    `ScoreTerms` (softcap, s_aux, sliding_window) are followed; others (position_ids, ...) change nothing.
    """
    if attention_mask is not None:
        raise ValueError(
            f"{type(module).__name__} passes an attention mask of its own to its attention function, which "
            "treespec's tree attention cannot follow: this architecture is not supported"
        )
    record = None if torch.compiler.is_compiling() else _FORWARD.get()
    if record is not None:
        record.calls += 1
        record.planless += tree_attention is None
        tree_attention = tree_attention or record.plan
    plan = tree_attention or AttentionPlan()
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    if key.dtype != query.dtype and plan.kernel != "exact":  # bf16 K/V under float32 queries: widened
        key, value = key.to(query.dtype), value.to(query.dtype)  # (the row-invariant op reads them as is)
    terms = ScoreTerms.of(kwargs)
    if terms is None:
        return _plan_attention(query, key, value, plan, scaling), None
    if record is not None and terms.window is not None:
        record.windowed += 1
    return _attention_with_terms(query, key, value, plan, scaling, terms), None


def _plan_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, plan: AttentionPlan, scaling: float
) -> torch.Tensor:
    """Tree attention through the plan's kernel: query [A, H, n, D] over key/value [B, Hkv, L, D] (A = B
    without per-row lengths) -> [A, n, H, D]."""
    if plan.rows is not None:
        return _rows_attention(query, key, value, plan, scaling)
    if plan.kernel in ("compiled", "exact"):
        out = KERNELS[plan.kernel](query, key, value, plan.mask, scaling, plan.bits)  # [B, H, n, D]
    else:
        out = KERNELS[plan.kernel](query, key, value, plan.mask, scaling)  # [B, H, n, D]
    return out.transpose(1, 2).contiguous()  # no copy for "compiled": already [B, n, H, D]


def _rows_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, plan: AttentionPlan, scaling: float
) -> torch.Tensor:
    """Rows with their own committed lengths: query [A, H, n, D] over the cache's key/value [B, Hkv, L, D];
    query row a reads cache row plan.rows[a], keys [0, plan.prefix_lens[a] + n). The compiled kernel
    takes the per-row lengths itself (`ops.tree_attention_rows`); otherwise the plan's kernel runs row by
    row on views (no K/V copy). Returns [A, n, H, D]."""
    n = query.shape[2]
    if (
        plan.kernel == "compiled"
        and (plan.mask is not None or n == 1)  # a prompt's causal prefill stays on SDPA / flash-attn
        and ops.unsupported_reason(query, key) is None
        and ops.available(query.device)
    ):
        scores = torch.ops.treespec.tree_attention_rows  # [A, n, H, D]
        return scores(query, key, value, plan.bits, float(scaling), plan.rows, plan.prefix_lens)
    if plan.kernel == "exact" and (plan.mask is not None or n == 1):
        require_exact_ops(query)
        scores = torch.ops.treespec.tree_attention_exact_rows  # [A, n, H, D]
        return scores(query, key, value, plan.bits, float(scaling), plan.rows, plan.prefix_lens)
    one_row = AttentionPlan(plan.kernel, plan.mask, plan.bits)
    outs = []
    for a, (row, c) in enumerate(zip(plan.rows.tolist(), plan.prefix_lens.tolist(), strict=True)):
        k, v = key[row : row + 1, :, : c + n], value[row : row + 1, :, : c + n]  # [1, Hkv, c + n, D]
        outs.append(_plan_attention(query[a : a + 1], k, v, one_row, scaling))  # [1, n, H, D]
    return outs[0] if len(outs) == 1 else torch.cat(outs)  # [A, n, H, D]


def _attention_with_terms(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, plan: AttentionPlan, scaling: float, terms
) -> torch.Tensor:
    """A forward whose attention has `ScoreTerms`: the terms where they change anything (row by row for rows
    with their own committed lengths), else the plan's kernel. Returns [A, n, H, D]."""
    n = query.shape[2]
    starts = [key.shape[2] - n] if plan.rows is None else plan.prefix_lens.tolist()
    if not any(terms.needed(c + plan.deepest(n)) for c in starts):
        return _plan_attention(query, key, value, plan, scaling)
    if plan.kernel == "exact":
        raise ValueError(
            'numerics="bitwise" has no row-invariant kernel for attention with soft-capped scores, sinks or '
            'a sliding window a sequence has passed; use numerics="fast" for this model'
        )
    if plan.rows is None:  # every row from one start
        return _terms_from_one_start(query, key, value, plan, scaling, terms)
    one_row = AttentionPlan(plan.kernel, plan.mask, plan.bits, depth=plan.depth)
    outs = []
    for a, (row, c) in enumerate(zip(plan.rows.tolist(), starts, strict=True)):
        k, v = key[row : row + 1, :, : c + n], value[row : row + 1, :, : c + n]  # [1, Hkv, c + n, D]
        outs.append(_terms_from_one_start(query[a : a + 1], k, v, one_row, scaling, terms))  # [1, n, H, D]
    return torch.cat(outs)  # [A, n, H, D]


def _terms_from_one_start(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, plan: AttentionPlan, scaling: float, terms
) -> torch.Tensor:
    """query [B, H, n, D] over key/value [B, Hkv, L, D] whose last n keys are the block -> [B, n, H, D]. The
    keys before every query's window are left out first (the root's window starts at L - n - window + 1), so
    a step past the window reads the window only; one query with a window alone then takes the plan's
    kernel over exactly its window's keys."""
    n, L = query.shape[2], key.shape[2]
    first = 0 if terms.window is None else max(0, L - n - terms.window + 1)
    key, value = key[:, :, first:], value[:, :, first:]  # [B, Hkv, L - first, D] views
    if n == 1 and not terms.softcap and terms.sinks is None:
        return _plan_attention(query, key, value, plan, scaling)
    out = attention_with_terms(query, key, value, plan.mask, scaling, terms)  # [B, H, n, D]
    return out.transpose(1, 2).contiguous()


AttentionInterface.register(ATTN_IMPLEMENTATION, treespec_attention)


@contextlib.contextmanager
def tree_attention_enabled(model) -> Iterator[None]:
    """Run `model` with treespec attention inside the block. Counted in the model's `TargetRuntime`:
    nested or overlapping users (two decoders on one model) keep it on until the last one leaves, and
    the model's previous implementation comes back then."""
    runtime = TargetRuntime.of(model)
    with runtime.lock:
        if runtime.attention_users == 0:
            runtime.attention_before = model.config._attn_implementation
            if runtime.attention_before != ATTN_IMPLEMENTATION:
                model.set_attn_implementation(ATTN_IMPLEMENTATION)
        runtime.attention_users += 1
    try:
        yield
    finally:
        with runtime.lock:
            runtime.attention_users -= 1
            if runtime.attention_users == 0 and runtime.attention_before != ATTN_IMPLEMENTATION:
                model.set_attn_implementation(runtime.attention_before)
