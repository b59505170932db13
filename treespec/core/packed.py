"""Fast linear layers for the CPU: every `nn.Linear` of a model (lm_head included), switched per block.

Two fast forms, chosen per weight (`mode="auto"`):

- **exact blocks** (`core.blocks`): a float32 weight whose values are exactly Q4_1 / Q8_0 blocks (a model
  converted from a quantized checkpoint, like the embedded SmolLM2) is read in that form by treespec's
  `block_linear` op: the same weights bit for bit, 0.6-1.1 bytes per weight instead of 4.
- **oneDNN prepacked**: the weight reordered once into oneDNN's blocked layout
  (`torch.ops.mkldnn._reorder_linear_weight`, then `_linear_pointwise`, what inductor's `freezing`
  emits), faster than `F.linear` at every row count measured
  (benchmarks/log/2026-12-01-b-fast-linear-layers.md).

- **one row of bfloat16 on a CPU without AMX** (a plain decoding step): treespec's `exact_linear` op, which
  beats oneDNN's bf16 GEMM at one row there (a SmolLM2 step: 24 against 31-38 ms on AVX-512 BF16 without
  AMX, benchmarks/log/2026-12-03-d-drafters-data-bf16-step.md); oneDNN keeps every larger row count, and
  AMX CPUs keep oneDNN.
- **one row of a float32 weight whose values are all bfloat16 values** (a bf16 checkpoint loaded in float32,
  like the shipped heads): `exact_linear` over its bfloat16 copy (`core.blocks.exact_bf16`, made on the
  first such call), the same values at 2 bytes per weight instead of 4 (a 576 x 576 weight at one row: 28
  against oneDNN's 76 us on a 2-core AVX2 EPYC); more rows keep oneDNN.

`mode="onednn"` skips the block search, `mode="torch"` (or `enabled=False`) leaves the model as it is.
Results equal `F.linear` to float rounding (summation order), not bitwise.

`mode="exact"` ("bitwise" numerics) makes every linear row-invariant: a row's output bits never depend on
how many rows share the call. Block weights stay on the block kernel at every row count (it sums each row
in one fixed order); other float32 / bfloat16 weights go through treespec's `exact_linear` op.

`packed_linears(model)` switches a model to the fast path inside a `with` block and back after it,
counted per model like `tree_attention_enabled` (in the model's `TargetRuntime`), so HF's own `generate`
on the same model object outside the block runs stock. The fast weights are built on first use (a
one-time cost of seconds, memory beside the model's own weights, `TargetRuntime.memory_bytes`) and
rebuilt when a weight tensor changes (its storage or version), so a model trained between two uses
never runs on stale weights.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from .. import ops
from .blocks import BlockMatrix, exact_bf16, gather_on_huge_pages, recover_blocks
from .runtime import TargetRuntime

MODES = ("auto", "onednn", "torch", "exact")
# rows up to which the block kernel beats a GEMM on the same weight (measured on SmolLM2's linears:
# benchmarks/log/2026-12-02-b-session10-batches-onednn.md). Above this count a block weight multiplies
# through a oneDNN copy of its float32 values, built on first use.
BLOCK_ROWS_MAX = 24


def packing_supported(model) -> bool:
    """Whether `packed_linears` can speed this model up: CPU weights in float32 (or bfloat16 where oneDNN
    has bf16 instructions), and oneDNN in this torch build."""
    return _supported(next(model.parameters()))


def _supported(tensor: torch.Tensor) -> bool:
    if tensor.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if tensor.dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return tensor.dtype == torch.float32


@functools.cache
def cpu_has_amx() -> bool:
    """Whether this CPU has AMX tiles (bf16 matrix products much faster than on AVX-512 alone)."""
    return bool(torch.cpu._is_amx_tile_supported())


def one_row_exact(weight: torch.Tensor) -> bool:
    """Whether mode "auto" multiplies one row of `weight` with `exact_linear` (bfloat16 CPU weights, no
    AMX, treespec's ops built): faster there than oneDNN's bf16 GEMM at one row."""
    return (
        weight.dtype == torch.bfloat16
        and weight.device.type == "cpu"
        and ops.available("cpu")
        and not cpu_has_amx()
    )


def _blocks_of(weight: torch.Tensor):
    """The exact blocks of `weight` when treespec's compiled ops are there to read them, else None."""
    if weight.dtype != torch.float32 or weight.device.type != "cpu" or not ops.available("cpu"):
        return None
    blocks = recover_blocks(weight)
    return None if blocks is None else BlockMatrix(blocks)


class PackedMatrix:
    """x @ weight.T (+ bias) for a fixed weight [out, in]: exact blocks (mode "auto", when the weight has
    them), else oneDNN prepacked, else `F.linear`. The weight must not change afterwards."""

    def __init__(self, weight: torch.Tensor, mode: str = "auto"):
        if mode not in MODES:
            raise ValueError(f"unknown linear mode {mode!r}; choose one of {MODES}")
        self.weight = weight  # [out, in]
        self.exact = mode == "exact"
        self.blocks = _blocks_of(weight) if mode in ("auto", "exact") else None
        self.packed = None  # block weights: built on the first call with more than BLOCK_ROWS_MAX rows
        self.packable = mode != "torch" and _supported(weight)
        self.exact_one_row = mode == "auto" and one_row_exact(weight)
        # float32 weights of bfloat16 values: their bfloat16 copy, found on the first one-row call (None: not
        # looked for yet, False: not such a weight or not wanted)
        self.bf16_weight: torch.Tensor | bool | None = None if mode in ("auto", "exact") else False
        if self.blocks is None and self.packable and not self.exact:  # exact: packed on a shared forward
            self.pack()

    def pack(self) -> torch.Tensor:
        """The weight reordered into oneDNN's blocked layout (once; a float32 copy beside the weight)."""
        if self.packed is None:
            with torch.no_grad():
                self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach())
        return self.packed

    def memory_bytes(self) -> int:
        """Bytes of the fast copies beside the weight itself (blocks, the oneDNN reorder)."""
        held = (
            [] if self.blocks is None else [self.blocks.blocks.q, self.blocks.blocks.d, self.blocks.blocks.m]
        )
        held += [] if self.packed is None else [self.packed]
        held += [self.bf16_weight] if isinstance(self.bf16_weight, torch.Tensor) else []
        return sum(t.numel() * t.element_size() for t in held if t is not None)  # Q8_0 blocks have no m

    @property
    def kind(self) -> str:
        """ "blocks-q4_1", "blocks-q8_0", "onednn" or "torch": how this matrix multiplies."""
        if self.blocks is not None:
            return f"blocks-{self.blocks.blocks.kind}"
        if self.exact:
            return "exact"
        return "onednn" if self.packed is not None else "torch"

    def bf16_copy(self) -> torch.Tensor | None:
        """The bfloat16 copy of a float32 weight of bfloat16 values (made once), else None."""
        if self.bf16_weight is None:
            usable = self.blocks is None and self.weight.device.type == "cpu" and ops.available("cpu")
            copy = exact_bf16(self.weight) if usable else None
            self.bf16_weight = False if copy is None else copy
        return self.bf16_weight if isinstance(self.bf16_weight, torch.Tensor) else None

    def _bf16_copy(self) -> torch.Tensor | None:
        """`bf16_copy()` in eager calls; None in a graph torch.compile traces (looking for the copy there
        would change state the graph is guarded on, and compile it again on the next call)."""
        return None if torch.compiler.is_compiling() else self.bf16_copy()

    def __call__(
        self, x: torch.Tensor, bias: torch.Tensor | None = None, shared: bool = False
    ) -> torch.Tensor:
        """x: [..., in] -> [..., out]. shared: a forward plain and speculative decoding share as it is (a
        prefill): the fastest form even in mode "exact"."""
        if x.dtype != self.weight.dtype or torch.is_grad_enabled() or x.device.type != "cpu":
            return F.linear(x.to(self.weight.dtype), self.weight, bias)
        return self._exact(x, bias) if self.exact and not shared else self.fastest(x, bias)

    def fastest(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """The fastest form at x's row count ("auto"; x: float CPU, no autograd)."""
        if self.blocks is not None and x.numel() <= BLOCK_ROWS_MAX * x.shape[-1]:
            return self.blocks(x, bias)
        if x.numel() == x.shape[-1] and (self.exact_one_row or self._bf16_copy() is not None):
            return self._exact(x, bias)  # one row: a plain decoding step
        # many rows (prefill, a batch of trees): a GEMM over the float32 weight is faster than the blocks;
        # inductor lowers the oneDNN op only for weights it froze itself: compiled graphs get F.linear
        if self.packable and not torch.compiler.is_compiling():
            return torch.ops.mkldnn._linear_pointwise(x, self.pack(), bias, "none", [], "")
        return F.linear(x, self.weight, bias)

    def _exact(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """The row-invariant product: fp32 sums in one order per row, rounded once to x's dtype."""
        if self.blocks is not None:
            return self.blocks(x, bias)
        half = self._bf16_copy()  # the same values, so the same bits out, from half the bytes
        out = torch.ops.treespec.exact_linear(x.float(), self.weight if half is None else half)  # [..., out]
        if bias is not None:
            out = out + bias.float()
        return out.to(x.dtype)


def weight_key(w: torch.Tensor) -> tuple:
    """What identifies a weight's values for a packed copy: storage, in-place version, shape and dtype
    (a copy built from a weight whose key is unchanged is still its copy). An inference tensor (a model
    made under `torch.inference_mode`) has no version counter: its storage stands for it."""
    version = None if w.is_inference() else w._version
    return (w.data_ptr(), version, tuple(w.shape), w.dtype)


def weights_key(module: torch.nn.Module) -> tuple:
    """`weight_key` of every parameter of `module`: what was computed from its weights is still valid while
    this is unchanged."""
    return tuple(weight_key(p) for p in module.parameters())


class _PackedLinear:
    """The replacement forward of one `nn.Linear`: its weight as a `PackedMatrix`, rebuilt when the
    weight changed; inputs the fast forms do not take (autograd, other dtypes) go to `F.linear`."""

    def __init__(self, module: torch.nn.Linear, mode: str, owner: _ModelPacking):
        self.module, self.mode, self.owner = module, mode, owner
        self.matrix: PackedMatrix | None = None
        self.key: tuple | None = None
        self.refresh()

    def refresh(self) -> None:
        """Re-pack when the weight changed since the last packing (`weight_key`)."""
        w = self.module.weight
        key = weight_key(w)
        if key != self.key:
            self.matrix = PackedMatrix(w, self.mode)
            self.key = key

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., in_features] -> [..., out_features]
        return self.matrix(x, self.module.bias, shared=self.owner.shared > 0)


class _ModelPacking:
    def __init__(self, model, mode: str):
        self.mode = mode
        self.linears = [
            _PackedLinear(m, mode, self) for m in model.modules() if isinstance(m, torch.nn.Linear)
        ]
        # every step streams the blocks: all of them side by side on 2 MB pages (a weight changed later
        # gets its new blocks where torch allocates them)
        gather_on_huge_pages([b.matrix.blocks.blocks for b in self.linears if b.matrix.blocks is not None])
        self.users = 0
        self.shared = 0  # > 0 inside `shared_forward`: an "exact" packing multiplies as "auto" does

    def memory_bytes(self) -> int:
        return sum(linear.matrix.memory_bytes() for linear in self.linears)

    def kinds(self) -> dict[str, int]:
        """How many linears run in each form ("blocks-q4_1": 210, ...)."""
        counts: dict[str, int] = {}
        for linear in self.linears:
            counts[linear.matrix.kind] = counts.get(linear.matrix.kind, 0) + 1
        return counts


@contextlib.contextmanager
def packed_linears(model, enabled: bool = True, mode: str = "auto") -> Iterator[None]:
    """Run every `nn.Linear` of `model` on its fast form (`mode`: "auto", "onednn") inside the block; a
    no-op when `enabled` is False, mode is "torch" or `packing_supported(model)` is not. One packing per
    model at a time: another mode than the current one's is refused while the first is in use; a packing
    built for another mode is kept (in the model's `TargetRuntime`) for when that mode comes back."""
    if mode not in MODES:
        raise ValueError(f"unknown linear mode {mode!r}; choose one of {MODES}")
    if not enabled or mode == "torch" or (mode != "exact" and not packing_supported(model)):
        yield
        return
    runtime = TargetRuntime.of(model)  # the packing lives in the model's runtime
    with runtime.lock:
        packing = runtime.packing
        if packing is not None and packing.mode != mode:
            if packing.users:
                raise RuntimeError(f"the model's linears are in use in mode {packing.mode!r}, not {mode!r}")
            runtime.other_packings[packing.mode] = packing  # kept: switching back costs nothing
            packing = runtime.packing = runtime.other_packings.pop(mode, None)
        new = packing is None
        if new:
            started = time.perf_counter()
            packing = runtime.packing = _ModelPacking(model, mode)
        if packing.users == 0:
            for linear in packing.linears:
                linear.refresh()
                # an instance attribute (nn.Module.__call__ uses it), set in the instance's dict directly:
                # nn.Module.__setattr__'s checks cost more than the rest of entering the block
                linear.module.__dict__["forward"] = linear
        if new:  # the first packing of this mode: its blocks found, its fast copies made
            runtime.setup_seconds += time.perf_counter() - started
        packing.users += 1
    try:
        yield
    finally:
        with runtime.lock:
            packing.users -= 1
            if packing.users == 0:
                for linear in packing.linears:
                    del linear.module.__dict__["forward"]  # back to nn.Linear.forward


@contextlib.contextmanager
def shared_forward(model) -> Iterator[None]:
    """Inside the block, a model whose linears run "exact" (row-invariant) runs them as "auto" (the fastest
    form per row count): for a forward that plain and speculative decoding share as it is (a prompt's
    prefill), where row invariance buys nothing and a GEMM over many rows is much faster."""
    packing = TargetRuntime.of(model).packing
    if packing is None or packing.mode != "exact":
        yield
        return
    packing.shared += 1
    try:
        yield
    finally:
        packing.shared -= 1


def linear_kinds(model) -> dict[str, int]:
    """How the model's linears ran in its last `packed_linears` block ({} before any)."""
    packing = TargetRuntime.of(model).packing
    return packing.kinds() if packing is not None else {}
