"""Float32 weights that are exactly block-quantized values, found and read in that compact form.

A model converted from a quantized checkpoint (the embedded SmolLM2 comes from a GGUF file with Q4_1
linear layers and a Q8_0 embedding) holds float32 weights that are, block of 32 by block of 32,

    Q4_1: w = fma(d, q, m), q in [0, 15]          Q8_0: w = d * q, q in [-127, 127]

with d and m float16 values. `recover_blocks(weight)` finds d, m and q when every block fits one of
these forms exactly (it checks the reconstruction bit for bit) and returns None otherwise; `BlockMatrix`
then computes x @ w^T through treespec's `block_linear` op (csrc/block_linear_cpu.cpp), which rebuilds
each weight exactly in registers. The weights used are the model's own, bit for bit; only the summation
order differs from a float32 GEMM (like any other GEMM). It reads 0.625 (Q4_1) or 1.125 (Q8_0) bytes
per weight instead of 4: on a CPU whose one-token step is bound by memory reads this is most of a step.

The same holds for a float32 weight whose every value is a bfloat16 value (a bf16 checkpoint loaded in
float32, the default dtype on CPUs without bf16 instructions): `exact_bf16(weight)` returns its bfloat16
copy, which treespec's dense kernels read at 2 bytes per weight with the same bits out (they widen each
bf16 weight to the float32 value it stands for, exactly).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from .pages import huge_page_copies

BLOCK = 32


@dataclass
class BlockWeights:
    """One weight [N, K] as blocks: q4 [N, K/2] uint8 (with m) or q8 [N, K] int8; d, m [N, K/32] float32."""

    q: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None

    @property
    def kind(self) -> str:
        return "q4_1" if self.m is not None else "q8_0"

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [N, K] (the reference the kernel is tested against)."""
        if self.m is None:
            N, K = self.q.shape
            return (self.d[..., None] * self.q.view(N, K // BLOCK, BLOCK).float()).reshape(N, K)
        N, half = self.q.shape
        low, high = self.q & 0x0F, self.q >> 4  # [N, K/2] each
        q = torch.cat([low.view(N, -1, 16), high.view(N, -1, 16)], dim=-1).float()  # [N, K/32, 32]
        return (self.d[..., None] * q + self.m[..., None]).reshape(N, 2 * half)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.q, self.d, self.m) if t is not None)


def gather_on_huge_pages(blocks: list[BlockWeights]) -> None:
    """Move the q, d and m of every one of `blocks` into one buffer on 2 MB pages (`core.pages`), in place:
    a step streams all of a model's blocks, and on 4 KB pages the page walks cost a thread about half its
    read rate (Zen 4 EPYC)."""
    tensors = [t for b in blocks for t in (b.q, b.d, b.m) if t is not None]
    copies = iter(huge_page_copies(tensors))
    for b in blocks:
        b.q, b.d = next(copies), next(copies)
        if b.m is not None:
            b.m = next(copies)


def _fp16_neighbours(d: torch.Tensor) -> list[torch.Tensor]:
    """d [..] (float16 values in float32) and its float16 neighbours up and down, as float32."""
    h = d.half()
    up = torch.nextafter(h, torch.full_like(h, float("inf"))).float()
    down = torch.nextafter(h, torch.full_like(h, float("-inf"))).float()
    return [d, up, down]


def _fit(blocks: torch.Tensor, offset: torch.Tensor | None, scale: torch.Tensor, lo: int, hi: int):
    """For each block [N, B, 32] the first candidate scale whose integers q in [lo, hi] rebuild it exactly:
    (ok [N, B], d [N, B], q [N, B, 32] as float)."""
    ok = torch.zeros(blocks.shape[:-1], dtype=torch.bool)
    best_d = torch.zeros_like(scale)
    best_q = torch.zeros_like(blocks)
    base = blocks if offset is None else blocks - offset[..., None]
    for d in _fp16_neighbours(scale):
        safe = torch.where(d == 0, torch.ones_like(d), d)
        q = torch.round(base / safe[..., None]).clamp_(lo, hi)  # [N, B, 32]
        rebuilt = d[..., None] * q if offset is None else d[..., None] * q + offset[..., None]
        fits = (rebuilt == blocks).all(-1) & ~ok  # [N, B]
        best_d = torch.where(fits, d, best_d)
        best_q = torch.where(fits[..., None], q, best_q)
        ok |= fits
        if bool(ok.all()):
            break
    return ok, best_d, best_q


@torch.no_grad()
def recover_blocks(weight: torch.Tensor) -> BlockWeights | None:
    """The exact Q4_1 or Q8_0 blocks of a float32 CPU weight [N, K], or None when it has none."""
    if weight.dtype != torch.float32 or weight.dim() != 2 or weight.device.type != "cpu":
        return None
    if weight.shape[1] % BLOCK:
        return None
    N, K = weight.shape
    blocks = weight.detach().reshape(N, K // BLOCK, BLOCK)  # [N, B, 32]
    if not bool(torch.isfinite(blocks).all()):
        return None
    lo, hi = blocks.amin(-1), blocks.amax(-1)  # [N, B]
    if bool((lo.half().float() == lo).all()):  # Q4_1: the block minimum is m itself (q = 0)
        ok, d, q = _fit(blocks, lo, ((hi - lo) / 15).half().float(), 0, 15)
        if bool(ok.all()):
            q = q.to(torch.uint8)
            packed = (q[..., :16] | (q[..., 16:] << 4)).reshape(N, K // 2).contiguous()
            return _checked(BlockWeights(packed, d.contiguous(), lo.contiguous()), weight)
    amax = torch.maximum(lo.abs(), hi.abs())
    ok, d, q = _fit(blocks, None, (amax / 127).half().float(), -127, 127)
    if bool(ok.all()):
        q8 = q.to(torch.int8).reshape(N, K).contiguous()
        return _checked(BlockWeights(q8, d.contiguous(), None), weight)
    return None


@torch.no_grad()
def round_to_q8_0(weight: torch.Tensor) -> torch.Tensor:
    """The nearest Q8_0-representable float32 weight [N, K] (K a multiple of 32): per block of 32,
    d = float16(max|w| / 127) and w' = d * round(w / d), which `recover_blocks` then finds exactly.
    Blocks it cannot represent bit for bit (e.g. all zeros are fine; NaN is refused) stay as they were."""
    if weight.dim() != 2 or weight.shape[1] % BLOCK:
        raise ValueError(
            f"a Q8_0 weight needs 2 dims and a multiple of {BLOCK} columns, got {tuple(weight.shape)}"
        )
    if not bool(torch.isfinite(weight).all()):
        raise ValueError("cannot round a weight with NaN or infinite values to Q8_0")
    N, K = weight.shape
    blocks = weight.detach().float().reshape(N, K // BLOCK, BLOCK)  # [N, B, 32]
    d = (blocks.abs().amax(-1) / 127).half().float()  # [N, B]
    safe = torch.where(d == 0, torch.ones_like(d), d)
    q = torch.round(blocks / safe[..., None]).clamp_(-127, 127)  # [N, B, 32]
    return (d[..., None] * q + 0.0).reshape(N, K)  # + 0.0: no -0.0, which the block form cannot hold


@torch.no_grad()
def exact_bf16(weight: torch.Tensor) -> torch.Tensor | None:
    """The bfloat16 copy [N, K] of a float32 weight whose every value is a bfloat16 value (the low 16 bits
    of each float32 bit pattern are zero: the copy holds the high 16, so widening it back gives the same
    bits, -0.0 and NaN included), else None."""
    if weight.dtype != torch.float32 or weight.numel() == 0:
        return None
    halves = weight.detach().contiguous().view(torch.int16).view(-1, 2)  # [numel, 2]: 16-bit halves
    low, high = (0, 1) if sys.byteorder == "little" else (1, 0)
    if bool(halves[:, low].any()):  # strided views: no temporary the size of the weight
        return None
    return halves[:, high].contiguous().view(torch.bfloat16).view(weight.shape)


def _checked(blocks: BlockWeights, weight: torch.Tensor) -> BlockWeights | None:
    """The blocks when they rebuild `weight` bit for bit (float32 bit patterns, so -0.0 counts), else None."""
    same = torch.equal(blocks.dequantize().view(torch.int32), weight.detach().view(torch.int32))
    return blocks if same else None


class BlockMatrix:
    """x @ w^T (+ bias) with w held as exact blocks: x [..., K] float32 -> [..., N]."""

    def __init__(self, blocks: BlockWeights):
        self.blocks = blocks

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        b = self.blocks
        out = torch.ops.treespec.block_linear(x, b.q, b.d, b.m)
        return out if bias is None else out + bias
