"""TargetRuntime: everything treespec keeps for one module it runs, in one object with a lifetime.

A target model (or a drafter's module: heads, an EAGLE layer) that treespec decodes with carries state
between calls: how many users hold it in treespec's attention mode and what its implementation was
before, the fast copies of its linear layers (`core.packed`), the compiled verification forward and the
keys whose guards were checked (`core.compiled`), the step pricers of batches (`core.pricing`), the
heads' shared output matrices (`drafters.medusa`) and the K/V buffer of the last cache it released
(`core.cache`). All of it lives here, one runtime per module, reached through `TargetRuntime.of(module)`;
nothing is kept process-wide.

    runtime = TargetRuntime.of(model)      # made on first use, kept on the module (one attribute)
    runtime.memory_bytes()                 # what its copies hold beside the model's own weights
    runtime.close()                        # the model back to stock; the next use starts a fresh one

`with TargetRuntime.of(model):` closes it at the end of the block.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Hashable
from typing import Any

import torch

ATTRIBUTE = "_treespec_runtime"
KEEP_KV_BUFFER_BYTES = 1 << 30  # the largest released K/V buffer a runtime keeps for the next cache


class TargetRuntime:
    """The per-module state of treespec's runtime (see the module docstring)."""

    def __init__(self, module: torch.nn.Module):
        self.module = module
        self.lock = threading.RLock()
        # attention mode: the implementation before treespec's, and the users holding treespec's now
        self.attention_before: str | None = None
        self.attention_users = 0
        self.packing: Any = None  # `packed._ModelPacking` of the module's linears, built on first use
        self.other_packings: dict[str, Any] = {}  # mode -> a packing built earlier for another mode
        self.compiled: Any = None  # the module's torch.compile wrapper of `forward.full_forward`
        # numerics form ("float" or "int8") -> (weight key, the native step's model over these weights, bytes
        # of its own copies): `core.native`
        self.native: dict[str, Any] = {}
        self.compiled_keys: set[tuple] = set()  # keys whose first call checked every guard
        self.pricers: dict[Hashable, Any] = {}  # drafter setting -> `pricer.StepPricer`
        # (recipe, compile, numerics) -> () -> drafter: what `generate(drafter="NAME")` built (`recipes`)
        self.recipes: dict[Hashable, Any] = {}
        # heads -> (weight key, output rows [V', H], their fast matrix): the heads' shared output matrix
        self.outputs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        # the CPU K/V buffer of the last released cache (`cache.TreeKVCache.release`), for the next cache
        self.kv_buffer: torch.Tensor | None = None
        # seconds spent building what is above for the first time (packing, native step): one-time work
        # that a call's statistics report apart (`GenerationStats.time_setup`)
        self.setup_seconds = 0.0
        self.logits_checked = False  # `support.check_logits` found its logits the model's own
        self.closed = False

    @classmethod
    def of(cls, module: torch.nn.Module) -> TargetRuntime:
        """The module's runtime (a fresh one after `close()`)."""
        runtime = module.__dict__.get(ATTRIBUTE)
        if runtime is None or runtime.closed:
            runtime = cls(module)
            module.__dict__[ATTRIBUTE] = runtime  # a plain attribute: not a submodule, not saved
        return runtime

    def pricer(self, key: Hashable, make):
        """The step pricer for a drafter setting `key` (made by `make()` on first use)."""
        with self.lock:
            if key not in self.pricers:
                self.pricers[key] = make()
            return self.pricers[key]

    def take_kv_buffer(self) -> torch.Tensor | None:
        """The kept K/V buffer, now the caller's (None: none kept)."""
        with self.lock:
            buffer, self.kv_buffer = self.kv_buffer, None
            return buffer

    def keep_kv_buffer(self, buffer: torch.Tensor) -> None:
        """Keep a released cache's buffer for the next cache: the larger of it and the one kept, up to
        KEEP_KV_BUFFER_BYTES (a larger one is freed)."""
        size = _tensor_bytes(buffer)
        with self.lock:
            if size <= KEEP_KV_BUFFER_BYTES and size > _tensor_bytes(self.kv_buffer):
                self.kv_buffer = buffer

    def memory_bytes(self) -> dict[str, int]:
        """Bytes this runtime holds beside the module's own weights: fast linear copies, output matrices,
        the native step's copies, the kept K/V buffer."""
        packings = [self.packing, *self.other_packings.values()]
        linears = sum(packing.memory_bytes() for packing in packings if packing is not None)
        outputs = sum(
            _tensor_bytes(matrix) + _tensor_bytes(weight) for _, weight, matrix in self.outputs.values()
        )
        native = sum(entry[2] for entry in self.native.values())
        kv = _tensor_bytes(self.kv_buffer)
        return {
            "packed_linears": linears,
            "output_matrices": outputs,
            "native_step": native,
            "kv_buffer": kv,
            "total": linears + outputs + native + kv,
        }

    def close(self) -> None:
        """Drop everything and give the module back as it was. Refused while a decode holds it."""
        with self.lock:
            if self.attention_users or (self.packing is not None and self.packing.users):
                raise RuntimeError("the model is decoding (a treespec call holds it): close it afterwards")
            self.packing = self.compiled = None
            self.native.clear()
            self.other_packings.clear()
            self.compiled_keys.clear()
            self.pricers.clear()
            self.recipes.clear()
            self.outputs.clear()
            self.kv_buffer = None
            self.closed = True
            if self.module.__dict__.get(ATTRIBUTE) is self:
                del self.module.__dict__[ATTRIBUTE]

    def __enter__(self) -> TargetRuntime:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _tensor_bytes(value) -> int:
    """Bytes of the tensors a fast matrix or a weight holds (0 for None)."""
    if value is None:
        return 0
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    return int(value.memory_bytes()) if hasattr(value, "memory_bytes") else 0
