"""The verification forward compiled with torch.compile (inductor): one graph per node count.

    CompiledForward(model, linears)(ids [B, n], positions [B, n], cache, plan) -> hidden [B, n, H]

is `decoder.full_forward` (the model's decoder layers, treespec's tree attention op, the cache write,
the linear layers as `core.packed` switched them) traced once per node count n, with every other size
(the committed length, the cache capacity) symbolic, so one graph serves a whole sequence and every
later one. What compiling buys on CPU is the Python dispatch of ~35 small ops per layer (norms, rotary
embedding, residuals) fused into a few C++ loops; the linear layers and the attention stay the ops
they were.

Guards: dynamo checks ~9,000 guards (mostly the model's modules) before every call, 3-5 ms here. After
the first call for a key (model, node count, attention kernel, linear mode) has compiled or found its
graph with every guard checked, later calls with that key run under
`set_stance(skip_guard_eval_unsafe=True)`, which checks only the guards that tell the cached graphs
apart. That is sound as long as nothing else about the model changes between calls (its modules,
weight shapes, attention implementation); change them and start a new process.

The compiled code is cached on disk (inductor's caches under `$TREESPEC_CACHE/inductor` unless
TORCHINDUCTOR_CACHE_DIR names another place), so a second process skips code generation; dynamo still
traces the model again, and the first call of each node count says so on stderr.
"""

from __future__ import annotations

import os
import sys
import time
import weakref
from pathlib import Path

import torch

from ..io import cache_root

_compiled_forward = None  # one torch.compile wrapper per process: its graphs live on full_forward's code
# model -> keys whose first call ran with every guard checked (weak: a new model never inherits them)
_seen: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def cache_dir() -> Path:
    """Where inductor keeps compiled code: TORCHINDUCTOR_CACHE_DIR when set to something other than
    torch's default, else `$TREESPEC_CACHE/inductor` (default `~/.cache/treespec/inductor`)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    chosen = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if chosen and os.path.abspath(chosen) != os.path.abspath(default_cache_dir()):
        return Path(chosen)
    return cache_root() / "inductor"


def _compiled():
    """The process-wide compiled `full_forward` (created on first use)."""
    global _compiled_forward
    if _compiled_forward is None:
        from .decoder import full_forward

        # torch sets the variable to its /tmp default on import; inductor reads it at every cache access
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir())
        # a graph per node count (and per model): more than dynamo's default of 8 in one process
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        _compiled_forward = torch.compile(full_forward, dynamic=True)
    return _compiled_forward


class CompiledForward:
    """A scorer (`drafters.base.Scorer`) running `full_forward` compiled; n is kept static per graph."""

    def __init__(self, model, linears: str = "auto", progress=sys.stderr):
        """linears: the decoder's linear mode (part of the key, since it changes the traced modules);
        progress: a stream for the note before a node count compiles (None: quiet)."""
        self.model, self.linears, self.progress = model, linears, progress

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, cache, plan) -> torch.Tensor:
        # ids, positions: [B, n]; the node count is static in each graph, everything else symbolic
        torch._dynamo.mark_static(ids, 1)
        torch._dynamo.mark_static(positions, 1)
        cache._reserve(ids.shape[1])  # the capacity check, outside the graph (its guard may be skipped)
        # committed lengths 0 and 1 would be specialised (dynamo's 0/1 rule): those calls keep all guards
        key = (ids.shape[1], plan.kernel, self.linears, cache.committed > 1)
        forward = _compiled()
        seen = _seen.setdefault(self.model, set())
        if key in seen:
            with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
                return forward(self.model, ids, positions, cache, plan)
        if self.progress is not None:
            print(
                f"treespec: compiling the verification step for {ids.shape[1]} node(s) (first use in "
                f"this process, about a minute on a small CPU; code cached in {cache_dir()})",
                file=self.progress,
                flush=True,
            )
        t0 = time.perf_counter()
        hidden = forward(self.model, ids, positions, cache, plan)
        seen.add(key)
        if self.progress is not None:
            print(f"treespec: compiled in {time.perf_counter() - t0:.0f} s", file=self.progress, flush=True)
        return hidden
