"""The verification forward compiled with torch.compile (inductor): a few graphs serve every tree.

    CompiledForward(model, linears)(ids [B, n], positions [B, n], cache, plan) -> hidden [B, n, H]

is `forward.full_forward` (the model's decoder layers, treespec's tree attention op, the cache write,
the linear layers as `core.packed` switched them) traced with every size symbolic: the node count n, the
committed length, the cache capacity. Dynamo still splits on what changes the graph itself: n = 1
(its 0/1 rule) and more than `packed.BLOCK_ROWS_MAX` rows (block weights go to a GEMM there), so the
node counts fall into three size classes (`size_class`), one compile each: 1, 2-24 and 25 or more.
A symbolic n measured faster than one graph per node count
(benchmarks/log/2026-12-01-d-session4-size-classes.md), and it lets trees change size from step to step.

What compiling buys on CPU is the Python dispatch of ~35 small ops per layer (norms, rotary
embedding, residuals) fused into a few C++ loops; the linear layers and the attention stay the ops
they were.

Guards: dynamo checks thousands of guards (mostly the model's modules) before every call. After
the first call for a key (model, size class, attention kernel, linear mode) has compiled or found its
graph with every guard checked, later calls with that key run under
`set_stance(skip_guard_eval_unsafe=True)`, which checks only the guards that tell the cached graphs
apart. That is sound as long as nothing else about the model changes between calls (its modules,
weight shapes, attention implementation); change them and start a new process.

The compiled code is cached on disk (inductor's caches under `$TREESPEC_CACHE/inductor` unless
TORCHINDUCTOR_CACHE_DIR names another place), so a second process skips code generation; dynamo still
traces the model again, and the first call of each size class says so on stderr.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from ..io import cache_root
from .forward import full_forward
from .packed import BLOCK_ROWS_MAX
from .runtime import TargetRuntime


def cache_dir() -> Path:
    """Where inductor keeps compiled code: TORCHINDUCTOR_CACHE_DIR when set to something other than
    torch's default, else `$TREESPEC_CACHE/inductor` (default `~/.cache/treespec/inductor`)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    chosen = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if chosen and os.path.abspath(chosen) != os.path.abspath(default_cache_dir()):
        return Path(chosen)
    return cache_root() / "inductor"


@contextlib.contextmanager
def compile_settings() -> Iterator[None]:
    """What a compiled call needs, for the call only: inductor's cache folder (`cache_dir`; inductor reads
    the variable at every cache access) and room for a few graphs per model and attention kernel (more
    than dynamo's default of 8 in one process). The process's own settings come back after."""
    before = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir())
    limit = max(torch._dynamo.config.cache_size_limit, 64)
    try:
        with torch._dynamo.config.patch(cache_size_limit=limit):
            yield
    finally:
        if before is None:
            del os.environ["TORCHINDUCTOR_CACHE_DIR"]
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = before


def compiled_forward(runtime: TargetRuntime):
    """The runtime's compiled `full_forward` (created on first use)."""
    if runtime.compiled is None:
        runtime.compiled = torch.compile(full_forward, dynamic=True)
    return runtime.compiled


def size_class(n: int) -> str:
    """The node counts one compiled graph serves: "1", "2-24" or "25+" (`packed.BLOCK_ROWS_MAX`)."""
    if n == 1:
        return "1"
    return f"2-{BLOCK_ROWS_MAX}" if n <= BLOCK_ROWS_MAX else f"{BLOCK_ROWS_MAX + 1}+"


class CompiledForward:
    """A scorer (`drafting.Scorer`) running `full_forward` compiled, the node count symbolic."""

    def __init__(self, model, linears: str = "auto", progress=sys.stderr):
        """linears: the decoder's linear mode (part of the key, since it changes the traced modules);
        progress: a stream for the note before a node count compiles (None: quiet)."""
        self.model, self.linears, self.progress = model, linears, progress

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, cache, plan, feature_layers=()):
        # ids, positions: [B, n], every size symbolic; one graph per size class of n
        # feature_layers: also return the target's hidden states there (`forward.full_forward`)
        n = ids.shape[1]
        cache._reserve(n)  # the capacity check, outside the graph (its guard may be skipped)
        # committed lengths 0 and 1 would be specialised (dynamo's 0/1 rule): those calls keep all guards
        feature_layers = tuple(feature_layers)
        # rows with their own committed lengths (`TreeKVCache.attention_plan`) trace other code: its own
        # graphs, one row apart from several
        rows = None if plan.rows is None else len(plan.rows) > 1
        key = (size_class(n), plan.kernel, self.linears, cache.committed > 1, feature_layers, rows)
        runtime = TargetRuntime.of(self.model)
        forward, seen = compiled_forward(runtime), runtime.compiled_keys
        if key in seen:
            try:
                with compile_settings(), torch.compiler.set_stance(skip_guard_eval_unsafe=True):
                    return forward(self.model, ids, positions, cache, plan, feature_layers)
            except RuntimeError as error:  # a graph split `size_class` did not foresee: compile it, guarded
                if "skip_guard_eval_unsafe" not in str(error):
                    raise
        if self.progress is not None:
            print(
                f"treespec: compiling the verification step for trees of {size_class(n)} node(s) (first "
                f"use in this process, one to two minutes on a small CPU; code cached in {cache_dir()})",
                file=self.progress,
                flush=True,
            )
        t0 = time.perf_counter()
        with compile_settings():
            hidden = forward(self.model, ids, positions, cache, plan, feature_layers)
        seen.add(key)
        if self.progress is not None:
            print(f"treespec: compiled in {time.perf_counter() - t0:.0f} s", file=self.progress, flush=True)
        return hidden
