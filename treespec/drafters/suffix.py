"""Suffix decoding: speculation trees from what followed the same words earlier, no model needed.

SuffixDecoding (Oliaro et al., NeurIPS 2025) drafts without training: the text a request has so far (its
prompt and its answer) and the answers of earlier requests often repeat (rewrites, code edits, agents that
call the same tools, self-refinement), so the tokens that followed the longest earlier occurrence of the
text's own suffix are a good guess of what comes next. Counting how often each continuation followed
gives every candidate token a frequency, and the candidates form a tree of any shape.

This module writes that idea on n-gram chains rather than a suffix tree (same matches, less memory):

- `SuffixIndex`: a token stream; for n = 1..ngram every n-gram points at the latest position that
  followed it, and every position at the previous one that followed the same n-gram (a chain of
  occurrences, newest first). `match(context)` walks the chain of the context's last n tokens and extends
  each occurrence backwards (up to `max_context` tokens): the occurrences of the longest matching suffix.
- `SuffixCache`: the global structure, shared across `generate` calls, drafters and batch rows: earlier
  requests' answers in one stream (separated by a sentinel), at most `max_tokens` tokens (the oldest
  requests are evicted first, with their index entries), saved as JSON (`save` / `load`).
- `SuffixDrafter`: per batch row an index over the row's prompt + committed tokens; each step it matches
  the row's text in its own index and in the global cache, counts the continuations (up to `max_depth`
  tokens) of the longest matches in a trie and grows a tree best-first by estimated path probability
  (count of the child / count of the parent, times the parent's), up to `max_nodes` nodes. The rows'
  trees are merged by rank paths into the step's one tree (`Proposal.tree`); a row fills the nodes it
  does not have with its root token at probability 0. A finished request's answer joins the global cache.
"""

from __future__ import annotations

import heapq
import json
import math
import sys
from array import array
from collections import deque
from collections.abc import Iterable
from pathlib import Path

import torch

from ..core.drafting import BaseDrafter, DrafterReport, Proposal, SequenceStart, StepTrees, batch_rows
from ..core.tree import Tree
from ..io import atomic_write_json

SENTINEL = -1  # separates requests in a stream: never equal to a token, never inside an indexed n-gram
FORMAT = "treespec.suffix_cache"
VERSION = 1
_ENTRY_BYTES = 72  # an index entry's key and value int objects (a dict's table is counted by getsizeof)
MAX_STEP_TREES = 512  # distinct step trees a drafter keeps (the decoder keeps as many layouts)


def _pack(tokens: Iterable[int]) -> int | None:
    """One int key for an n-gram (32 bits per token); None when it holds the sentinel."""
    key = 0
    for token in tokens:
        if token < 0:
            return None
        key = (key << 32) | token
    return key


def _check_tokens(tokens: Iterable[int], what: str) -> list[int]:
    """Token ids as a list of non-negative ints (< 2**32), or a clear error."""
    out = [int(t) for t in tokens]
    bad = [t for t in out if not 0 <= t < 2**32]
    if bad:
        raise ValueError(f"{what} holds token ids outside [0, 2**32): {bad[:5]}")
    return out


class SuffixIndex:
    """A token stream with a chain of earlier occurrences for every n-gram (n = 1..ngram).

    Positions are absolute (`base` is the position of the first token kept), so dropping the front of the
    stream (`drop_front`) leaves the other positions valid."""

    def __init__(self, ngram: int = 3):
        if isinstance(ngram, bool) or not isinstance(ngram, int) or ngram < 1:
            raise ValueError(f"ngram must be an int >= 1, got {ngram!r}")
        self.ngram = ngram
        self.base = 0  # absolute position of tokens[0]
        self.tokens = array("q")  # [T] the stream (SENTINEL between requests)
        # prev[n - 1][p - base]: the previous position that followed the same n tokens as p did (-1: none)
        self.prev = [array("q") for _ in range(ngram)]
        self.last: list[dict[int, int]] = [{} for _ in range(ngram)]  # n-gram key -> latest follower

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def end(self) -> int:
        """The absolute position the next token gets."""
        return self.base + len(self.tokens)

    def _key(self, p: int, n: int) -> int | None:
        """Key of the n tokens before absolute position p (None: they cross the start or a sentinel)."""
        i = p - self.base
        return None if i < n else _pack(self.tokens[i - n : i])

    def extend(self, tokens: Iterable[int]) -> None:
        """Append tokens (SENTINEL allowed); each n-gram before a new real token points at it."""
        for token in tokens:
            p = self.end
            for n in range(1, self.ngram + 1):
                key = None if token == SENTINEL else self._key(p, n)
                earlier = -1
                if key is not None:
                    earlier = self.last[n - 1].get(key, -1)
                    self.last[n - 1][key] = p
                self.prev[n - 1].append(earlier)
            self.tokens.append(token)

    def drop_front(self, count: int) -> None:
        """Forget the first `count` tokens and the index entries that point into them."""
        count = min(count, len(self.tokens))
        new_base = self.base + count
        for n in range(1, self.ngram + 1):
            last = self.last[n - 1]
            for p in range(self.base + n, new_base):
                key = self._key(p, n)
                if key is not None and last.get(key, new_base) < new_base:
                    del last[key]
            del self.prev[n - 1][:count]
        del self.tokens[:count]
        self.base = new_base

    def match(self, context: list[int], max_context: int, max_scan: int) -> tuple[int, list[int]]:
        """(length of the longest suffix of `context`, at most max_context tokens, that occurred earlier
        with a token after it; the positions that followed its occurrences, newest first). Scans at most
        `max_scan` occurrences of the suffix's last n tokens (n = ngram, else shorter). (0, []): none."""
        for n in range(min(self.ngram, len(context), max_context), 0, -1):
            p = self.last[n - 1].get(_pack(context[-n:]), -1)
            best, found = 0, []
            for _ in range(max_scan):
                if p < self.base:
                    break
                length = n + self._agree(p - n, context, n, max_context - n)
                if length > best:
                    best, found = length, [p]
                elif length == best:
                    found.append(p)
                p = self.prev[n - 1][p - self.base]
            if found:
                return best, found
        return 0, []

    def _agree(self, p: int, context: list[int], skip: int, limit: int) -> int:
        """How many tokens before absolute position p equal context[:-skip] read backwards (<= limit)."""
        i, k, count = p - self.base - 1, len(context) - skip - 1, 0
        while count < limit and i >= 0 and k >= 0 and self.tokens[i] == context[k]:
            i, k, count = i - 1, k - 1, count + 1
        return count

    def continuation(self, p: int, depth: int, wrap: bool = False) -> list[int]:
        """Up to `depth` tokens from absolute position p, stopping at a sentinel. wrap: where the stream
        ends first, go on periodically with period end - p (the stream is the text whose suffix matched
        before p, so the matched occurrence overlaps that suffix: what followed it, applied again)."""
        out = []
        for token in self.tokens[p - self.base : p - self.base + depth]:
            if token == SENTINEL:
                return out
            out.append(token)
        period = len(out)
        while wrap and period and len(out) < depth and p + period == self.end:
            out.append(out[len(out) - period])
        return out

    def memory_bytes(self) -> int:
        """Bytes held: the stream, the chains and the n-gram tables with their keys and values."""
        arrays = sys.getsizeof(self.tokens) + sum(sys.getsizeof(a) for a in self.prev)
        tables = sum(sys.getsizeof(d) + _ENTRY_BYTES * len(d) for d in self.last)
        return arrays + tables


class SuffixCache:
    """Earlier requests' token sequences (answers) with their n-gram chains: the global structure a
    `SuffixDrafter` matches besides the request's own text. Shared across `generate` calls, drafters and
    batch rows. Bounded: at most `max_tokens` tokens (a sentinel per request included); adding a request
    evicts the oldest ones first, with their index entries."""

    def __init__(self, max_tokens: int = 131072, ngram: int = 3):
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 2:
            raise ValueError(f"max_tokens must be an int >= 2, got {max_tokens!r}")
        self.max_tokens = max_tokens
        self.index = SuffixIndex(ngram)
        # stream length of each request (its sentinel included), oldest first
        self.sizes: deque[int] = deque()

    @classmethod
    def from_sequences(
        cls, sequences: Iterable[Iterable[int]], room: int = 131072, ngram: int = 3
    ) -> SuffixCache:
        """A cache holding `sequences` (earlier answers, e.g. the model's own answers to other prompts:
        `training.distill.read_answers`) with `room` more tokens for the requests still to come."""
        sequences = [list(s) for s in sequences]  # `add` checks the token ids
        cache = cls(sum(len(s) + 1 for s in sequences) + max(2, room), ngram)
        for tokens in sequences:
            cache.add(tokens)
        return cache

    @property
    def num_requests(self) -> int:
        return len(self.sizes)

    @property
    def num_tokens(self) -> int:
        """Tokens stored (sentinels not counted)."""
        return len(self.index) - len(self.sizes)

    def add(self, tokens: Iterable[int]) -> None:
        """Store one request's tokens (only its last max_tokens - 1 when longer), evicting the oldest
        requests until it fits."""
        tokens = _check_tokens(tokens, "a suffix cache request")[-(self.max_tokens - 1) :]
        if not tokens:
            return
        size = len(tokens) + 1
        while self.sizes and len(self.index) + size > self.max_tokens:
            self.index.drop_front(self.sizes.popleft())
        self.index.extend(tokens + [SENTINEL])
        self.sizes.append(size)

    def requests(self) -> list[list[int]]:
        """The stored requests' tokens, oldest first."""
        out, start = [], 0
        for size in self.sizes:
            out.append(list(self.index.tokens[start : start + size - 1]))
            start += size
        return out

    def memory_bytes(self) -> int:
        """Bytes the cache holds (the stream, its chains and n-gram tables; bounded through max_tokens)."""
        return self.index.memory_bytes() + sys.getsizeof(self.sizes)

    def save(self, path: str | Path) -> None:
        """Write the cache as JSON (atomically): its settings and its requests' tokens."""
        data = {
            "format": FORMAT,
            "version": VERSION,
            "max_tokens": self.max_tokens,
            "ngram": self.index.ngram,
            "requests": self.requests(),
        }
        atomic_write_json(path, data, indent=None)

    @classmethod
    def load(cls, path: str | Path) -> SuffixCache:
        """A cache written by `save` (the same requests give the same index, hence the same trees).
        A file that is not one raises ValueError naming it."""
        path = Path(path)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            problem = _format_problem(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            problem = f"not valid JSON ({error})"
        if problem:
            raise ValueError(
                f"{path} is not a treespec suffix cache: {problem}; delete it or write it again with "
                "SuffixCache.save"
            )
        cache = cls(data["max_tokens"], data["ngram"])
        for tokens in data["requests"]:
            cache.add(tokens)
        return cache


def _format_problem(data) -> str | None:
    """What is wrong with a loaded suffix cache's JSON (None: nothing)."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        return f"no {FORMAT!r} format tag"
    if data.get("version") != VERSION:
        return f"version {data.get('version')!r}, this treespec reads version {VERSION}"
    for name, low in (("max_tokens", 2), ("ngram", 1)):
        value = data.get(name)
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            return f"{name} is {value!r}, not an int >= {low}"
    requests = data.get("requests")
    if not isinstance(requests, list) or not all(isinstance(r, list) for r in requests):
        return "requests is not a list of token lists"
    for r in requests:
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**32 for t in r):
            return "a request holds something other than token ids"
    return None


def envelope_tree(num_nodes: int, max_depth: int, width: int = 4) -> Tree:
    """A tree of `num_nodes` nodes (root included) reaching `max_depth`: the rank-0 chain, then the nodes
    best under a prior where rank r is worth 0.8 * 0.5**r at every depth (ranks < width)."""
    chain = [(0,) * d for d in range(1, min(max_depth, num_nodes - 1) + 1)]
    chosen, frontier = set(chain), []

    def push_children(path: tuple[int, ...]) -> None:
        if len(path) < max_depth:
            value = math.prod(0.8 * 0.5**r for r in path)
            for r in range(width):
                child = (*path, r)
                if child not in chosen:
                    heapq.heappush(frontier, (-value * 0.8 * 0.5**r, len(child), child))

    for path in [(), *chain]:
        push_children(path)
    while len(chosen) < num_nodes - 1 and frontier:
        _, _, path = heapq.heappop(frontier)
        chosen.add(path)
        push_children(path)
    return Tree.from_choices(sorted(chosen))


class _Row:
    """One request of the batch: its index (prompt + committed tokens) and where its answer starts."""

    def __init__(self, tokens: list[int], prompt_length: int, ngram: int):
        self.index = SuffixIndex(ngram)
        self.index.extend(tokens)
        self.prompt_length = prompt_length

    def answer(self) -> list[int]:
        return list(self.index.tokens[self.prompt_length :])


class SuffixDrafter(BaseDrafter):
    """Suffix decoding: each step, for each row, the continuations of the longest earlier occurrence of
    the row's text (in its own prompt + answer and in the global `SuffixCache`) as a tree of any shape up
    to `max_nodes` nodes (root included) and `max_depth` tokens deep.

    cache: the global cache (None: a new one of its own; pass one to share it across drafters and to
    save it). max_context: the longest suffix matched. min_count / min_prob: a node needs at least that
    many occurrences and that estimated path probability. spec_factor: a row drafts at most
    ceil(spec_factor x matched length) tokens deep (short matches are weak evidence). max_scan: earlier
    occurrences examined per source and step; max_candidates: continuations counted per source.
    remember: finished requests' answers go into the global cache (False: the cache is only read).
    Each step proposes its own tree (`Proposal.tree`); `tree` is the envelope that sizes the cache block."""

    batched = True
    limits_depth = True  # propose(..., max_depth=D) drafts depths 1..D only

    def __init__(
        self,
        cache: SuffixCache | None = None,
        max_nodes: int = 16,
        max_depth: int = 6,
        max_context: int = 16,
        min_count: int = 1,
        min_prob: float = 0.1,
        spec_factor: float = 1.0,
        max_scan: int = 64,
        max_candidates: int = 32,
        remember: bool = True,
    ):
        for name, value, low in (
            ("max_nodes", max_nodes, 1),
            ("max_depth", max_depth, 1),
            ("max_context", max_context, 1),
            ("min_count", min_count, 1),
            ("max_scan", max_scan, 1),
            ("max_candidates", max_candidates, 1),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        if not 0.0 <= min_prob <= 1.0 or spec_factor <= 0:
            raise ValueError(f"need 0 <= min_prob <= 1 and spec_factor > 0, got {min_prob}, {spec_factor}")
        self.cache = SuffixCache() if cache is None else cache
        self.max_nodes, self.max_depth = max_nodes, min(max_depth, max_nodes - 1)
        self.max_context, self.min_count, self.min_prob = max_context, min_count, min_prob
        self.spec_factor, self.max_scan, self.max_candidates = spec_factor, max_scan, max_candidates
        self.remember = remember
        self.tree = envelope_tree(max_nodes, self.max_depth)
        self._tree_for = StepTrees(MAX_STEP_TREES)  # choice paths -> the step's tree (bounded)
        self.rows: list[_Row] = []
        self.counts: dict[str, int] = {}
        self._reset_counts()

    def _reset_counts(self) -> None:
        """The statistics of one batch (`report`)."""
        names = ("steps", "rows", "matched", "matched_tokens", "request", "global", "nodes")
        self.counts = dict.fromkeys(names, 0)

    def start(self, sequence: SequenceStart) -> None:
        """A new request (row `sequence.row` of a batch): index its prompt and first token. Row 0 starts a
        new batch: the requests of the last one go into the global cache first."""
        tokens = _check_tokens(sequence.tokens, "the sequence")
        if sequence.row == 0:
            self.finish()
            self.rows = [None] * sequence.rows
            self._reset_counts()
        self.rows[sequence.row] = _Row(tokens, len(tokens) - 1, self.cache.index.ngram)

    def finish(self) -> None:
        """Put the current requests' answers into the global cache and forget the requests (called by
        `start` of the next batch; call it yourself before saving the cache after a `generate`)."""
        for row in self.rows:
            if row is not None and self.remember:
                self.cache.add(row.answer())
        self.rows = []

    def keep_rows(self, rows: list[int]) -> None:
        """Rows that left the batch finished: their answers go into the global cache."""
        kept = set(rows)
        for r, row in enumerate(self.rows):
            if r not in kept and self.remember:
                self.cache.add(row.answer())
        self.rows = [self.rows[r] for r in rows]

    def observe(self, committed: list[list[int]], features: torch.Tensor | None = None) -> None:
        """Tokens each row committed (the accepted ones, then the bonus token: the next root)."""
        for row, tokens in zip(self.rows, committed, strict=True):
            row.index.extend(tokens)

    def propose(self, hidden: torch.Tensor, roots: torch.Tensor, max_depth: int | None = None) -> Proposal:
        """tokens, probs: [B, N] over the step's tree (each row's path probabilities, 0 where the row has
        no such node and its root token there)."""
        hidden, roots = batch_rows(hidden, roots)
        if roots.numel() != len(self.rows):
            raise ValueError(f"propose got {roots.numel()} rows but {len(self.rows)} sequences started")
        depth = self.max_depth if max_depth is None else max(0, min(max_depth, self.max_depth))
        root_list = roots.tolist()
        row_paths = [
            self._row_paths(row, root, depth) for row, root in zip(self.rows, root_list, strict=True)
        ]
        choices = self._union(row_paths)
        tree = self._tree_for(choices)  # its paths are exactly `choices`
        tokens = [[root] * tree.num_nodes for root in root_list]  # [B, N]
        probs = [[1.0] + [0.0] * (tree.num_nodes - 1) for _ in root_list]  # [B, N]
        for r, paths in enumerate(row_paths):
            for i, path in enumerate(tree.choices, start=1):
                if path in paths:
                    tokens[r][i], probs[r][i] = paths[path]
        self.counts["steps"] += 1
        self.counts["nodes"] += len(choices) + 1
        return Proposal(
            torch.tensor(tokens, dtype=torch.long, device=hidden.device),
            torch.tensor(probs, dtype=torch.float32),
            tree=tree,
        )

    def _row_paths(self, row: _Row, root: int, depth: int) -> dict[tuple[int, ...], tuple[int, float]]:
        """One row's tree: rank path -> (token, estimated path probability), at most max_nodes - 1."""
        context = list(row.index.tokens[-self.max_context :])
        if not context or context[-1] != root:  # the text ends with the root (the last bonus token)
            context = (context + [root])[-self.max_context :]
        found = [
            (*index.match(context, self.max_context, self.max_scan), index)
            for index in (row.index, self.cache.index)
        ]
        best = max(length for length, _, _ in found)
        self.counts["rows"] += 1
        if best == 0 or depth == 0:
            return {}
        self.counts["matched"] += 1
        self.counts["matched_tokens"] += best
        self.counts["request"] += found[0][0] == best
        self.counts["global"] += found[1][0] == best
        depth = min(depth, math.ceil(self.spec_factor * best))
        continuations = [
            index.continuation(p, depth, wrap=index is row.index)
            for length, positions, index in found
            if length == best
            for p in positions[: self.max_candidates]
        ]
        return self._grow(continuations)

    def _grow(self, continuations: list[list[int]]) -> dict[tuple[int, ...], tuple[int, float]]:
        """Count the continuations in a trie (node: [count, {token: node}]) and take its nodes best-first
        by path probability (child count / parent count x the parent's); ranks by count, then token."""
        trie = [len(continuations), {}]
        for tokens in continuations:
            node = trie
            for token in tokens:
                node = node[1].setdefault(token, [0, {}])
                node[0] += 1
        paths: dict[tuple[int, ...], tuple[int, float]] = {}
        frontier: list = []

        def push_children(path: tuple[int, ...], node: list, prob: float) -> None:
            children = sorted(node[1].items(), key=lambda item: (-item[1][0], item[0]))
            for rank, (token, child) in enumerate(children):
                p = prob * child[0] / node[0]
                if child[0] < self.min_count or p < self.min_prob:
                    break  # the later siblings count less
                path_child = (*path, rank)
                heapq.heappush(frontier, (-p, len(path_child), path_child, token, child))

        push_children((), trie, 1.0)
        while frontier and len(paths) < self.max_nodes - 1:
            neg_p, _, path, token, node = heapq.heappop(frontier)
            paths[path] = (token, -neg_p)
            push_children(path, node, -neg_p)
        return paths

    def _union(self, row_paths: list[dict]) -> list[tuple[int, ...]]:
        """The rows' rank paths, most probable first (in any row), at most max_nodes - 1. A parent is at
        least as probable as its child in every row and sorts first on ties, so the set stays a tree."""
        best: dict[tuple[int, ...], float] = {}
        for paths in row_paths:
            for path, (_, p) in paths.items():
                best[path] = max(best.get(path, 0.0), p)
        return sorted(best, key=lambda c: (-best[c], len(c), c))[: self.max_nodes - 1]

    def report(self) -> DrafterReport:
        """Counts (steps, rows drafted, rows matched and where, matched tokens, nodes proposed) and the
        global cache's size."""
        stats = {
            **self.counts,
            "cache_tokens": self.cache.num_tokens,
            "cache_requests": self.cache.num_requests,
        }
        return DrafterReport({"suffix": stats}, {"suffix_cache": self.cache.memory_bytes()})
