"""The decoder core: one decoder over B rows (B = 1 is a batch of one).

    prefill(prompts)   each prompt alone into its cache row (no padding); the first token of every row
    step():
        proposal = drafter.propose(hidden [A, H], roots [A])          # [A, N] one tree per live row
        hidden_tree = scorer(tokens, positions c_row + depth, plan)   # [A, N, H], K/V at each row's end
        per row: path, bonus = acceptance rule over its logits         # rows accept different lengths
        cache.commit(paths)                                            # each row advances by its own count
        drafter.observe(committed per row, features); roots = bonuses; hidden = hidden at the last node
    drop_rows(rows)    rows that stopped leave the batch: later forwards run over the live rows only

`Decoder` owns the model, the drafter, the target's KV cache (`TreeKVCache`), the acceptance rule, the
attention kernel, the scorer and the plain-step pricer; every caller (generate, streaming, calibration,
tuning, the benchmarks) goes through `prefill` and `step`, and nothing outside `core` touches the
cache's pointers. Row a of a forward reads only its own cache row, so a row's tokens are what it would
get decoded alone (greedy; in float32 up to the rounding of batched matrix products).

`plain_above` sets the live-row count above which steps verify the root alone (plain batched decoding);
"auto" lets a `StepPricer` time both kinds of step on this machine for batches of several rows.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from .acceptance import RULES, SamplingConfig, greedy_rule, verify_rows
from .attention import (
    KERNELS,
    AttentionPlan,
    attention_forward,
    auto_kernel,
    require_exact_ops,
    tree_attention_enabled,
)
from .cache import CacheCapacityError, TreeKVCache
from .compiled import CompiledForward
from .drafting import Drafter, Proposal, RootOnlyDrafter, SequenceStart
from .forward import full_forward, output_logits
from .native import STEPS, NativeStep, int8_reason
from .native import unsupported_reason as native_unsupported
from .packed import MODES as LINEAR_MODES
from .packed import packed_linears, shared_forward, weights_key
from .pricing import StepPricer
from .processing import TreeLogitsProcessing
from .stats import GenerationStats
from .support import check_attention_calls, check_layers, check_logits, window_of
from .tree import Tree

# In int8 numerics a prompt prefills through the native step (its linears, the fast attention kernel in
# query tiles), in calls of at most this many tokens, each after the ones before it (a whole number of the
# attention's 64-key tiles, so from an empty cache the chunks give the bits of one call; the step's buffers
# stay those of 1024 rows). Above 1024 tokens it used to take the HF forward, whose attention had been
# faster there on the AVX2 EPYC (benchmarks/log/2026-12-06-i-int8-prefill.md) before the native step's
# attention ran in query tiles; on the Zen 4 EPYC the chunks took 907-971 / 1842-1853 / 5285-5593 ms for
# 1200 / 2000 / 4000 tokens against 1737-1815 / 3226-3469 / 9073-9492 through the HF forward
# (benchmarks/log/2026-12-07-g-kv-bf16.md).
NATIVE_PREFILL_CHUNK = 1024
# In the other numerics, where the native step decodes, a prompt of at most this many new tokens (a short
# question, a conversation's next message) prefills through it too, in one call; longer ones through the HF
# forward, whose linears multiply through oneDNN copies of the weights' float32 values, faster from ~50 rows.
# On the Zen 4 EPYC (benchmarks/log/2026-12-07-h-positions-prefill.md) the native step took 0.67x / 0.80x /
# 0.95x the HF forward's time for 10 / 25 / 50 tokens in fast numerics (0.63x / 0.73x / 0.89x in bitwise),
# and 1.26-1.5x it for 100-768 tokens.
NATIVE_PREFILL_MAX = 48


@dataclass
class DecodeStep:
    """One step over the live rows: per row, its cache row, the verified tree's tokens, the accepted
    nodes and the committed tokens; the phase timings of the step."""

    rows: list[int]  # cache rows (= prompt indices) that took part
    tokens: list[list[int]]  # per row: [N] the candidate tree's tokens
    draft_probs: list[list[float]] | None  # per row: [N] the drafter's probability of each node's token
    tree: Tree  # the step's tree (the drafter's static one, this step's dynamic one, or the root alone)
    expected_accept: float | None  # the drafter's predicted accepted length, if it made one
    paths: list[list[int]]  # per row: accepted nodes, root first
    committed: list[list[int]]  # per row: the accepted nodes' tokens after the root, then the bonus
    bonuses: list[int]  # per row: the base model's own token after the last accepted node (next root)
    seconds_draft: float
    seconds_verify: float
    seconds_commit: float

    @property
    def nodes(self) -> int:
        """Tree nodes verified per row (1: a plain step)."""
        return self.tree.num_nodes

    def as_trace(self, row: int = 0) -> dict:
        """Row `row`'s part of the step as a trace entry (`treespec.tools.trace`)."""
        entry = {
            "tokens": self.tokens[row],
            "draft_probs": None if self.draft_probs is None else self.draft_probs[row],
            "path": self.paths[row],
            "bonus": self.bonuses[row],
        }
        if self.expected_accept is not None:
            entry["expected_accept"] = self.expected_accept
        entry["choices"] = [list(c) for c in self.tree.choices]
        return entry


def check_settings(linears: str, acceptance: str, kernel: str, plain_above="auto") -> None:
    """Refuse an unknown linear mode, acceptance rule or attention kernel, and a bad `plain_above`."""
    if plain_above not in ("auto", None) and (
        isinstance(plain_above, bool) or not isinstance(plain_above, int) or plain_above < 0
    ):
        raise ValueError(f'plain_above must be a row count >= 0, None or "auto", got {plain_above!r}')
    if linears not in LINEAR_MODES:
        raise ValueError(f"unknown linears mode {linears!r}; choose one of {LINEAR_MODES}")
    if acceptance not in RULES:
        raise ValueError(f"unknown acceptance rule {acceptance!r}; choose one of {RULES}")
    if kernel not in KERNELS and kernel != "auto":
        raise ValueError(f"unknown attention kernel {kernel!r}; choose one of {['auto', *sorted(KERNELS)]}")


def position_limit(model, max_length: int | None) -> int | None:
    """The most positions a sequence may take: `max_length`, else the model's max_position_embeddings
    (None: neither says)."""
    return max_length or getattr(model.config, "max_position_embeddings", None)


def positions_needed(
    model, prompt_tokens: int, max_new_tokens: int, tree_nodes: int, max_length: int | None, prompt: str
) -> int:
    """Cache slots a sequence needs: its prompt and new tokens, plus one tree block (storage only: near the
    model's position limit the decoder verifies the root alone, `Decoder._speculate`, so no node takes a
    position past it). Refuses a prompt + max_new_tokens the model cannot hold, as plain decoding would.
    prompt: how the error names the prompt ("the prompt", "prompt 3")."""
    limit = position_limit(model, max_length) or 1 << 30
    sequence = prompt_tokens + max_new_tokens
    if sequence > limit:
        raise CacheCapacityError(
            f"{prompt} has {prompt_tokens} tokens; with max_new_tokens={max_new_tokens} the sequence needs "
            f"{sequence} positions but the limit is {limit}: shorten {prompt} or lower max_new_tokens"
        )
    return sequence + tree_nodes


NUMERICS = ("fast", "bitwise", "int8")
KV_DTYPES = ("model", "bfloat16")


def numerics_settings(numerics: str, kernel: str, linears: str, compile: bool, param) -> tuple[str, str]:
    """The (attention kernel, linear mode) a `numerics` setting runs: "fast" keeps the given ones;
    "bitwise" takes the row-invariant kernels (`exact` attention and linears), so every verified node gets
    the bits a one-token forward gives it and speculation never changes the plain loop's text. "int8" is
    "bitwise" with int8 activations in every linear of the native step (`core.native`, csrc/int8_linear.h):
    row-invariant too, so speculation never changes the int8 plain loop's text either."""
    if numerics not in NUMERICS:
        raise ValueError(f"unknown numerics {numerics!r}; choose one of {NUMERICS}")
    if numerics == "fast":
        return kernel, linears
    if kernel not in ("auto", "exact") or linears not in ("auto", "exact"):
        raise ValueError(
            f'numerics="{numerics}" runs its own attention and linear kernels; leave kernel and linears at '
            f'"auto" (got kernel={kernel!r}, linears={linears!r})'
        )
    if compile:
        raise ValueError(
            f'numerics="{numerics}" runs eagerly: torch.compile may pick other loop orders per shape; '
            "pass compile=False"
        )
    require_exact_ops(param)
    return "exact", "exact"


def kv_storage_dtype(kv_dtype: str, numerics: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype the cache stores K/V in for `kv_dtype` ("model" or "bfloat16"). bf16 K/V of a float32 model
    are each rounded once where they are written and widened exactly where attention reads them; that is
    another text than float32 K/V give, so it takes the row-invariant numerics ("bitwise", "int8"), where
    speculation still never changes the plain loop's text."""
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"unknown kv_dtype {kv_dtype!r}; choose one of {KV_DTYPES}")
    if kv_dtype == "model" or model_dtype == torch.bfloat16:
        return model_dtype
    if model_dtype != torch.float32:
        raise ValueError(f'kv_dtype="bfloat16" takes a float32 or bfloat16 model, not {model_dtype}')
    if numerics == "fast":
        raise ValueError(
            'kv_dtype="bfloat16" rounds the K/V, so a float32 model no longer gives its float32 text: it '
            'runs with numerics="int8" or "bitwise" (speculation then keeps the plain loop\'s text bit for '
            'bit); use kv_dtype="model" with numerics="fast"'
        )
    return torch.bfloat16


@contextlib.contextmanager
def decoding_mode(model, linears: str):
    """The model's mode for treespec's forwards: tree attention, and packed linears when asked."""
    with tree_attention_enabled(model), packed_linears(model, mode=linears):
        yield


def synchronized_clock(device: torch.device) -> Callable[[], float]:
    """Wall time that waits for the device first (CUDA), so phases are not mis-attributed."""
    if device.type != "cuda":
        return time.perf_counter

    def clock() -> float:
        torch.cuda.synchronize(device)
        return time.perf_counter()

    return clock


def last_hidden(hidden: torch.Tensor, paths: list[list[int]]) -> torch.Tensor:
    """Each row's hidden state at the last node of its accepted path: hidden [A, N, H] -> [A, H] (a view
    when every path ends at the same node, as in a plain step)."""
    last = [p[-1] for p in paths]
    if all(node == last[0] for node in last):
        return hidden[:, last[0]]
    index = torch.tensor(last, device=hidden.device)  # [A]
    return hidden[torch.arange(len(paths), device=hidden.device), index]


class Decoder:
    """Tree-speculative decoding of B sequences at once (B = 1: one) over one preallocated cache."""

    position_limit: int | None = None  # the most positions a sequence takes (set by `prefill`)
    cache: TreeKVCache | None = None  # allocated by `prefill`
    hidden: torch.Tensor | None = None  # [A, H] at each live row's last committed token
    roots: torch.Tensor | None = None  # [A] each live row's next root token
    processing: TreeLogitsProcessing | None = None  # a repetition penalty / logits processors (`prefill`)
    native: NativeStep | None = None  # the native step's scorer when steps run natively (`_use_step`)
    _windowed = False  # the sequence passes the model's sliding window (`_follow_window`)

    def __init__(
        self,
        model,
        drafter: Drafter | None = None,
        *,
        sampling: SamplingConfig | None = None,
        acceptance: str | None = None,
        seed: int | None = None,
        kernel: str = "auto",
        linears: str = "auto",
        compile: bool = False,
        plain_above: int | str | None = None,
        pricer: StepPricer | None = None,
        clock: Callable[[], float] | None = None,
        numerics: str = "fast",
        step: str = "auto",
        reuse_prefix: bool = False,
        kv_dtype: str = "model",
    ):
        """sampling: how tokens are chosen (temperature, top-k/p, the acceptance rule, the seed);
        acceptance / seed override its `acceptance` / `seed`. linears: how the model's linear layers run
        (`core.packed`): "auto" (exact block weights where the weights are such, else oneDNN prepacked),
        "onednn" or "torch"; CPU only. compile: verify through torch.compile (`core.compiled`; the first
        step of each size class compiles); drafters with their own scorer keep it. plain_above: verify the
        root alone while more rows than this are live; None: always speculate; "auto": a batch of several
        rows takes the kind of step a `StepPricer` measured to pay at its row count (`pricer`, default
        the one for this drafter setting in the model's `TargetRuntime`). clock: the step timer (default:
        wall time, synchronising CUDA only where a pricer reads the timings). numerics: "fast", "bitwise"
        (row-invariant kernels: the same text as the plain loop) or "int8" (row-invariant int8 activations
        in the native step; `numerics_settings`). reuse_prefix: a prompt that starts with tokens this
        decoder's cache still holds from its last sequence (the next turn of a conversation: the history,
        the reply, the new message) prefills only the tokens after them (`prefill`); one prompt at a time,
        not with a drafter that reads the target's features or brings its own scorer. kv_dtype: the cache's
        K/V dtype, "model" or "bfloat16" (`kv_storage_dtype`)."""
        self.sampling = sampling or SamplingConfig()
        self.acceptance = acceptance or self.sampling.acceptance
        check_settings(linears, self.acceptance, kernel, plain_above)
        param = next(model.parameters())
        kernel, linears = numerics_settings(numerics, kernel, linears, compile, param)
        self.kv_dtype = kv_storage_dtype(kv_dtype, numerics, param.dtype)
        self.model, self.device, self.linears, self.numerics = model, param.device, linears, numerics
        self.drafter = drafter or RootOnlyDrafter()
        self.tree, self.root_tree = self.drafter.tree, Tree.from_choices([])
        self.kernel = auto_kernel(self.device, param.dtype) if kernel == "auto" else kernel
        self.plan = AttentionPlan.for_tree(self.tree, self.kernel, self.device)
        self._layouts: dict[Tree, tuple] = {}  # tree -> (plan, children, depth [N]), bounded
        self.feature_layers = tuple(self.drafter.feature_layers)  # the target's states the drafter reads
        own_scorer = self.drafter.scorer()
        if own_scorer is not None and self.feature_layers:
            raise ValueError("a drafter that reads the target's features cannot bring its own scorer")
        self.step_requested, self.compile = step, compile
        self._use_step(self._step_kind(step, model, linears, compile, own_scorer is not None), own_scorer)
        # a kept prefix needs nothing from its tokens but their K/V: not so for a drafter that reads the
        # target's features at every prompt token, or one that verifies through its own scorer
        self.reuse_prefix = reuse_prefix and own_scorer is None and not self.feature_layers
        self.plain_above, self.pricer = plain_above, None
        if plain_above == "auto" and self.tree.num_nodes > 1 and not self.drafter.prices_steps:
            key = (type(self.drafter).__name__, self.tree, self.kernel, compile, linears)
            self.pricer = pricer or StepPricer.shared(model, key)
        self.clock = clock or synchronized_clock(self.device if self.pricer else torch.device("cpu"))
        seed = self.sampling.seed if seed is None else seed
        self.generator = None if seed is None else torch.Generator(self.device).manual_seed(seed)
        self.live: list[int] = []  # cache rows still decoding, in the drafter's row order
        self.stats: list[GenerationStats] = []  # per cache row
        # per cache row: the tokens whose K/V its cache holds, in order (kept with `reuse_prefix` only)
        self.held: list[list[int]] = []
        self._held_weights: tuple | None = None  # the weights those K/V came from (`weight_key`s)
        self._in_mode = False  # inside `running()` (a loop holds the mode over its steps)

    def _use_step(self, kind: str, own_scorer) -> None:
        """Run `kind` ("native" or "hf") steps: `scorer` verifies trees (the drafter's own scorer when it
        brings one), `plain_scorer` the root alone."""
        self.step_kind, self.native = kind, None
        if kind == "native":
            exact, int8 = self.kernel == "exact", self.numerics == "int8"
            default = self.native = NativeStep(self.model, exact=exact, int8=int8)
        elif self.compile:
            default = CompiledForward(self.model, self.linears)
        else:
            default = partial(full_forward, self.model)
        self.scorer, self.plain_scorer = own_scorer or default, default
        if self.feature_layers:
            self.scorer = self.plain_scorer = partial(self.scorer, feature_layers=self.feature_layers)

    def _follow_window(self, sequence: int) -> None:
        """A sequence of `sequence` positions past the model's sliding window: the native step, which sees
        the whole prefix, gives way to transformers' forward (step="auto") or refuses; bitwise numerics
        have no row-invariant kernel for a window and refuse."""
        window = window_of(self.model)
        self._windowed = window is not None and sequence > window  # the layers must apply the window
        if not self._windowed:
            return
        if self.numerics != "fast":
            kind = f'numerics="{self.numerics}"'
        elif self.native is not None and self.step_requested == "native":
            kind = 'step="native"'
        else:
            if self.native is not None:
                self._use_step("hf", None)
            return
        raise ValueError(
            f"this model's sliding-window layers see only the last {window} positions, which {kind} does "
            f'not follow: keep prompt + max_new_tokens at most {window}, or decode with numerics="fast" and '
            'step="auto"'
        )

    def _step_kind(self, step: str, model, linears: str, compile: bool, own_scorer: bool) -> str:
        """ "native" or "hf": what `step` means for this model and these settings (refuses an impossible
        "native" with the reason)."""
        if step not in STEPS:
            raise ValueError(f"unknown step {step!r}; choose one of {STEPS}")
        if self.numerics == "int8":
            reason = native_unsupported(model, self.kernel, linears, compile, own_scorer)
            reason = reason or int8_reason(model)
            if step == "hf" or reason is not None:
                raise ValueError(
                    'numerics="int8" runs in the native step, which '
                    + ("step='hf' turns off" if step == "hf" else f"cannot run here: {reason}")
                    + '; use numerics="fast" or "bitwise"'
                )
            return "native"
        if step == "hf":
            return "hf"
        reason = native_unsupported(model, self.kernel, linears, compile, own_scorer)
        if reason is not None and step == "native":
            raise ValueError(f'step="native" cannot run here: {reason}; use step="hf" (or "auto")')
        return "hf" if reason is not None else "native"

    @contextlib.contextmanager
    def running(self):
        """The model's mode for treespec's forwards (`decoding_mode`); entered once when nested (a loop
        that holds it over its steps pays for it once, not every step)."""
        if self._in_mode:
            yield
            return
        with decoding_mode(self.model, self.linears):
            self._in_mode = True
            try:
                yield
            finally:
                self._in_mode = False

    def capacity(self, prompt_tokens: int, max_new_tokens: int, max_length: int | None = None) -> int:
        """Cache positions one sequence needs (`positions_needed`)."""
        return positions_needed(
            self.model, prompt_tokens, max_new_tokens, self.tree.num_nodes, max_length, "the prompt"
        )

    @torch.inference_mode()
    def prefill(
        self, prompts: list[list[int]] | list[int], max_new_tokens: int, max_length: int | None = None
    ) -> list[int]:
        """Start B sequences: encode each prompt alone into its cache row (no padding), sample each row's
        first token, start the drafter row by row. Returns the first token of every row. One prompt (a
        list of ints) is a batch of one. The cache is allocated here (reused when it fits), never in
        `step`."""
        prompts = [prompts] if prompts and isinstance(prompts[0], int) else prompts
        if not prompts:
            raise ValueError("prefill needs at least one prompt")
        B = len(prompts)
        if B > 1 and not self.drafter.batched:
            raise ValueError(
                f"{type(self.drafter).__name__} drafts for one sequence at a time (it keeps a cache or a "
                "verification of its own): decode a batch with heads, EAGLE, suffix trees, recycling, "
                "prompt lookup (or a TreePlanner of those) or plain decoding, or these prompts one by one"
            )
        names = ["the prompt"] if B == 1 else [f"prompt {i}" for i in range(B)]
        needed = max(
            positions_needed(self.model, len(p), max_new_tokens, self.tree.num_nodes, max_length, name)
            for p, name in zip(prompts, names, strict=True)
        )
        self.position_limit = position_limit(self.model, max_length)
        check_layers(self.model)
        check_logits(self.model)
        self._follow_window(max(len(p) for p in prompts) + max_new_tokens)
        self.processing = TreeLogitsProcessing.of(self.sampling)  # None unless asked for
        weights = weights_key(self.model) if self.reuse_prefix else None
        kept = self._kept_prefix(prompts, weights)
        if self.cache is None or self.cache.max_len < needed or self.cache.num_rows != B:
            capacity = needed
            if self.reuse_prefix:  # room for the next turns: a conversation's cache grows rarely
                capacity = max(needed, min(2 * needed, position_limit(self.model, max_length) or needed))
            old = self.cache
            self.cache = TreeKVCache.for_model(
                self.model, capacity, B, spec_reserve=self.tree.num_nodes, dtype=self.kv_dtype
            )
            # "compiled" and "exact": the fused commit (when the extension is there); the others: torch
            self.cache.fused_commit = None if self.kernel in ("compiled", "exact") else False
            if kept:
                self.cache.copy_prefix(old, kept)  # a conversation outgrew its cache: its history moves
            if old is not None:
                old.release()
        if kept:
            self.cache.rollback_rows([0], [kept])  # what follows the kept prefix is dropped by pointer
        else:
            self.cache.reset()
        self.held = [list(p) for p in prompts] if self.reuse_prefix else []
        self._held_weights = weights
        if self.native is not None:
            with self.running():  # the packing (exact blocks) the native model reads
                self.native.refresh()
        self.stats = [
            GenerationStats(prompt_tokens=len(p), prompt_reused=kept, max_depth=self.tree.max_depth)
            for p in prompts
        ]
        hidden, roots = [], []
        for row, prompt in enumerate(prompts):
            t0 = self.clock()
            state, root = self._prefill_row(row, prompt, needed, kept)
            hidden.append(state)
            roots.append(root)
            self.stats[row].time_prefill = self.clock() - t0
        self.live = list(range(B))
        self.hidden = torch.stack(hidden)  # [B, H]
        self.roots = torch.tensor(roots, device=self.device)  # [B]
        return roots

    def _kept_prefix(self, prompts: list[list[int]], weights: tuple | None) -> int:
        """How many leading tokens of the one prompt the cache already holds K/V for, from this decoder's
        last sequence (`reuse_prefix`), at most all but its last token (whose forward gives the first new
        token); 0 when nothing can be kept (a batch, no cache, K/V of other weights)."""
        if not (
            self.reuse_prefix
            and len(prompts) == 1
            and self.cache is not None
            and self.cache.num_rows == 1
            and self.held
            and weights == self._held_weights
        ):
            return 0
        held, prompt = self.held[0], prompts[0]
        limit = min(len(held), len(prompt) - 1, self.cache.lengths[0])
        kept = 0
        while kept < limit and held[kept] == prompt[kept]:
            kept += 1
        return kept

    def _prefill_row(
        self, row: int, prompt: list[int], capacity: int, start: int = 0
    ) -> tuple[torch.Tensor, int]:
        """One prompt into cache row `row`, whose cache holds its first `start` tokens already: (hidden [H]
        at its last token, its first token)."""
        # the native step, NATIVE_PREFILL_CHUNK tokens a call (int8; other numerics up to NATIVE_PREFILL_MAX
        # new tokens); otherwise the HF forward in one call, its linears in their fastest form per row count
        # (plain and trees share it)
        native = self.native is not None and (
            self.numerics == "int8" or len(prompt) - start <= NATIVE_PREFILL_MAX
        )
        chunk = NATIVE_PREFILL_CHUNK if native else len(prompt) - start
        parts = []  # [1, n, F] per call, for a drafter that reads the target's features
        with self.running(), contextlib.nullcontext() if native else shared_forward(self.model):
            for begin in range(start, len(prompt), chunk):
                end = min(len(prompt), begin + chunk)
                ids = torch.tensor([prompt[begin:end]], device=self.device)  # [1, n]
                positions = torch.arange(begin, end, device=self.device)[None]  # [1, n]
                self.cache.begin([row], end - begin)
                plan = self.cache.attention_plan(AttentionPlan(self.kernel))
                if native:
                    out = self.native(ids, positions, self.cache, plan, self.feature_layers, exact=False)
                else:
                    with attention_forward(plan) as record:
                        out = full_forward(self.model, ids, positions, self.cache, plan, self.feature_layers)
                if self.feature_layers:
                    out, chunk_features = out
                    parts.append(chunk_features)
                self.cache.check_written()
                if not native:  # a model attending without treespec's attention verifies no tree
                    speculating, writes = self.tree.num_nodes > 1, self.cache.writes
                    check_attention_calls(
                        self.model, record, writes, speculating, self.compile, self._windowed
                    )
                self.cache.commit_all()
            last = out[0, -1]  # out [1, n, H] -> [H]
            logits = self.logits(last) if native else output_logits(self.model, last)  # [V]
        features = torch.cat(parts, dim=1) if parts else None  # [1, P - start, F]
        if self.processing is not None:  # at the prompt's tokens
            self.processing.start(row, prompt)
            logits = self.processing.apply(logits[None, None], [row], [[prompt[-1]]], [-1])[0, 0]  # [V]
        root = self.sampling.sample(logits, self.generator)
        if self.processing is not None:
            self.processing.extend(row, [root])
        rows = self.cache.num_rows
        self.drafter.start(
            SequenceStart(list(prompt) + [root], capacity, self.cache, self.kernel, features, row, rows)
        )
        return last, root

    def _speculate(self, rows: int) -> bool:
        """Whether the next step over `rows` live rows verifies a tree (else the root alone). Near the
        position limit the root alone: a tree node never takes a position the model does not have."""
        if self.position_limit is not None:
            longest = max(self.cache.lengths[row] for row in self.live)
            if longest + self.tree.max_depth >= self.position_limit:
                return False
        if self.pricer is not None and self.cache.num_rows > 1:
            return self.pricer.speculate(rows)
        return not isinstance(self.plain_above, int) or rows <= self.plain_above

    @torch.inference_mode()
    def step(self) -> DecodeStep:
        """One step over the live rows: propose a tree per row, verify all of them in one forward, commit
        each row's accepted branch."""
        if not self.live:
            raise RuntimeError("Decoder.step() needs live rows: call prefill(prompts, max_new_tokens) first")
        rows, speculate = list(self.live), self._speculate(len(self.live))
        with self.running():
            t0 = self.clock()
            if speculate:
                proposal = self.drafter.propose(self.hidden, self.roots, None)  # tokens [A, N]
            else:
                proposal = Proposal(self.roots[:, None])  # [A, 1]
            tree = proposal.tree or (self.tree if speculate else self.root_tree)
            plan, children, depth = self.layout(tree)
            t1 = self.clock()
            scorer = self.scorer if speculate else self.plain_scorer
            hidden_tree, features = self._forward(rows, proposal.tokens, plan, depth, scorer)  # [A, N, H]
            logits, best = self.verified_logits(hidden_tree)  # [A, N, V], [A, N] or None
            tokens = proposal.tokens.tolist()
            if self.processing is not None:  # each node's logits at its own sequence
                logits = self.processing.apply(logits, rows, tokens, tree.parents.tolist())  # [A, N, V]
            verified = verify_rows(
                self.acceptance, tokens, children, logits, self.sampling, self.generator, best
            )
            paths, bonuses = [v[0] for v in verified], [v[1] for v in verified]
            t2 = self.clock()
            self.cache.commit(paths)
            if self.reuse_prefix:
                for row, row_tokens, path in zip(rows, tokens, paths, strict=True):
                    self.held[row].extend(row_tokens[i] for i in path)  # the root and its accepted branch
            self.hidden = last_hidden(hidden_tree, paths)  # [A, H]
            self.roots = torch.tensor(bonuses, device=self.device)  # [A]
            t3 = self.clock()
        committed = [[tokens[a][i] for i in p[1:]] + [bonuses[a]] for a, p in enumerate(paths)]
        if self.processing is not None:
            for row, row_committed in zip(rows, committed, strict=True):
                self.processing.extend(row, row_committed)
        self.drafter.observe(committed, self._accepted_features(features, paths))
        if speculate and self.drafter.target_topk > 0:  # what the target said after every verified node
            self.drafter.verified(proposal.tokens, logits.topk(self.drafter.target_topk, dim=-1).indices)
        # what the drafter does in observe (e.g. an EAGLE layer's pass) counts as drafting
        t_draft = (t1 - t0) + (self.clock() - t3)
        if self.pricer is not None and self.cache.num_rows > 1:
            self.pricer.record(len(rows), speculate, t_draft + (t3 - t1), sum(map(len, paths)) / len(paths))
        for row, path in zip(rows, paths, strict=True):
            self.stats[row].record_step(
                len(path), t_draft, t2 - t1, t3 - t2, proposal.expected_accept, tree.num_nodes
            )
        probs = None if proposal.probs is None or not speculate else proposal.probs.float().tolist()
        return DecodeStep(
            rows, tokens, probs, tree, proposal.expected_accept, paths, committed, bonuses,
            t_draft, t2 - t1, t3 - t2,
        )  # fmt: skip

    def verified_logits(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A verification's logits [A, N, V] (every step's pass here) and, when the native lm_head takes
        it (greedy acceptance, no logits processing), their argmax [A, N] (else None)."""
        greedy = greedy_rule(self.acceptance, self.sampling)
        if self.native is not None and greedy and self.processing is None:
            return self.native.logits_argmax(hidden)
        return self.logits(hidden), None

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The base model's logits of verified hidden states [..., H] -> [..., V] (the native step's own
        lm_head when it runs, else the model's)."""
        return self.native.logits(hidden) if self.native is not None else output_logits(self.model, hidden)

    def _forward(
        self, rows: list[int], tokens: torch.Tensor, plan: AttentionPlan, depth: torch.Tensor, scorer
    ):
        """`scorer` over tokens [A, N] at each row's committed end: (hidden [A, N, H], features [A, N, F] or
        None); the nodes' K/V stay pending in the cache."""
        self.cache.begin(rows, tokens.shape[1])
        positions = self.cache.positions(depth)  # [A, N]
        plan = self.cache.attention_plan(plan)
        with attention_forward(plan):  # the plan, for a model whose layers do not pass it on
            out = scorer(tokens, positions, self.cache, plan)
        return out if self.feature_layers else (out, None)

    def _accepted_features(self, features: torch.Tensor | None, paths: list[list[int]]):
        """Each row's features at its accepted nodes, padded to the longest path: [A, m, F] (or None)."""
        if features is None:
            return None
        longest = max(len(p) for p in paths)
        index = torch.tensor([p + [p[-1]] * (longest - len(p)) for p in paths], device=self.device)
        return features[torch.arange(len(paths), device=self.device)[:, None], index]  # [A, m, F]

    def layout(self, tree: Tree) -> tuple[AttentionPlan, list[list[int]], torch.Tensor]:
        """(attention plan, children of each node, depth [N] on the device) of a step's tree; a dynamic
        tree is checked against the cache's speculative block and its layout kept for the next time."""
        cached = self._layouts.get(tree)
        if cached is None:
            if tree.num_nodes > self.tree.num_nodes or tree.max_depth > self.tree.max_depth:
                raise ValueError(
                    f"the drafter proposed a tree of {tree.num_nodes} nodes and depth {tree.max_depth} but "
                    f"declared at most {self.tree.num_nodes} nodes and depth {self.tree.max_depth} "
                    "(drafter.tree sizes the cache's speculative block and the statistics)"
                )
            if len(self._layouts) >= 512:
                self._layouts.clear()
            plan = self.plan if tree is self.tree else AttentionPlan.for_tree(tree, self.kernel, self.device)
            children = [tree.children(i) for i in range(tree.num_nodes)]
            cached = self._layouts[tree] = (plan, children, tree.depth.to(self.device))
        return cached

    @torch.inference_mode()
    def score(self, tokens: torch.Tensor, scorer=None) -> torch.Tensor:
        """Verification logits of the live rows' candidate trees without committing anything (for
        measurements): tokens [A, N] in the drafter tree's node order -> logits [A, N, V]; the block is
        rolled back after. scorer: the forward to use (default: the decoder's own)."""
        if not self.live:
            raise RuntimeError(
                "Decoder.score() needs a sequence: call prefill(prompts, max_new_tokens) first"
            )
        rows = list(self.live)
        lengths = [self.cache.lengths[r] for r in rows]
        _, _, depth = self.layout(self.tree)
        with self.running():
            self.cache.begin(rows, tokens.shape[1])
            positions = self.cache.positions(depth)  # [A, N]
            hidden = (scorer or self.scorer)(
                tokens, positions, self.cache, self.cache.attention_plan(self.plan)
            )
            if isinstance(hidden, tuple):  # (hidden, features) for a drafter that reads features
                hidden = hidden[0]
            logits = self.logits(hidden)  # [A, N, V]
        self.cache.rollback_rows(rows, lengths)
        return logits

    def drop_rows(self, rows: list[int]) -> None:
        """Rows (cache rows) that stopped: they leave the batch and cost no more work."""
        done = set(rows)
        keep = [a for a, row in enumerate(self.live) if row not in done]
        if len(keep) == len(self.live):
            return
        self.live = [self.live[a] for a in keep]
        if self.live:
            index = torch.tensor(keep, dtype=torch.long, device=self.device)
            self.hidden, self.roots = self.hidden[index], self.roots[index]
            self.drafter.keep_rows(keep)

    def close_row(self, row: int, new_tokens: int, started: float) -> GenerationStats:
        """Close one row's statistics: its tokens, the time since `started` (a `clock()` reading), the
        cache memory and the drafter's report."""
        stats = self.stats[row]
        stats.new_tokens = new_tokens
        stats.time_total = self.clock() - started
        stats.cache_memory = self.cache.memory_bytes() if self.cache is not None else {}
        report = self.drafter.report()
        stats.draft_cache_memory, stats.drafter = report.cache_memory, report.stats
        return stats

    def release(self) -> None:
        """Done decoding: the cache's memory goes to the model's runtime for the next decoder's cache
        (`TreeKVCache.release`); a later `prefill` allocates a cache again."""
        if self.cache is not None:
            self.cache.release()
            self.cache = None
