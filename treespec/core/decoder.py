"""The decoder core: prefill a sequence once, then `step()`: propose a tree, verify it, commit a branch.

    prefill(prompt) -> hidden at the last prompt token -> root (the base model's own first token)
    step():
        proposal = drafter.propose(hidden, root)                   # [B, N] candidate tree tokens
        hidden_tree = scorer(tokens, positions c + depth, plan)    # [B, N, H], K/V written at [c, c+N)
        path, bonus = acceptance rule over lm_head(hidden_tree)    # accepted nodes, base's next token
        cache.commit(path)                                         # c += len(path), the rest rolled back
        drafter.observe(committed tokens); root = bonus; hidden = hidden_tree[path[-1]]

`Decoder` owns the model, the drafter, the KV cache, the acceptance rule and the attention kernel; every
caller (generate, streaming, calibration, tuning, the benchmarks) goes through `prefill` and `step`, and
nothing outside `core` touches the cache's pointers. Shapes are batch-shaped ([B, N] tokens, [B, H]
hidden); B = 1 for now.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from functools import partial

import torch

from ..drafters.base import Drafter, RootOnlyDrafter, SequenceStart
from .acceptance import RULES, SamplingConfig, verify
from .attention import KERNELS, AttentionPlan, auto_kernel, tree_attention_enabled
from .cache import CacheCapacityError, TreeKVCache
from .compiled import CompiledForward
from .packed import MODES as LINEAR_MODES
from .packed import packed_linears
from .stats import GenerationStats
from .tree import Tree


@dataclass
class StepResult:
    """One decoding step of row 0: the verified tree, the accepted branch, and the phase timings."""

    tokens: list[int]  # [N] the candidate tree's tokens
    draft_probs: list[float] | None  # [N] the drafter's probability of each node's token
    tree: Tree  # the step's tree (the drafter's static one, or this step's dynamic one)
    expected_accept: float | None  # the drafter's predicted accepted length, if it made one
    path: list[int]  # accepted nodes, root first
    committed: list[int]  # tokens committed: the accepted nodes after the root, then the bonus
    bonus: int  # the base model's own token after the last accepted node (the next root)
    seconds_draft: float
    seconds_verify: float
    seconds_commit: float

    def as_trace(self) -> dict:
        """The step as a trace entry (`treespec.tools.trace`)."""
        entry = {
            "tokens": self.tokens,
            "draft_probs": self.draft_probs,
            "path": self.path,
            "bonus": self.bonus,
        }
        if self.expected_accept is not None:
            entry["expected_accept"] = self.expected_accept
        entry["choices"] = [list(c) for c in self.tree.choices]
        return entry


def full_forward(
    model, ids: torch.Tensor, positions: torch.Tensor, cache, plan: AttentionPlan, feature_layers=()
):
    """The decoder without lm_head: ids, positions [B, n] -> final hidden states [B, n, H].

    feature_layers: indices into transformers' `hidden_states` (0 = the embeddings, i = after layer i);
    when given, returns (hidden [B, n, H], features [B, n, len(feature_layers) * H]) concatenated in order."""
    if not feature_layers:
        out = model.base_model(
            input_ids=ids, position_ids=positions, cache=cache, use_cache=True, tree_attention=plan
        )
        return out.last_hidden_state
    out = model.base_model(
        input_ids=ids,
        position_ids=positions,
        cache=cache,
        use_cache=True,
        tree_attention=plan,
        output_hidden_states=True,
    )
    features = torch.cat([out.hidden_states[i] for i in feature_layers], dim=-1)  # [B, n, F]
    return out.last_hidden_state, features


def output_logits(model, hidden: torch.Tensor) -> torch.Tensor:
    """Base model logits of hidden states [..., H] -> [..., V] (with the model's logit soft-capping)."""
    logits = model.get_output_embeddings()(hidden)
    cap = getattr(model.config, "final_logit_softcapping", None)
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return logits


def check_settings(linears: str, acceptance: str, kernel: str) -> None:
    """Refuse an unknown linear mode, acceptance rule or attention kernel (Decoder, BatchDecoder)."""
    if linears not in LINEAR_MODES:
        raise ValueError(f"unknown linears mode {linears!r}; choose one of {LINEAR_MODES}")
    if acceptance not in RULES:
        raise ValueError(f"unknown acceptance rule {acceptance!r}; choose one of {RULES}")
    if kernel not in KERNELS and kernel != "auto":
        raise ValueError(f"unknown attention kernel {kernel!r}; choose one of {['auto', *sorted(KERNELS)]}")


def positions_needed(
    model, prompt_tokens: int, max_new_tokens: int, tree_nodes: int, max_length: int | None, prompt: str
) -> int:
    """Cache positions a sequence needs (prompt + new tokens + one tree block); refuses what the model
    cannot hold. prompt: how the error names the prompt ("the prompt", "prompt 3")."""
    config = model.config
    limit = max_length or getattr(config, "max_position_embeddings", None) or 1 << 30
    needed = prompt_tokens + max_new_tokens + tree_nodes
    if needed > limit:
        raise CacheCapacityError(
            f"{prompt} has {prompt_tokens} tokens; with max_new_tokens={max_new_tokens} and a "
            f"{tree_nodes}-node tree the cache needs {needed} positions but the limit is "
            f"{limit}: shorten {prompt} or lower max_new_tokens"
        )
    sliding = getattr(config, "sliding_window", None)
    if sliding and getattr(config, "use_sliding_window", True) and needed > sliding:
        raise ValueError(
            f"this model uses sliding-window attention ({sliding} tokens) and treespec attends to the "
            f"whole prefix; keep prompt + max_new_tokens under {sliding - tree_nodes}"
        )
    return needed


@contextlib.contextmanager
def decoding_mode(model, linears: str):
    """The model's mode for treespec's forwards: tree attention, and packed linears when asked."""
    with tree_attention_enabled(model), packed_linears(model, mode=linears):
        yield


def device_clock(device: torch.device) -> float:
    """Wall time; synchronises CUDA so phases are not mis-attributed."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


class Decoder:
    """Tree-speculative decoding of one sequence at a time over a preallocated cache."""

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
        compile: bool = False,
    ):
        """linears: how the model's linear layers run during prefill and steps (`core.packed`): "auto"
        (exact block weights where the weights are such, else oneDNN prepacked), "onednn" or "torch"
        (as the model is); CPU only (float32, or bf16 where oneDNN has it), ignored elsewhere.
        compile: run the verification forward through torch.compile (`core.compiled`; the first step of
        each node count compiles, about a minute on a small CPU); drafters with their own scorer keep it."""
        check_settings(linears, acceptance, kernel)
        param = next(model.parameters())
        self.model, self.device = model, param.device
        self.drafter = drafter or RootOnlyDrafter()
        self.tree = self.drafter.tree
        self.acceptance, self.sampling = acceptance, sampling or SamplingConfig()
        self.kernel = auto_kernel(self.device, param.dtype) if kernel == "auto" else kernel
        self.plan = AttentionPlan.for_tree(self.tree, self.kernel, self.device)
        self.children = [self.tree.children(i) for i in range(self.tree.num_nodes)]
        self.depth = self.tree.depth.to(self.device)  # [N]
        self._layouts: dict[Tree, tuple] = {}  # per-step trees seen: (plan, children, depth), bounded
        # the target's hidden states the drafter reads (an EAGLE-style drafter); () = none
        self.feature_layers = tuple(getattr(self.drafter, "feature_layers", ()))
        default_scorer = CompiledForward(model, linears) if compile else partial(full_forward, model)
        self.scorer = self.drafter.scorer() or default_scorer
        if self.feature_layers:
            if self.drafter.scorer() is not None:
                raise ValueError("a drafter that reads the target's features cannot bring its own scorer")
            self.scorer = partial(self.scorer, feature_layers=self.feature_layers)
        self.generator = None if seed is None else torch.Generator(self.device).manual_seed(seed)
        self.linears = linears
        self.cache: TreeKVCache | None = None
        self.stats = GenerationStats()
        self.hidden: torch.Tensor | None = None  # [B, H] at the last committed token
        self.roots: torch.Tensor | None = None  # [B] the next root token

    def running(self):
        """The model's mode for treespec's forwards (`decoding_mode`)."""
        return decoding_mode(self.model, self.linears)

    def clock(self) -> float:
        return device_clock(self.device)

    def capacity(self, prompt_tokens: int, max_new_tokens: int, max_length: int | None = None) -> int:
        """Cache positions a sequence needs (`positions_needed`)."""
        return positions_needed(
            self.model, prompt_tokens, max_new_tokens, self.tree.num_nodes, max_length, "the prompt"
        )

    @torch.inference_mode()
    def prefill(self, prompt_ids: list[int], max_new_tokens: int, max_length: int | None = None) -> int:
        """Start a sequence: encode the prompt, sample the first token, start the drafter. The cache is
        allocated here (reused when large enough), never inside `step`."""
        needed = self.capacity(len(prompt_ids), max_new_tokens, max_length)
        if self.cache is None or self.cache.max_len < needed:
            self.cache = TreeKVCache.for_model(self.model, needed, spec_reserve=self.tree.num_nodes)
            # "compiled" includes the fused commit (when the extension is there); the others use torch
            self.cache.fused_commit = None if self.kernel == "compiled" else False
        self.cache.reset()
        self.stats = GenerationStats(prompt_tokens=len(prompt_ids), max_depth=self.tree.max_depth)
        t0 = self.clock()
        ids = torch.tensor([prompt_ids], device=self.device)  # [1, P]
        positions = torch.arange(len(prompt_ids), device=self.device)[None]  # [1, P]
        features = None  # [1, P, F] for a drafter that reads the target's features
        with self.running():
            hidden = full_forward(
                self.model, ids, positions, self.cache, AttentionPlan(self.kernel), self.feature_layers
            )
            if self.feature_layers:
                hidden, features = hidden
            logits = output_logits(self.model, hidden[0, -1])  # [V]
        self.cache.commit_all()
        self.hidden = hidden[:, -1]  # [1, H]
        root = self.sampling.sample(logits, self.generator)
        self.roots = torch.tensor([root], device=self.device)  # [1]
        start = SequenceStart(list(prompt_ids) + [root], needed, self.cache, self.kernel, features)
        self.drafter.start(start)
        self.stats.time_prefill = self.clock() - t0
        return root

    @torch.inference_mode()
    def step(self) -> StepResult:
        """One speculative step: propose, verify every node in one forward, commit the accepted branch."""
        if self.cache is None or self.hidden is None:
            raise RuntimeError(
                "Decoder.step() needs a sequence: call prefill(prompt_ids, max_new_tokens) first"
            )
        with self.running():
            t0 = self.clock()
            proposal = self.drafter.propose(self.hidden, self.roots)  # tokens [1, N]
            tree = proposal.tree or self.tree
            plan, children, depth = self.layout(tree)
            t1 = self.clock()
            positions = (self.cache.committed + depth)[None]  # [1, N]
            hidden_tree = self.scorer(proposal.tokens, positions, self.cache, plan)  # [1, N, H]
            features = None
            if self.feature_layers:
                hidden_tree, features = hidden_tree  # features [1, N, F]
            logits = output_logits(self.model, hidden_tree[0])  # [N, V]
            tokens = proposal.tokens[0].tolist()
            path, bonus = verify(self.acceptance, tokens, children, logits, self.sampling, self.generator)
            t2 = self.clock()
            self.cache.commit(path)
            self.hidden = hidden_tree[:, path[-1]]  # [1, H]
            self.roots = torch.tensor([bonus], device=self.device)  # [1]
            t3 = self.clock()
        committed = [tokens[i] for i in path[1:]] + [bonus]
        if self.feature_layers:  # the features of the accepted nodes: the positions just committed
            self.drafter.observe([committed], features[:, path])
        else:
            self.drafter.observe([committed])
        # what the drafter does in observe (e.g. an EAGLE layer's pass over the committed tokens) counts
        # as drafting
        t_draft = (t1 - t0) + (self.clock() - t3)
        self.stats.record_step(len(path), t_draft, t2 - t1, t3 - t2, proposal.expected_accept, tree.num_nodes)
        probs = None if proposal.probs is None else proposal.probs[0].float().tolist()
        return StepResult(
            tokens, probs, tree, proposal.expected_accept, path, committed, bonus, t_draft, t2 - t1, t3 - t2
        )

    def layout(self, tree: Tree) -> tuple[AttentionPlan, list[list[int]], torch.Tensor]:
        """(attention plan, children of each node, depth [N] on the device) of a step's tree; a dynamic
        tree is checked against the cache's speculative block and its layout kept for the next time."""
        if tree is self.tree:
            return self.plan, self.children, self.depth
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
            plan = AttentionPlan.for_tree(tree, self.kernel, self.device)
            children = [tree.children(i) for i in range(tree.num_nodes)]
            cached = self._layouts[tree] = (plan, children, tree.depth.to(self.device))
        return cached

    @torch.inference_mode()
    def score(self, tokens: torch.Tensor, scorer=None) -> torch.Tensor:
        """Verification logits of a candidate tree without committing anything (for measurements):
        tokens [B, N] in the tree's node order -> logits [B, N, V]; the block is rolled back after.
        scorer: the forward to use (default: the decoder's own)."""
        if self.cache is None:
            raise RuntimeError(
                "Decoder.score() needs a sequence: call prefill(prompt_ids, max_new_tokens) first"
            )
        c = self.cache.committed
        with self.running():
            hidden = (scorer or self.scorer)(
                tokens, (c + self.depth)[None], self.cache, self.plan
            )  # [B, N, H]
            if isinstance(hidden, tuple):  # (hidden, features) for a drafter that reads features
                hidden = hidden[0]
            logits = output_logits(self.model, hidden)  # [B, N, V]
        self.cache.rollback(c)
        return logits

    def finish(self, new_tokens: int, started: float) -> GenerationStats:
        """Close the sequence's statistics: tokens, total time since `started`, memory, drafter report."""
        stats = self.stats
        stats.new_tokens = new_tokens
        stats.time_total = self.clock() - started
        stats.cache_memory = self.cache.memory_bytes() if self.cache is not None else {}
        report = self.drafter.report()
        stats.draft_cache_memory, stats.drafter = report.cache_memory, report.stats
        return stats
