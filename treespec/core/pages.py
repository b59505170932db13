"""Memory on 2 MB pages: what a step streams every time (weights, K/V) read at the rate of the memory, not
of the page walks.

A decoding step reads every weight and every K/V entry once. On 4 KB pages that is tens of thousands of
pages a step, far more than the TLB holds, and on a Zen 4 EPYC a thread read them at about half the rate of
2 MB pages (17 against 32 GB/s). Linux gives 2 MB pages to memory that asks for them (`MADV_HUGEPAGE`,
the default `madvise` setting of transparent huge pages) before its first touch:

    tensors, buffer = huge_page_zeros(count, shape, dtype)   # zeroed tensors in one such buffer
    copies = huge_page_copies([a, b, c])                     # copies of tensors, side by side in one
"""

from __future__ import annotations

import ctypes
import math
import sys

import torch

HUGE_PAGE = 2 << 20  # bytes of an x86-64 / arm64 Linux huge page
ALIGN = 64  # each tensor of a buffer starts on a cache line


def advise_huge_pages(address: int, length: int) -> None:
    """Ask Linux to back [address, address + length) (2 MB aligned) with 2 MB pages (MADV_HUGEPAGE); a
    request: where it is refused or not Linux, the memory works as it is."""
    if sys.platform != "linux" or length <= 0:
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        libc.madvise(ctypes.c_void_p(address), ctypes.c_size_t(length), 14)  # 14: MADV_HUGEPAGE
    except (OSError, AttributeError):
        pass


def huge_page_buffer(size: int) -> tuple[torch.Tensor, int]:
    """(an uninitialised uint8 CPU buffer with `size` bytes from a 2 MB boundary on, advised to 2 MB pages,
    that offset). Touch it only after this call: the first touch decides the pages."""
    buffer = torch.empty(size + HUGE_PAGE, dtype=torch.uint8)
    start = -buffer.data_ptr() % HUGE_PAGE
    advise_huge_pages(buffer.data_ptr() + start, (buffer.numel() - start) // HUGE_PAGE * HUGE_PAGE)
    return buffer, start


def huge_page_zeros(
    count: int, shape: tuple, dtype: torch.dtype, spare: torch.Tensor | None = None
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """`count` zeroed CPU tensors of `shape`, carved from one uint8 buffer on 2 MB pages where Linux grants
    them; returns (the tensors, the buffer).

    spare: a buffer an earlier cache gave back (`TargetRuntime.kv_buffer`), used when it is large enough.
    A fresh buffer's first touch costs the page faults (on 2 MB pages with Linux's default `defrag`
    setting, compaction too: 15-85 ms for the caches of Spec-Bench prompts on a Zen 4 EPYC, ~3% of a run);
    a spare's pages are already there, so only the zeroing is paid."""
    each = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    stride = (each + ALIGN - 1) // ALIGN * ALIGN
    needed = count * stride
    # (a spare made under inference mode can be written only there: outside it, a fresh buffer)
    usable = spare is not None and (torch.is_inference_mode_enabled() or not spare.is_inference())
    if usable and spare.numel() - (-spare.data_ptr() % HUGE_PAGE) >= needed:
        buffer = spare
        start = -buffer.data_ptr() % HUGE_PAGE
    else:
        buffer, start = huge_page_buffer(needed)
    buffer[start : start + needed].zero_()  # a fresh buffer's first touch, after the advice: 2 MB pages
    tensors = [
        buffer[start + i * stride : start + i * stride + each].view(dtype).view(shape) for i in range(count)
    ]
    return tensors, buffer


def huge_page_copies(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Contiguous copies of CPU `tensors` (same shapes, dtypes and values), side by side in one buffer on
    2 MB pages. The copies keep the buffer alive; it is freed with the last of them."""
    sizes = [t.numel() * t.element_size() for t in tensors]
    offsets, total = [], 0
    for size in sizes:
        offsets.append(total)
        total += (size + ALIGN - 1) // ALIGN * ALIGN
    buffer, start = huge_page_buffer(total)
    copies = []
    for t, offset, size in zip(tensors, offsets, sizes, strict=True):
        copy = buffer[start + offset : start + offset + size].view(t.dtype).view(t.shape)
        copy.copy_(t)  # the first touch, after the advice
        copies.append(copy)
    return copies
