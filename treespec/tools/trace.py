"""A saved record of one generation, step by step: what the heads drafted and what the model kept.

`treespec.generate(..., trace=True)` returns raw per-step dicts (token ids, draft probabilities,
accepted path, bonus token). `Trace.from_result` adds everything a picture needs without the
tokenizer (each token's text, the text generated so far) so that `Trace.save` / `Trace.load`
round-trip through one JSON file and `treespec.tools.viz` can draw it anywhere.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..core.tree import Tree
from ..io import atomic_write_json

FORMAT = "treespec.trace"
VERSION = 1


@dataclass
class Step:
    """One decoding step. Node 0 is the root; ``path`` lists accepted nodes root first.

    token_ids, token_texts, draft_probs: one entry per tree node (draft_probs may be None).
    bonus_id, bonus_text: the base model's own next token after the accepted path.
    text: the generated text after this step (as the tokenizer decodes the tokens so far).
    """

    token_ids: list[int]
    token_texts: list[str]
    draft_probs: list[float] | None
    path: list[int]
    bonus_id: int
    bonus_text: str
    text: str
    choices: list[list[int]] | None = None  # this step's own tree (a dynamic tree); None: the trace's
    expected_accept: float | None = None  # the drafter's predicted accepted length, if it made one

    @property
    def accept_length(self) -> int:
        """Tokens this step's forward pass committed before the bonus (root included)."""
        return len(self.path)

    @property
    def accepted_texts(self) -> list[str]:
        """Texts of the accepted nodes below the root, then the bonus: what the step appended."""
        return [self.token_texts[i] for i in self.path[1:]] + [self.bonus_text]


@dataclass
class Trace:
    """A whole generation: the tree, the prompt, every step, and the run's statistics."""

    choices: list[list[int]]
    prompt_ids: list[int]
    prompt_text: str
    token_ids: list[int]
    text: str
    start_text: str  # the text before the first step: the root token picked after prefill
    steps: list[Step]
    stats: dict[str, Any] = field(default_factory=dict)
    model: str | None = None

    @property
    def tree(self) -> Tree:
        """The candidate tree of the generation (the largest one, when steps had their own)."""
        return Tree.from_choices(self.choices)

    def step_tree(self, index: int) -> Tree:
        """The tree step `index` verified: its own (dynamic trees) or the trace's."""
        choices = self.steps[index].choices
        return self.tree if choices is None else Tree.from_choices(choices)

    # ----- construction -----

    @classmethod
    def from_result(cls, result, tokenizer, model: str | None = None) -> Trace:
        """Build from a `GenerationResult` of ``generate(..., trace=True)``.

        ``tokenizer`` needs ``decode(ids, skip_special_tokens=...)``; each node's token is
        decoded on its own, the running text with special tokens skipped (as ``result.text``).
        """
        if result.tree is None:
            raise ValueError("the result has no tree: was it produced by treespec.generate?")
        if result.stats.steps and not result.trace:
            raise ValueError("the result has no trace: call treespec.generate(..., trace=True)")

        def piece(token_id: int) -> str:
            return tokenizer.decode([int(token_id)], skip_special_tokens=False)

        def running(count: int) -> str:
            return tokenizer.decode(result.token_ids[:count], skip_special_tokens=True)

        steps, emitted = [], 1  # the root picked after prefill comes first
        static = [list(c) for c in result.tree.choices]
        for raw in result.trace:
            emitted = min(emitted + len(raw["path"]), len(result.token_ids))
            probs = raw.get("draft_probs")
            steps.append(
                Step(
                    token_ids=[int(t) for t in raw["tokens"]],
                    token_texts=[piece(t) for t in raw["tokens"]],
                    draft_probs=None if probs is None else [float(p) for p in probs],
                    path=[int(i) for i in raw["path"]],
                    bonus_id=int(raw["bonus"]),
                    bonus_text=piece(raw["bonus"]),
                    text=running(emitted),
                    choices=None if raw.get("choices", static) == static else raw["choices"],
                    expected_accept=raw.get("expected_accept"),
                )
            )
        stats = result.stats.as_dict() | {"summary": result.stats.summary()}
        return cls(
            choices=[list(c) for c in result.tree.choices],
            prompt_ids=list(result.prompt_ids),
            prompt_text=tokenizer.decode(list(result.prompt_ids), skip_special_tokens=False),
            token_ids=list(result.token_ids),
            text=result.text if result.text is not None else running(len(result.token_ids)),
            start_text=running(1),
            steps=steps,
            stats=stats,
            model=model or getattr(tokenizer, "name_or_path", None) or None,
        )

    # ----- serialisation -----

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict with the format tag and version first."""
        return {"format": FORMAT, "version": VERSION, **asdict(self)}

    def save(self, path: str | Path) -> None:
        """Write the trace as JSON (UTF-8, non-ASCII kept readable), atomically."""
        atomic_write_json(path, self.to_dict(), indent=None, ensure_ascii=False, allow_nan=False)

    @classmethod
    def load(cls, path: str | Path) -> Trace:
        """Read a trace file; anything malformed raises ValueError naming the file and the problem."""
        try:
            text = Path(path).read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"{path}: not UTF-8 text: {e}") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON: {e}") from None
        try:
            return cls.from_dict(data)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None

    @classmethod
    def from_dict(cls, data: Any) -> Trace:
        """Inverse of :meth:`to_dict`, validating every field (ValueError says which and why)."""
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError(f'not a trace file (expected a JSON object with "format": "{FORMAT}")')
        version = data.get("version")
        if isinstance(version, bool) or version != VERSION:
            raise ValueError(f"unsupported trace file version {version!r} (expected {VERSION})")
        tree = Tree.from_choices(_field(data, "choices", list))
        raw_steps = _field(data, "steps", list)
        steps = [_parse_step(raw, i, tree) for i, raw in enumerate(raw_steps)]
        return cls(
            choices=[list(c) for c in tree.choices],
            prompt_ids=_int_list(data, "prompt_ids"),
            prompt_text=_field(data, "prompt_text", str),
            token_ids=_int_list(data, "token_ids"),
            text=_field(data, "text", str),
            start_text=_field(data, "start_text", str),
            steps=steps,
            stats=_field(data, "stats", dict),
            model=data.get("model") if isinstance(data.get("model"), str) else None,
        )


# ----- validation helpers -----


def _field(data: dict, key: str, kind: type, where: str = "") -> Any:
    if key not in data:
        raise ValueError(f'{where}missing "{key}"')
    value = data[key]
    if not isinstance(value, kind) or isinstance(value, bool):
        raise ValueError(f'{where}"{key}" must be a {kind.__name__}, got {type(value).__name__}')
    return value


def _int_list(data: dict, key: str, where: str = "") -> list[int]:
    values = _field(data, key, list, where)
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise ValueError(f'{where}"{key}" must be a list of token ids (non-negative ints)')
    return values


def _parse_step(raw: Any, index: int, tree: Tree) -> Step:
    """One step dict -> Step, checked against the tree (sizes, a real root-first path)."""
    where = f"step {index + 1}: "
    if not isinstance(raw, dict):
        raise ValueError(f"{where}expected a JSON object, got {type(raw).__name__}")
    choices = raw.get("choices")
    if choices is not None:
        if not isinstance(choices, list):
            raise ValueError(f'{where}"choices" must be null or a list of choice paths')
        tree = Tree.from_choices(choices)
    expected = raw.get("expected_accept")
    if expected is not None and (isinstance(expected, bool) or not isinstance(expected, (int, float))):
        raise ValueError(f'{where}"expected_accept" must be null or a number')
    n = tree.num_nodes
    token_ids = _int_list(raw, "token_ids", where)
    token_texts = _field(raw, "token_texts", list, where)
    if len(token_ids) != n or len(token_texts) != n:
        raise ValueError(f"{where}expected {n} tokens and texts (one per tree node), got {len(token_ids)}")
    if not all(isinstance(t, str) for t in token_texts):
        raise ValueError(f'{where}"token_texts" must be strings')
    probs = raw.get("draft_probs")
    if probs is not None:
        ok = isinstance(probs, list) and len(probs) == n
        if not ok or not all(_is_probability(p) for p in probs):
            raise ValueError(f'{where}"draft_probs" must be null or {n} probabilities in [0, 1]')
    path = _field(raw, "path", list, where)
    _check_path(path, tree, where)
    bonus_id = _field(raw, "bonus_id", int, where)
    return Step(
        token_ids=token_ids,
        token_texts=token_texts,
        draft_probs=None if probs is None else [float(p) for p in probs],
        path=path,
        bonus_id=bonus_id,
        bonus_text=_field(raw, "bonus_text", str, where),
        text=_field(raw, "text", str, where),
        choices=None if choices is None else [list(c) for c in tree.choices],
        expected_accept=None if expected is None else float(expected),
    )


def _is_probability(p: Any) -> bool:
    return isinstance(p, (int, float)) and not isinstance(p, bool) and math.isfinite(p) and 0 <= p <= 1


def _check_path(path: list, tree: Tree, where: str) -> None:
    """A path starts at the root and each node is a child of the one before."""
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in path):
        raise ValueError(f'{where}"path" must be a list of node indices, got {path}')
    if not path or path[0] != 0:
        raise ValueError(f'{where}"path" must start at the root node 0, got {path}')
    for parent, child in zip(path, path[1:], strict=False):
        if not 0 < child < tree.num_nodes or tree.path_to(child)[-2] != parent:
            raise ValueError(f'{where}"path" {path} is not a branch of the tree ({child!r} after {parent})')
