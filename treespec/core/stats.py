"""Per-run statistics of speculative decoding: acceptance, time per phase, cache memory.

The metrics of a speculative KV cache, for every drafter: acceptance rate, mean accepted length,
verification latency, draft latency and the memory the speculation adds (the target cache's tree
block plus the drafter's own cache). End-to-end speedup needs a baseline run: `scripts/bench.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

SHOWN_SETUP_SECONDS = 0.05  # `summary` names a one-time setup from this long on


@dataclass
class GenerationStats:
    """Filled by `generate`. An accepted length counts the tokens one forward pass committed
    (root included), so plain decoding has 1.0 and a speculative step has >= 1."""

    prompt_tokens: int = 0
    # of prompt_tokens, those whose K/V the cache kept from the sequence before (`Decoder(reuse_prefix=True)`,
    # a `Chat`'s earlier turns): the prefill ran over the rest
    prompt_reused: int = 0
    new_tokens: int = 0
    max_depth: int = 0
    steps: int = 0
    accept_lengths: list[int] = field(default_factory=list)
    depth_accepted: list[int] = field(default_factory=list)  # [d] steps that accepted a node at depth d+1
    time_prefill: float = 0.0
    time_draft: float = 0.0
    time_verify: float = 0.0
    time_commit: float = 0.0
    time_total: float = 0.0
    # of time_total, the one-time work of the model's first call in this process (its linears packed, the
    # native step built: `TargetRuntime.setup_seconds`); later calls skip it
    time_setup: float = 0.0
    cache_memory: dict[str, int] = field(default_factory=dict)
    draft_cache_memory: dict[str, int] = field(default_factory=dict)  # the drafter's caches and tables
    drafter: dict = field(default_factory=dict)  # what the drafter measured itself (draft models)
    # per step: the drafter's predicted accepted length (dynamic trees; None when it made none) and the
    # nodes verified
    predicted_accept: list[float | None] = field(default_factory=list)
    nodes_verified: list[int] = field(default_factory=list)

    def record_step(
        self,
        accepted: int,
        t_draft: float,
        t_verify: float,
        t_commit: float,
        predicted: float | None = None,
        nodes: int | None = None,
    ) -> None:
        if not self.depth_accepted:
            self.depth_accepted = [0] * self.max_depth
        self.steps += 1
        self.accept_lengths.append(accepted)
        self.predicted_accept.append(predicted)
        if nodes is not None:
            self.nodes_verified.append(nodes)
        for d in range(accepted - 1):
            self.depth_accepted[d] += 1
        self.time_draft += t_draft
        self.time_verify += t_verify
        self.time_commit += t_commit

    @property
    def mean_predicted_accept_length(self) -> float | None:
        """Mean predicted accepted length over the steps that had a prediction (None: no step had one)."""
        values = [p for p in self.predicted_accept if p is not None]
        return sum(values) / len(values) if values else None

    @property
    def mean_nodes_verified(self) -> float:
        """Mean tree nodes verified per step (root included)."""
        return sum(self.nodes_verified) / len(self.nodes_verified) if self.nodes_verified else 0.0

    @property
    def mean_accept_length(self) -> float:
        """Mean tokens committed per verification forward pass."""
        return sum(self.accept_lengths) / len(self.accept_lengths) if self.accept_lengths else 0.0

    @property
    def per_depth_acceptance(self) -> list[float]:
        """Share of steps whose accepted branch reached depth d (d = 1..max_depth)."""
        return [n / self.steps for n in self.depth_accepted] if self.steps else []

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafted tokens / the tokens a fully accepted step would add (the tree's depth):
        for a chain of gamma tokens, the share of drafted tokens accepted."""
        if not self.steps or not self.max_depth:
            return 0.0
        return (sum(self.accept_lengths) - self.steps) / (self.steps * self.max_depth)

    @property
    def verify_latency(self) -> float:
        """Mean seconds of one verification forward pass (logits and acceptance included)."""
        return self.time_verify / self.steps if self.steps else 0.0

    @property
    def draft_latency(self) -> float:
        """Mean seconds of drafting one step's candidates."""
        return self.time_draft / self.steps if self.steps else 0.0

    @property
    def speculative_memory(self) -> int:
        """Bytes speculation adds: the target cache's reserved tree block, the drafter's own cache and
        tables, and a suffix drafter's cache of earlier answers."""
        extra = self.draft_cache_memory
        drafter = sum(extra.get(kind, 0) for kind in ("allocated", "scratch", "suffix_cache"))
        return self.cache_memory.get("speculative", 0) + drafter

    @property
    def tokens_per_second(self) -> float:
        """New tokens per second of wall time, prefill included, the one-time setup (`time_setup`) not."""
        seconds = self.time_total - self.time_setup
        return self.new_tokens / seconds if seconds > 0 else 0.0

    def as_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "prompt_reused": self.prompt_reused,
            "new_tokens": self.new_tokens,
            "steps": self.steps,
            "mean_accept_length": self.mean_accept_length,
            "per_depth_acceptance": self.per_depth_acceptance,
            "acceptance_rate": self.acceptance_rate,
            "verify_latency": self.verify_latency,
            "draft_latency": self.draft_latency,
            "speculative_memory": self.speculative_memory,
            "tokens_per_second": self.tokens_per_second,
            "time_prefill": self.time_prefill,
            "time_draft": self.time_draft,
            "time_verify": self.time_verify,
            "time_commit": self.time_commit,
            "time_total": self.time_total,
            "time_setup": self.time_setup,
            "cache_memory": self.cache_memory,
            "draft_cache_memory": self.draft_cache_memory,
            "drafter": self.drafter,
        }

    def summary(self) -> str:
        setup = (
            f" (after {self.time_setup:.2f} s of one-time setup: the model's weights prepared for this "
            "process, which later calls skip)"
            if self.time_setup >= SHOWN_SETUP_SECONDS
            else ""
        )
        kept = (
            f", {self.prompt_reused} of {self.prompt_tokens} prompt tokens kept in the cache from before"
            if self.prompt_reused
            else ""
        )
        return (
            f"{self.new_tokens} tokens in {self.steps} steps, {self.tokens_per_second:.1f} tok/s"
            f"{setup}{kept}, "
            f"mean accepted length {self.mean_accept_length:.2f}, "
            f"acceptance rate {self.acceptance_rate:.2f}, "
            f"draft {1e3 * self.draft_latency:.1f} ms + verify {1e3 * self.verify_latency:.1f} ms per step, "
            f"speculative memory {self.speculative_memory / 2**20:.2f} MiB"
        )
