"""Decoding a batch of sequences together: one forward over B candidate trees, each row its own path.

    prefill(prompts)   each prompt alone (no padding, nothing recomputed), into its row of a BatchKVCache
    step():
        proposal = drafter.propose(hidden [A, H], roots [A])     # [A, N] one tree per live row
        hidden_tree = forward(tokens [A, N], positions c_row + depth, rows)   # K/V at each row's own end
        per row: path, bonus = acceptance rule over its logits    # rows accept different lengths
        cache.commit(paths)                                       # each row advances by its own count
    finish(rows)       rows that stopped leave the batch: later forwards run over the live rows only

Row a of a forward reads only its own cache row (`AttentionPlan.rows` / `prefix_lens`), so a row's tokens
are what it would get decoded alone (greedy; in float32 up to the rounding of batched matrix products).

A speculative step verifies A x N rows where a plain step verifies A: once the live rows fill the
machine's matrix units, more rows per step cost nearly their full price and speculation stops paying.
`plain_above` sets the row count above which steps verify the root alone (plain batched decoding);
"auto" (`StepPricer`) times both kinds of step on this machine as the batch runs and takes the one that
commits more tokens per second at the current row count.
"""

from __future__ import annotations

import weakref
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass
from functools import partial

import torch

from ..drafters.base import Drafter, RootOnlyDrafter, SequenceStart
from .acceptance import SamplingConfig, verify
from .attention import AttentionPlan, auto_kernel
from .batch_cache import BatchKVCache
from .compiled import CompiledForward
from .decoder import (
    check_settings,
    decoding_mode,
    device_clock,
    full_forward,
    output_logits,
    positions_needed,
)
from .stats import GenerationStats
from .tree import Tree


class StepPricer:
    """Chooses plain or speculative steps from their measured cost at each live-row count.

    Per row count A it keeps a moving average of the seconds of a speculative and of a plain step (the
    first step of each kind is a warm-up and is not kept: a drafter's first call pays for its
    allocations), and the mean accepted length E per row over the rows of the last `window`
    speculative steps (at least `min_accepted` rows before choosing: one step of a batch of 4). A
    speculative step commits E tokens per row where a plain one commits 1, so it pays while
    E x t_plain(A) > t_spec(A).

    A row count not measured yet is inferred where it can be: speculation pays less as more rows share a
    step, so a loss measured at fewer rows (or a win at more) decides it; otherwise the nearest count
    measured within a factor of two decides it when it won there by at least `margin` (a batch whose rows
    finish one by one explores about log2(B) counts, not B). A count with nothing to infer from, or
    only a close call nearby, tries both kinds.

    The kind not chosen runs once after `recheck` steps and its estimate is replaced by what it costs
    now, so the estimates follow the machine and the text. A recheck that confirms the choice by a
    clear margin (`margin`) doubles the wait (up to `max_recheck`); otherwise the wait starts again.

    `StepPricer.shared(model, key)` keeps one pricer per model and drafter setting for the process, so a
    batch starts from what earlier batches measured instead of exploring again."""

    _shared: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {key: StepPricer}

    @classmethod
    def shared(cls, model, key: Hashable) -> StepPricer:
        """The process's pricer for `model` and `key` (the drafter's kind and tree, kernel, compile ...)."""
        return cls._shared.setdefault(model, {}).setdefault(key, cls())

    def __init__(
        self,
        recheck: int = 32,
        smoothing: float = 0.3,
        max_recheck: int = 256,
        window: int = 64,
        min_accepted: int = 4,
        margin: float = 1.1,
    ):
        self.recheck, self.smoothing, self.max_recheck = recheck, smoothing, max_recheck
        self.min_accepted, self.margin = min_accepted, margin
        self.seconds: dict[tuple[int, bool], float] = {}  # (rows, speculative) -> seconds per step
        self.samples: dict[tuple[int, bool], int] = {}  # steps kept per key
        self.warmed: set[bool] = set()  # the kinds whose warm-up step ran
        # per speculative step: (tokens accepted over its rows, its rows)
        self.accepted: deque[tuple[float, int]] = deque(maxlen=window)
        self.steps = 0
        self.interval = recheck  # steps until the next recheck
        self.next_recheck = recheck
        self.rechecking: tuple[int, bool] | None = None  # (rows, the choice a recheck step questions)

    @property
    def accept(self) -> float:
        """Mean accepted length per row over the rows of the recent speculative steps."""
        rows = self.accepted_rows
        return sum(total for total, _ in self.accepted) / rows if rows else 1.0

    @property
    def accepted_rows(self) -> int:
        return sum(rows for _, rows in self.accepted)

    def speculate(self, rows: int) -> bool:
        """Whether the next step over `rows` live rows should be speculative."""
        self.steps += 1
        best = self.best(rows)
        if best is None:  # measure what is missing: speculative steps first, then plain ones
            return not self.measured(rows, True) or self.accepted_rows < self.min_accepted
        if self.steps >= self.next_recheck:
            self.rechecking = (rows, best)
            return not best
        return best

    def best(self, rows: int) -> bool | None:
        """Whether speculation pays at `rows` rows: measured there, inferred from other row counts, or
        None (unknown)."""
        if self.accepted_rows < self.min_accepted:
            return None
        if self.measured(rows, True) and self.measured(rows, False):
            return self.pays(rows)
        measured = [
            r for (r, spec) in self.seconds if spec and self.measured(r, True) and self.measured(r, False)
        ]
        if any(r <= rows and not self.pays(r) for r in measured):
            return False
        if any(r >= rows and self.pays(r) for r in measured):
            return True
        near = [r for r in measured if r <= 2 * rows and rows <= 2 * r]
        if near:  # the nearest count decides only a clear case; a close call is measured here
            nearest = min(near, key=lambda r: (abs(r - rows), r))
            if self.ratio(nearest) >= self.margin:
                return self.pays(nearest)
        return None

    def measured(self, rows: int, speculative: bool) -> bool:
        """Whether the kind has a kept measurement at this row count (a step after its warm-up)."""
        return self.samples.get((rows, speculative), 0) >= 1

    def pays(self, rows: int) -> bool:
        return self.accept * self.seconds[(rows, False)] > self.seconds[(rows, True)]

    def ratio(self, rows: int) -> float:
        """Tokens per second of the better kind over the other's, at a measured row count (>= 1)."""
        gain = self.accept * self.seconds[(rows, False)] / self.seconds[(rows, True)]
        return max(gain, 1 / gain)

    def record(self, rows: int, speculative: bool, seconds: float, accepted: float) -> None:
        """One step over `rows` rows took `seconds`; a speculative one accepted `accepted` tokens per row."""
        key, a = (rows, speculative), self.smoothing
        if speculative:
            self.accepted.append((accepted * rows, rows))
        if speculative not in self.warmed:  # the warm-up: its time is not kept
            self.warmed.add(speculative)
            return
        self.samples[key] = self.samples.get(key, 0) + 1
        rechecked = self.rechecking is not None and self.rechecking == (rows, not speculative)
        if self.samples[key] == 1 or rechecked:  # the first kept step, a fresh recheck
            self.seconds[key] = seconds
        else:
            self.seconds[key] = (1 - a) * self.seconds[key] + a * seconds
        if self.rechecking is not None:
            checked_rows, choice = self.rechecking
            clear = (
                checked_rows == rows
                and self.best(rows) == choice
                and self.measured(rows, True)
                and self.measured(rows, False)
                and self.ratio(rows) >= self.margin
            )
            self.interval = min(2 * self.interval, self.max_recheck) if clear else self.recheck
            self.next_recheck = self.steps + self.interval
            self.rechecking = None


@dataclass
class BatchStep:
    """One step of the batch: per live row, its cache row, the accepted nodes and the committed tokens."""

    rows: list[int]  # cache rows (= prompt indices) that took part
    paths: list[list[int]]  # per row: accepted nodes, root first
    committed: list[list[int]]  # per row: the accepted nodes' tokens after the root, then the bonus
    nodes: int  # tree nodes verified per row (1: a plain step)
    seconds_draft: float
    seconds_verify: float
    seconds_commit: float


class BatchDecoder:
    """Tree-speculative decoding of B sequences at once over one preallocated cache."""

    def __init__(
        self,
        model,
        drafter: Drafter | None = None,
        *,
        acceptance: str = "sampling",
        sampling: SamplingConfig | None = None,
        kernel: str = "auto",
        seed: int | None = None,
        linears: str = "auto",
        plain_above: int | str | None = "auto",
        compile: bool = False,
        pricer: StepPricer | None = None,
    ):
        """plain_above: verify the root alone (plain decoding) while more rows than this are live; None:
        always speculate; "auto": each step of the kind measured to pay at the current row count
        (`StepPricer`; by default the process's shared one for this model and drafter setting, or `pricer`).
        compile: steps through torch.compile (`core.compiled`, as `Decoder`; the compiled
        kernel takes each row's committed length itself). The other arguments are `Decoder`'s."""
        check_settings(linears, acceptance, kernel)
        self.drafter = drafter or RootOnlyDrafter()
        if not getattr(self.drafter, "batched", False):
            raise ValueError(
                f"{type(self.drafter).__name__} drafts for one sequence at a time (it keeps a cache or a "
                "verification of its own): decode a batch with heads, prompt lookup or plain decoding, "
                "or decode these prompts one by one"
            )
        if self.drafter.scorer() is not None:
            raise ValueError("a drafter with its own scorer (partial-layer verification) takes one sequence")
        if (
            plain_above != "auto"
            and plain_above is not None
            and (not isinstance(plain_above, int) or plain_above < 0)
        ):
            raise ValueError(f'plain_above must be a row count >= 0, None or "auto", got {plain_above!r}')
        param = next(model.parameters())
        self.model, self.device = model, param.device
        self.tree = self.drafter.tree
        self.root_tree = Tree.from_choices([])
        self.acceptance, self.sampling = acceptance, sampling or SamplingConfig()
        self.kernel = auto_kernel(self.device, param.dtype) if kernel == "auto" else kernel
        self.layouts = {
            tree: (
                AttentionPlan.for_tree(tree, self.kernel, self.device),
                [tree.children(i) for i in range(tree.num_nodes)],
                tree.depth.to(self.device),
            )
            for tree in (self.tree, self.root_tree)
        }
        self.plain_above = plain_above
        # "auto" with a tree of more than the root: price the two kinds of step on this machine
        self.pricer = None
        if plain_above == "auto" and self.tree.num_nodes > 1:
            key = (type(self.drafter).__name__, self.tree, self.kernel, compile, linears)
            self.pricer = pricer or StepPricer.shared(model, key)
        self.generator = None if seed is None else torch.Generator(self.device).manual_seed(seed)
        self.linears = linears
        self.scorer = CompiledForward(model, linears) if compile else partial(full_forward, model)
        # the target's hidden states the drafter reads (the EAGLE-style drafter); () = none
        self.feature_layers = tuple(getattr(self.drafter, "feature_layers", ()))
        if self.feature_layers:
            self.scorer = partial(self.scorer, feature_layers=self.feature_layers)
        self.cache: BatchKVCache | None = None
        self.live: list[int] = []  # cache rows still decoding, in the drafter's row order
        self.hidden: torch.Tensor | None = None  # [A, H] at each live row's last committed token
        self.roots: torch.Tensor | None = None  # [A] each live row's next root token
        self.stats: list[GenerationStats] = []

    def running(self):
        return decoding_mode(self.model, self.linears)

    def clock(self) -> float:
        return device_clock(self.device)

    @torch.inference_mode()
    def prefill(
        self, prompts: list[list[int]], max_new_tokens: int, max_length: int | None = None
    ) -> list[int]:
        """Start a batch: encode each prompt alone into its cache row (no padding), sample each row's first
        token, start the drafter row by row. Returns the first token of every row."""
        if not prompts:
            raise ValueError("prefill needs at least one prompt")
        nodes = self.tree.num_nodes
        needed = max(
            positions_needed(self.model, len(p), max_new_tokens, nodes, max_length, f"prompt {i}")
            for i, p in enumerate(prompts)
        )
        B = len(prompts)
        if self.cache is None or self.cache.max_len < needed or self.cache.num_rows != B:
            self.cache = BatchKVCache.for_model(self.model, needed, B, spec_reserve=self.tree.num_nodes)
        self.cache.reset()
        self.stats = [GenerationStats(prompt_tokens=len(p), max_depth=self.tree.max_depth) for p in prompts]
        hidden, roots = [], []
        for row, prompt in enumerate(prompts):
            t0 = self.clock()
            ids = torch.tensor([prompt], device=self.device)  # [1, P]
            self.cache.begin([row], len(prompt))
            positions = torch.arange(len(prompt), device=self.device)[None]  # [1, P]
            plan = self.cache.attention_plan(AttentionPlan(self.kernel))
            features = None  # [1, P, F] for a drafter that reads the target's features
            with self.running():
                out = full_forward(self.model, ids, positions, self.cache, plan, self.feature_layers)
                if self.feature_layers:
                    out, features = out
                logits = output_logits(self.model, out[0, -1])  # out [1, P, H] -> [V]
            self.cache.commit_all()
            root = self.sampling.sample(logits, self.generator)
            hidden.append(out[0, -1])
            roots.append(root)
            self.drafter.start(
                SequenceStart(list(prompt) + [root], needed, self.cache, self.kernel, features, row, B)
            )
            self.stats[row].time_prefill = self.clock() - t0
        self.live = list(range(B))
        self.hidden = torch.stack(hidden)  # [B, H]
        self.roots = torch.tensor(roots, device=self.device)  # [B]
        return roots

    @torch.inference_mode()
    def step(self) -> BatchStep:
        """One step over the live rows: propose a tree per row, verify all of them in one forward, commit
        each row's accepted branch."""
        if not self.live:
            raise RuntimeError("BatchDecoder.step() needs live rows: call prefill(prompts, max_new_tokens)")
        rows = list(self.live)
        if self.pricer is not None:
            speculate = self.pricer.speculate(len(rows))
        else:
            speculate = self.plain_above in (None, "auto") or len(rows) <= self.plain_above
        tree = self.tree if speculate else self.root_tree
        plan, children, depth = self.layouts[tree]
        with self.running():
            t0 = self.clock()
            if speculate:
                tokens = self.drafter.propose(self.hidden, self.roots).tokens  # [A, N]
            else:
                tokens = self.roots[:, None]  # [A, 1]
            t1 = self.clock()
            self.cache.begin(rows, tree.num_nodes)
            positions = self.cache.positions(depth)  # [A, N]
            plan = self.cache.attention_plan(plan)
            hidden_tree = self.scorer(tokens, positions, self.cache, plan)  # [A, N, H]
            features = None
            if self.feature_layers:
                hidden_tree, features = hidden_tree  # features [A, N, F]
            logits = output_logits(self.model, hidden_tree)  # [A, N, V]
            node_tokens = tokens.tolist()
            paths, bonuses = [], []
            for a in range(len(rows)):
                path, bonus = verify(
                    self.acceptance, node_tokens[a], children, logits[a], self.sampling, self.generator
                )
                paths.append(path)
                bonuses.append(bonus)
            t2 = self.clock()
            self.cache.commit(paths)
            last = torch.tensor([p[-1] for p in paths], device=self.device)  # [A]
            self.hidden = hidden_tree[torch.arange(len(rows), device=self.device), last]  # [A, H]
            self.roots = torch.tensor(bonuses, device=self.device)  # [A]
            t3 = self.clock()
        committed = [
            [node_tokens[a][i] for i in p[1:]] + [b]
            for a, (p, b) in enumerate(zip(paths, bonuses, strict=True))
        ]
        if self.feature_layers:  # each row's features at its accepted nodes, padded to the longest path
            longest = max(len(p) for p in paths)
            index = torch.tensor([p + [p[-1]] * (longest - len(p)) for p in paths], device=self.device)
            picked = features[torch.arange(len(rows), device=self.device)[:, None], index]  # [A, m, F]
            self.drafter.observe(committed, picked)
        else:
            self.drafter.observe(committed)
        t_draft = (t1 - t0) + (self.clock() - t3)
        if self.pricer is not None:
            accepted = sum(len(p) for p in paths) / len(paths)
            self.pricer.record(len(rows), speculate, t_draft + (t3 - t1), accepted)
        for row, path in zip(rows, paths, strict=True):
            self.stats[row].record_step(len(path), t_draft, t2 - t1, t3 - t2, None, tree.num_nodes)
        return BatchStep(rows, paths, committed, tree.num_nodes, t_draft, t2 - t1, t3 - t2)

    def finish(self, rows: list[int]) -> None:
        """Rows (cache rows) that stopped: they leave the batch and cost no more work."""
        done = set(rows)
        keep = [a for a, row in enumerate(self.live) if row not in done]
        if len(keep) == len(self.live):
            return
        self.live = [self.live[a] for a in keep]
        index = torch.tensor(keep, dtype=torch.long, device=self.device)
        self.hidden, self.roots = self.hidden[index], self.roots[index]
        self.drafter.keep_rows(keep)

    def close(self, row: int, new_tokens: int, started: float) -> GenerationStats:
        """Close one row's statistics: its tokens, the time since `started`, the cache memory."""
        stats = self.stats[row]
        stats.new_tokens = new_tokens
        stats.time_total = self.clock() - started
        stats.cache_memory = self.cache.memory_bytes() if self.cache is not None else {}
        report = self.drafter.report()
        stats.draft_cache_memory, stats.drafter = report.cache_memory, report.stats
        return stats
