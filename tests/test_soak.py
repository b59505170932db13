"""Soak test: generating again and again in one process must not grow its memory.

Reported: resident memory 695 -> 734 -> 747 -> 765 MiB over three 700-token generations with SmolLM2
and the shipped heads. Measured (bf16, shipped heads, 300 tokens, one prompt or four different ones):
RSS 685 MiB after loading, 692 after the 1st generation, 710 after the 2nd, then 710 after each of
five more. glibc's bytes in use (mallinfo2) and Python's object count do not move from the 1st
generation on; the 18 MiB are freed blocks glibc keeps in its heap (`malloc_trim(0)` gives them
back). Each generate call allocates and frees large tensors (the drafter's [16384, 576] copy of the
draft-vocabulary output rows, 18 MiB in bf16; the KV cache), and freeing the first, mmap-ed, copy
raises glibc's mmap threshold, so later copies come from the heap and stay there. With
MALLOC_MMAP_THRESHOLD_=131072 (a fixed threshold) RSS is flat from the 1st generation. In float32 the
1st generation also pages in the memory-mapped weights (~520 MiB of file-backed RSS): not a leak.

The test gives freed heap blocks back before each reading (`malloc_trim`), warms up, then asserts
that RSS stops growing: a leak grows it by about the same amount
every generation, the allocator's retention once. The test has power: the same measurement with one
deliberate leak (each generation's last logits kept, twice over in float64: 12 MiB with the shipped
16-node tree) must fail the check.
"""

from __future__ import annotations

import ctypes
import gc
import itertools
import os
from pathlib import Path

import pytest
import torch

import treespec

pytestmark = pytest.mark.integration

SHIPPED_HEADS = Path(__file__).resolve().parents[1] / "heads" / "smollm2-135m-instruct"
PROMPT = "Write a long, detailed essay about the history of the Roman Empire, from its founding to its fall."
NEW_TOKENS = 48
RUNS = 4  # measured generations after the warm-up
MIB = 2**20
# a leak grows RSS every generation: the median growth per generation stays under this
STEP_TOLERANCE = 2 * MIB
# the allocator may keep the blocks one generation frees for the next: allowed once, after the warm-up
SETTLE_TOLERANCE = 24 * MIB
# from the 2nd measured generation on, RSS is flat (to this much) unless something leaks
FLAT_TOLERANCE = 4 * MIB


def _release_free_heap() -> None:
    """Give the heap's freed blocks back to the system (glibc `malloc_trim`; a no-op elsewhere), so RSS
    counts live memory: otherwise a leak can hide in blocks freed earlier (treespec's first use of a
    model frees hundreds of MiB of temporaries while it finds the model's block weights)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _memory() -> dict[str, int]:
    """Resident set size and its anonymous / file-backed parts, in bytes (Linux /proc), after the freed
    heap is given back."""
    gc.collect()
    _release_free_heap()
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "RssAnon:", "RssFile:")):
                key, value = line.split(":")
                out[key] = int(value.split()[0]) * 1024
    return out


def _soak(generate, runs: int = RUNS) -> list[dict[str, int]]:
    """Warm up once, then measure after each of `runs` generations (index 0: after the warm-up)."""
    generate()
    samples = [_memory()]
    for _ in range(runs):
        generate()
        samples.append(_memory())
    return samples


def _problems(samples: list[dict[str, int]]) -> list[str]:
    """What is wrong with these RSS samples: growth every generation, a big step, or no settling."""
    rss = [s["VmRSS"] for s in samples]
    steps = [b - a for a, b in itertools.pairwise(rss)]
    median = sorted(steps)[len(steps) // 2]
    problems = []
    if median > STEP_TOLERANCE:
        problems.append(f"RSS grows every generation: median {median / MIB:.1f} MiB per generation")
    if rss[1] - rss[0] > SETTLE_TOLERANCE:
        problems.append(f"the first generation after the warm-up added {(rss[1] - rss[0]) / MIB:.1f} MiB")
    if rss[-1] - rss[1] > FLAT_TOLERANCE:
        problems.append(
            f"RSS grew {(rss[-1] - rss[1]) / MIB:.1f} MiB over the last {len(rss) - 2} generations"
        )
    return problems


def _describe(samples: list[dict[str, int]]) -> str:
    return "; ".join(
        f"{s['VmRSS'] / MIB:.1f} MiB (anon {s['RssAnon'] / MIB:.1f}, file {s['RssFile'] / MIB:.1f})"
        for s in samples
    )


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="reads RSS from Linux /proc")
def test_repeated_generations_do_not_grow_memory(smollm2, monkeypatch):
    model, tokenizer = smollm2
    heads = treespec.MedusaHeads.from_pretrained(SHIPPED_HEADS, model=model)
    tree = treespec.Tree.load(SHIPPED_HEADS / "tree.json")

    def generate():
        result = treespec.generate(
            model,
            PROMPT,
            treespec.as_drafter(model, heads, tree),
            tokenizer=tokenizer,
            max_new_tokens=NEW_TOKENS,
            eos_token_id=[],
        )
        assert len(result.token_ids) == NEW_TOKENS

    samples = _soak(generate)
    assert not _problems(samples), f"{_problems(samples)}; RSS after each generation: {_describe(samples)}"

    # the check has power: keeping each generation's last logits ([nodes, V] float32; 3 MiB with the
    # shipped 16-node tree), twice over in float64 (12 MiB), must fail it
    kept: list[torch.Tensor] = []
    verified_logits = treespec.Decoder.verified_logits  # every verification's logits pass here

    def keeping(self, hidden):
        out, best = verified_logits(self, hidden)
        kept[-1] = out.detach().double().repeat(2, 1, 1)
        return out, best

    def leaky():
        kept.append(None)
        generate()

    monkeypatch.setattr(treespec.Decoder, "verified_logits", keeping)
    leaked = _soak(leaky, runs=3)
    monkeypatch.undo()
    per_generation = sum(t.numel() * t.element_size() for t in kept[1:]) / (len(kept) - 1) / MIB
    assert per_generation > 2 * STEP_TOLERANCE / MIB, "the deliberate leak is too small to test with"
    assert _problems(leaked), (
        f"a leak of {per_generation:.1f} MiB per generation went unnoticed: {_describe(leaked)}"
    )
    kept.clear()
    if os.environ.get("TREESPEC_SOAK_VERBOSE"):
        print(f"\nclean: {_describe(samples)}\nleaking: {_describe(leaked)}")
