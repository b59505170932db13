"""Prepacked linear layers for the CPU: every `nn.Linear` of a model (lm_head included) through oneDNN.

On the CPU, `F.linear` goes to a BLAS GEMM that repacks the weight on every call and is slow for the
few rows a decoding step has: measured on an AVX2 EPYC (float32, 30 layers of SmolLM2's MLP gate,
weights out of cache), 13 ms at 1 row but 22-27 ms at 2-16 rows and 42 ms at 32. oneDNN with the
weight reordered once into its blocked layout (`torch.ops.mkldnn._reorder_linear_weight`, then
`_linear_pointwise`, what inductor's `freezing` emits) took 11 ms at 1 row, 12-16 ms at 2-16 and 23 ms
at 32: a tree of 8-16 nodes then costs little more than one token. Results equal `F.linear` to float
rounding (~1e-6 relative in float32), not bitwise.

`packed_linears(model)` switches a model to the packed path inside a `with` block and back after it,
counted per model like `tree_attention_enabled`, so HF's own `generate` on the same model object
outside the block runs stock. The packed weights are built on first use (about one extra copy of the
linear weights in memory) and rebuilt when a weight tensor changes (its storage or version), so a
model trained between two uses never runs on stale weights.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator

import torch
import torch.nn.functional as F

PACKED_DTYPES = (torch.float32, torch.bfloat16)


def packing_supported(model) -> bool:
    """Whether `packed_linears` speeds this model up: CPU weights in float32 (or bfloat16 where oneDNN
    has bf16 instructions), and oneDNN in this torch build."""
    return _supported(next(model.parameters()))


def _supported(tensor: torch.Tensor) -> bool:
    if tensor.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if tensor.dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return tensor.dtype == torch.float32


class PackedMatrix:
    """x @ weight.T for a fixed weight [out, in] (e.g. a drafter's output rows): oneDNN on a prepacked
    copy where `packing_supported` would say so, else `F.linear`. The weight must not change after."""

    def __init__(self, weight: torch.Tensor, enabled: bool = True):
        self.weight = weight  # [out, in]
        self.packed = None
        if enabled and _supported(weight):
            with torch.no_grad():
                self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., in] -> [..., out]
        if self.packed is None or x.dtype != self.weight.dtype or torch.is_grad_enabled():
            return F.linear(x.to(self.weight.dtype), self.weight)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")


class _PackedLinear:
    """The replacement forward of one `nn.Linear`: oneDNN with the prepacked weight, or `F.linear` for
    inputs it does not take (another dtype or device, autograd on)."""

    def __init__(self, module: torch.nn.Linear):
        self.module = module
        self.packed: torch.Tensor | None = None
        self.key: tuple | None = None
        self.refresh()

    def refresh(self) -> None:
        """Re-pack when the weight's storage or version changed since the last packing."""
        w = self.module.weight
        key = (w.data_ptr(), w._version, w.dtype)
        if key != self.key:
            with torch.no_grad():
                self.packed = torch.ops.mkldnn._reorder_linear_weight(w.detach())  # opaque oneDNN layout
            self.key = key

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., in_features] -> [..., out_features]
        m = self.module
        if (
            x.dtype != m.weight.dtype
            or x.device.type != "cpu"
            or (torch.is_grad_enabled() and m.weight.requires_grad)
        ):
            return F.linear(x, m.weight, m.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, m.bias, "none", [], "")


class _ModelPacking:
    def __init__(self, model):
        self.linears = [_PackedLinear(m) for m in model.modules() if isinstance(m, torch.nn.Linear)]
        self.users = 0


_packings: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> _ModelPacking
_lock = threading.Lock()


@contextlib.contextmanager
def packed_linears(model, enabled: bool = True) -> Iterator[None]:
    """Run every `nn.Linear` of `model` on prepacked oneDNN weights inside the block (a no-op when
    `enabled` is False or `packing_supported(model)` is not)."""
    if not enabled or not packing_supported(model):
        yield
        return
    with _lock:
        packing = _packings.get(model)
        if packing is None:
            packing = _packings[model] = _ModelPacking(model)
        if packing.users == 0:
            for linear in packing.linears:
                linear.refresh()
                linear.module.forward = linear  # instance attribute: nn.Module.__call__ uses it
        packing.users += 1
    try:
        yield
    finally:
        with _lock:
            packing.users -= 1
            if packing.users == 0:
                for linear in packing.linears:
                    del linear.module.forward  # back to nn.Linear.forward
