"""Tree calibration: measure how often each head's rank-r guess is accepted, and pick the tree.

1. `acceptance_table`: on held-out data, acceptance[k][r] = P(head k's rank-r token is the true token
   | the true tokens of heads 0..k-1 were all within the candidate ranks), i.e. the probability that a
   node is accepted given its parent was.
2. `Tree.from_acceptance(table, n)` builds, for a node budget n, the tree that maximises the expected
   accepted length (greedy expansion by path probability).
3. `forward_costs` measures this machine's cost of one verification step over n tree nodes, and
   `choose_budget` picks the n that maximises expected tokens per second = E[accepted](n) / cost(n)
   (`training.objective`, the objective `tune` maximises too).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from torch import Tensor

from ..core.tree import Tree
from ..drafters.heads import MedusaHeads
from .objective import best_rate


@torch.no_grad()
def acceptance_table(
    heads: MedusaHeads,
    lm_head: Tensor,
    x: Tensor,
    y: Tensor,
    max_rank: int = 10,
    batch: int = 1024,
    embedding: Tensor | None = None,
) -> list[list[float]]:
    """acceptance[k][r] from held-out pairs x [M, H] (hidden states), y [M, K+1] (true tokens t+1..t+1+K,
    -100 = none). embedding: the base model's input embedding (sequential heads)."""
    K = heads.num_heads
    weight = heads.output_weight(lm_head)
    targets = heads.draft_index(y[:, 1 : K + 1])  # [M, K] (-100 outside the draft vocabulary)
    ranks = []  # per batch: [b, K] rank of the true token in head k's top-max_rank (max_rank = not there)
    for i in range(0, len(x), batch):
        yb = y[i : i + batch]  # [b, K+1]
        logits = heads.predict(x[i : i + batch].float(), yb, weight, embedding)  # [K, b, V']
        top = logits.topk(max_rank, dim=-1).indices  # [K, b, R]
        target = targets[i : i + batch].T  # [K, b]
        hit = top == target[..., None]  # [K, b, R]
        rank = torch.where(hit.any(-1), hit.float().argmax(-1), torch.full_like(target, max_rank))  # [K, b]
        rank[yb[:, 1 : K + 1].T < 0] = -1  # no target (past the end of the answer)
        ranks.append(rank.T)
    rank = torch.cat(ranks)  # [M, K]
    table = []
    parent_ok = torch.ones(len(rank), dtype=torch.bool)  # heads 0..k-1 all within the ranks
    for k in range(K):
        valid = parent_ok & (rank[:, k] >= 0)
        n = int(valid.sum())
        table.append([float(((rank[:, k] == r) & valid).sum()) / max(n, 1) for r in range(max_rank)])
        parent_ok = valid & (rank[:, k] < max_rank)
    return table


@torch.inference_mode()
def forward_costs(
    model,
    budgets: Sequence[int],
    heads: MedusaHeads,
    prefix: int = 300,
    repeats: int = 5,
    table: Sequence[Sequence[float]] | None = None,
) -> dict[int, float]:
    """Seconds of one speculative step (draft + forward over n nodes + logits + acceptance + commit) after
    `prefix` tokens, measured through `Decoder.step` on a random prompt.

    table: the acceptance table; each budget is then timed with the tree `from_acceptance` builds for it
    (sequential heads draft depth by depth, so the tree's shape changes the drafting cost)."""
    costs = {}
    for n in budgets:
        tree = Tree.from_acceptance(table, n) if table else _tree_for_budget(n, heads.num_heads)
        decoder = timing_decoder(model, heads, tree, prefix, steps=repeats + 1)
        times = []
        with decoder.running():  # the model's mode held, as `generate` holds it for a whole call
            for _ in range(repeats + 1):
                t0 = time.perf_counter()
                decoder.step()
                times.append(time.perf_counter() - t0)
        costs[n] = sorted(times[1:])[len(times[1:]) // 2]  # median after one warm-up
    return costs


def timing_decoder(model, heads: MedusaHeads, tree: Tree, prefix: int, steps: int):
    """A greedy `Decoder` drafting `tree` with `heads`, prefilled with `prefix` random token ids (seed 0)
    and room for `steps` full-depth steps: what the step timings here run on."""
    from ..core.decoder import Decoder
    from ..drafters.medusa import make_drafter

    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, model.config.vocab_size, (prefix,), generator=gen).tolist()
    decoder = Decoder(model, make_drafter(heads, tree, model), acceptance="greedy")
    decoder.prefill(prompt, max_new_tokens=steps * (tree.max_depth + 1))
    return decoder


def _tree_for_budget(n: int, num_heads: int) -> Tree:
    """A tree shape of n nodes used only to time the forward (its shape barely matters)."""
    return Tree.from_acceptance([[0.5**r for r in range(10)]] * num_heads, n)


def choose_budget(
    table: list[list[float]], costs: dict[int, float]
) -> tuple[int, dict[int, dict[str, float]]]:
    """The node budget with the most expected tokens per second (`training.objective`, as in tuning;
    ties to the smaller tree), and the numbers behind it."""
    expected = {n: Tree.from_acceptance(table, n).expected_accept_length(table) for n in costs}
    best, rates = best_rate(expected, costs)
    report = {
        n: {"expected_accept_length": expected[n], "step_seconds": costs[n], "tokens_per_s": rate}
        for n, rate in rates.items()
    }
    return best, report


def format_budget_report(report: dict[int, dict[str, float]], best: int) -> str:
    """The table of `choose_budget`'s numbers, the chosen budget marked."""
    lines = ["budget  expected accept  step ms  expected tokens/s"]
    for n, r in report.items():
        mark = "  <- chosen" if n == best else ""
        lines.append(
            f"{n:6d}  {r['expected_accept_length']:15.2f}  {r['step_seconds'] * 1e3:7.1f}  "
            f"{r['tokens_per_s']:17.1f}{mark}"
        )
    return "\n".join(lines)
