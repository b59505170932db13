"""The native step: one C++ call runs every layer of a Llama-family verification forward (csrc/native_step.h).

    NativeStep(model, exact)(tokens [A, n], positions [A, n], cache, plan) -> hidden [A, n, H]

The same scorer contract as `decoder.full_forward` (and `compiled.CompiledForward`): the tokens' K/V land
in the `TreeKVCache` at each row's committed end, attention reads each row's prefix plus its tree block
under the plan's ancestor bits, and the final hidden states come back (logits stay with the caller's
lm_head). It reads the HF module's own weights: dense float32 / bfloat16 tensors, or the exact Q4_1 / Q8_0
blocks that `core.packed` recovered from them, never a copy made per step; norm weights are widened to
float32 once. A float32 weight whose values are all bfloat16 values (a bf16 checkpoint loaded in float32)
is read from a bfloat16 copy made once (`core.blocks.exact_bf16`): half the bytes, the same bits out.
The rotary tables come from the model's own rotary module, once per cache size. Nothing of
HF's Python forward runs per step: no module dispatch, no small aten ops.

It covers Llama, Qwen2, Mistral and Qwen3 decoders (RMSNorm, rotary, grouped-query attention with
optional q/k/v/o biases and Qwen3's RMSNorm of each q / k head, SiLU-gated MLP) on the CPU in float32 or
bfloat16; `unsupported_reason` says why any other model or setting runs the HF forward instead. The HF
forward stays the reference: tests compare the two on fresh random models (tests/test_native.py).
"""

from __future__ import annotations

import time

import torch

from .. import ops
from .blocks import exact_bf16
from .packed import weights_key
from .pages import huge_page_copies
from .runtime import TargetRuntime

MODEL_TYPES = ("llama", "qwen2", "mistral", "qwen3")
ROPE_TYPES = (
    "default",
    "linear",
    "llama3",
    "yarn",
)  # a fixed table per position (no length-dependent update)
STEPS = ("auto", "native", "hf")
# the native step's stage kinds (csrc StageKind), in the order `NativeStep.profile` reports them
STAGE_KINDS = (
    "embed", "norm1", "qkv", "rotary", "attention", "o", "norm2",
    "gate_up", "down", "features", "final", "logits",
)  # fmt: skip
LINEAR_STAGES = ("qkv", "o", "gate_up", "down", "logits")
KINDS = {"float32": 0, "bfloat16": 1, "q4_1": 2, "q8_0": 3}  # csrc WeightKind


def _layers(model):
    inner = getattr(model, "model", None)
    return None if inner is None else getattr(inner, "layers", None)


def _layer_linears(layer) -> tuple[torch.nn.Module, ...]:
    """A decoder layer's seven linears in the native step's order: q, k, v, o, gate, up, down."""
    attn, mlp = layer.self_attn, layer.mlp
    return (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj)


def _head_norms(layer) -> tuple[torch.nn.Module, torch.nn.Module] | None:
    """A layer's RMSNorms of each q and k head (Qwen3's q_norm, k_norm), or None where it has none."""
    attn = layer.self_attn
    norms = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
    return None if norms == (None, None) else norms


def model_reason(model) -> str | None:
    """None when the native step can run `model`, else why not (a phrase)."""
    config = model.config
    if config.model_type not in MODEL_TYPES:
        return f"model type {config.model_type!r} (it covers {', '.join(MODEL_TYPES)})"
    param = next(model.parameters())
    if param.device.type != "cpu" or param.dtype not in (torch.float32, torch.bfloat16):
        return f"{param.device.type} {param.dtype} weights (it runs float32 or bfloat16 on the CPU)"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"hidden_act {config.hidden_act!r} (it computes SiLU)"
    if getattr(config, "final_logit_softcapping", None):
        return "logit soft-capping"
    if type(getattr(model, "lm_head", None)) is not torch.nn.Linear:
        return "an lm_head that is not a plain nn.Linear"
    if getattr(config, "pretraining_tp", 1) != 1:
        return "pretraining_tp > 1"
    inner, layers = getattr(model, "model", None), _layers(model)
    if layers is None or not isinstance(getattr(inner, "embed_tokens", None), torch.nn.Embedding):
        return "a module layout other than model.model.{embed_tokens, layers, norm}"
    rotary = getattr(inner, "rotary_emb", None)
    if rotary is None or getattr(rotary, "rope_type", "default") not in ROPE_TYPES:
        return f"rope type {getattr(rotary, 'rope_type', None)!r} (it takes {', '.join(ROPE_TYPES)})"
    if any(t != "full_attention" for t in getattr(config, "layer_types", None) or ()):
        return "sliding-window layers"
    head_dim = layers[0].self_attn.head_dim
    if head_dim % 2 or head_dim > 512:
        return f"head_dim {head_dim}"
    for layer in layers:
        if any(type(m) is not torch.nn.Linear for m in _layer_linears(layer)):
            return "linear layers that are not plain nn.Linear (adapters, quantized modules)"
        head_norms = _head_norms(layer)
        for norm in [layer.input_layernorm, layer.post_attention_layernorm, *(head_norms or ())]:
            if not type(norm).__name__.endswith("RMSNorm") or not hasattr(norm, "variance_epsilon"):
                return f"a {type(norm).__name__} norm"
            if norm.variance_epsilon != layers[0].input_layernorm.variance_epsilon:
                return "norms of different epsilons"
        if (head_norms is not None) != (config.model_type == "qwen3"):
            return "q / k head norms where the model type has none (or none where it has them)"
    return None


def int8_reason(model) -> str | None:
    """None when the native step can run `model` in int8 numerics, else why not (a phrase)."""
    reason = model_reason(model)
    if reason is not None:
        return reason
    config, layers = model.config, _layers(model)
    dims = {
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "head_dim": layers[0].self_attn.head_dim,
    }
    odd = [f"{name} {value}" for name, value in dims.items() if value % 32]
    return f"{', '.join(odd)} (int8 numerics quantize blocks of 32)" if odd else None


def q8_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A dense weight [N, K] (K a multiple of 32) as Q8_0 blocks: (q int8 [N, K], d float16 [N, K / 32]),
    w ~ d * q with d = max|w| / 127 per block of 32 (rounded to float16, as GGUF's Q8_0 stores it)."""
    N, K = weight.shape
    blocks = weight.detach().float().reshape(N, K // 32, 32)  # [N, B, 32]
    d = (blocks.abs().amax(dim=-1) / 127).half()  # [N, B]
    scale = d.float()[..., None]  # [N, B, 1]
    q = torch.where(scale > 0, blocks / scale.clamp_min(torch.finfo(torch.float32).tiny), 0.0)
    return q.round().clamp(-127, 127).to(torch.int8).reshape(N, K).contiguous(), d.contiguous()


def unsupported_reason(model, kernel: str, linears: str, compile: bool, own_scorer: bool) -> str | None:
    """None when a decoder with these settings can verify through the native step, else why not."""
    reason = model_reason(model)
    if reason is not None:
        return reason
    if compile:
        return "compile=True (the torch.compile path runs the HF forward)"
    if own_scorer:
        return "the drafter brings its own scorer"
    if kernel not in ("compiled", "exact"):
        return f"kernel={kernel!r} (the native step runs treespec's own attention kernels)"
    if linears not in ("auto", "exact"):
        return f"linears={linears!r} (the native step runs treespec's own linear kernels)"
    if not ops.available("cpu"):
        return f"treespec's compiled CPU ops did not build ({ops.build_info()['error']})"
    return None


def linear_slots(module: torch.nn.Linear, blocks, int8: bool) -> tuple[int, list[torch.Tensor]]:
    """(weight kind, [w or q, d, m, bias]) of one linear (`weight_slots` of its weight and bias)."""
    return weight_slots(module.weight.detach(), module.bias, blocks, int8)


def weight_slots(weight: torch.Tensor, bias, blocks, int8: bool) -> tuple[int, list[torch.Tensor]]:
    """(weight kind, [w or q, d, m, bias]) of a weight [N, K] and its bias (or None): its exact blocks when
    `blocks` has them; in int8 numerics a dense weight as Q8_0 blocks (`q8_blocks`); a float32 weight of
    bfloat16 values as its bfloat16 copy (the kernel widens each weight back to the same float32 value)."""
    empty = torch.empty(0)
    bias = empty if bias is None else bias.detach().float().contiguous()
    if blocks is not None:  # scales as float16 (exact: they are float16 values): half the bytes per step
        m = empty if blocks.m is None else blocks.m.half()
        return KINDS[blocks.kind], [blocks.q, blocks.d.half(), m, bias]
    w = weight.detach()
    if int8:
        q, d = q8_blocks(w)
        return KINDS["q8_0"], [q, d, empty, bias]
    compact = exact_bf16(w)
    if compact is not None:
        return KINDS["bfloat16"], [compact, empty, empty, bias]
    return KINDS[str(w.dtype).removeprefix("torch.")], [w.contiguous(), empty, empty, bias]


def on_huge_pages(tensors: list[torch.Tensor], shared: set[int]) -> list[torch.Tensor]:
    """`tensors` with every one whose storage is not in `shared` (a copy made for the native model) moved
    into one buffer on 2 MB pages (`core.pages`): the step streams them with the weights every time."""
    own = [i for i, t in enumerate(tensors) if t.numel() and t.data_ptr() not in shared]
    out = list(tensors)
    for i, copy in zip(own, huge_page_copies([tensors[i] for i in own]), strict=True):
        out[i] = copy
    return out


class NativeStep:
    """The scorer over the native step (module docstring). exact: the row-invariant attention kernel
    ("bitwise" numerics); the linear kernels are row-invariant either way. int8: int8 numerics
    (csrc/int8_linear.h: activations quantized per row and block of 32, integer dot products against the
    weight blocks; dense weights quantized to Q8_0 blocks once), with the row-invariant attention kernel."""

    def __init__(self, model, exact: bool = False, int8: bool = False):
        self.model, self.exact, self.int8 = model, exact or int8, int8
        self.form = "int8" if int8 else "float"
        self.layers = _layers(model)
        self._native = None
        self._cache = None  # the TreeKVCache bound to the native model
        self._cos = self._sin = None  # [P, D] float32 rotary tables

    def refresh(self) -> None:
        """The native model over the current weights (once per prefill): the one the model's runtime
        holds, rebuilt when a weight changed since it was built (every decoder of the model shares it)."""
        runtime = TargetRuntime.of(self.model)
        key = weights_key(self.model)
        with runtime.lock:
            entry = runtime.native.get(self.form)
            if entry is None or entry[0] != key:
                started = time.perf_counter()
                entry = runtime.native[self.form] = (key, *self._build())
                runtime.setup_seconds += time.perf_counter() - started
            self._native, self._cache = entry[1], None  # bound again on the next call

    def _build(self):
        """(the native model, bytes of the copies it made: float16 scales, float32 norms and biases)."""
        model, layers = self.model, self.layers
        config, inner = model.config, model.model
        packing = TargetRuntime.of(model).packing
        blocks = {}
        if packing is not None:
            for linear in packing.linears:
                linear.refresh()
                if linear.matrix.blocks is not None:
                    blocks[id(linear.module)] = linear.matrix.blocks.blocks
        attn0 = layers[0].self_attn
        tensors = [
            inner.embed_tokens.weight.detach().contiguous(),
            inner.norm.weight.detach().float().contiguous(),
        ]
        kinds = []
        for layer in layers:
            norms = [layer.input_layernorm, layer.post_attention_layernorm, *(_head_norms(layer) or ())]
            tensors += [norm.weight.detach().float().contiguous() for norm in norms]
            for module in _layer_linears(layer):
                kind, slots = linear_slots(module, blocks.get(id(module)), self.int8)
                kinds.append(kind)
                tensors += slots
        kind, slots = linear_slots(model.lm_head, blocks.get(id(model.lm_head)), self.int8)
        kinds.append(kind)
        tensors += slots
        dims = [
            len(layers),
            config.hidden_size,
            config.num_attention_heads,
            getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
            attn0.head_dim,
            config.intermediate_size,
            inner.embed_tokens.weight.shape[0],
        ]
        if _head_norms(layers[0]) is not None:
            dims += [0, 1]  # not an EAGLE layer; q / k head norms
        eps = float(layers[0].input_layernorm.variance_epsilon)
        shared = {p.data_ptr() for p in model.parameters()}
        if packing is not None:
            shared |= {t.data_ptr() for b in blocks.values() for t in (b.q, b.d, b.m) if t is not None}
        if not self.int8:  # the copies made here (float16 scales, bf16 weights) on 2 MB pages, as the blocks
            tensors = on_huge_pages(tensors, shared)
        native = torch.classes.treespec.NativeModel(
            dims, [eps, float(attn0.scaling)], tensors, kinds, self.int8
        )
        if self.int8:  # it holds its int8 forms (and the norms, biases) instead of the blocks
            tensors = [t for t in tensors if t.dtype == torch.float32 and t.dim() == 1]
            own = native.own_bytes()
        else:
            own = 0
        copies = {t.data_ptr(): t.numel() * t.element_size() for t in tensors if t.numel()}
        return native, own + sum(n for ptr, n in copies.items() if ptr not in shared)

    def set_profiling(self, on: bool) -> None:
        """Count each task's time by stage kind from now on (on) or stop (off); read with `profile`."""
        if self._native is None:
            self.refresh()
        self._native.set_profiling(on)

    def profile(self) -> dict[str, float]:
        """Seconds of task time per stage kind (summed over threads) since the last read, then cleared."""
        return dict(zip(STAGE_KINDS, self._native.profile(), strict=True))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The lm_head over hidden [..., H] -> logits [..., V], on the native step's threads."""
        return self._native.logits(hidden)

    def logits_argmax(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits [..., V], their argmax [...]): what `logits` and logits.max(dim=-1).indices give, the
        argmax taken by the lm_head's tasks from the columns they just computed."""
        return self._native.logits_argmax(hidden)

    def _bind(self, cache) -> None:
        """Bind the cache's tensors and size the rotary tables for its capacity (when either changed)."""
        if self._native is None:
            self.refresh()
        if cache is not self._cache or self._native.bound_to() != cache.layers[0].keys.data_ptr():
            self._native.bind_cache(
                [layer.keys for layer in cache.layers], [layer.values for layer in cache.layers]
            )
            self._cache = cache
        if self._cos is None or self._cos.shape[0] < cache.max_len:
            rotary = self.model.model.rotary_emb
            dtype = next(self.model.parameters()).dtype
            positions = torch.arange(cache.max_len)[None]  # [1, P]
            cos, sin = rotary(torch.zeros(1, dtype=dtype), positions)  # [1, P, D] in the model's dtype
            self._cos, self._sin = cos[0].float().contiguous(), sin[0].float().contiguous()

    def __call__(self, tokens, positions, cache, plan, feature_layers=(), exact: bool | None = None):
        """tokens, positions [A, n] -> hidden [A, n, H]; with feature_layers (hidden, features [A, n, F]).
        exact: the row-invariant attention kernel (default: the step's own choice)."""
        self._bind(cache)
        rows, starts = cache.forward_rows()
        bits = plan.bits if plan.mask is not None else None
        hidden, features = self._native.step(
            tokens.long().contiguous(),
            positions.long().contiguous(),
            rows,
            starts,
            bits,
            self._cos,
            self._sin,
            list(feature_layers),
            self.exact if exact is None else exact,
        )
        cache.mark_written(len(self.layers))
        return (hidden, features) if feature_layers else hidden
