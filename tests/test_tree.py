"""Tests for treespec.core.tree: construction, validation, derived tensors, serialisation, tree search."""

import itertools
import json
import random
import re

import networkx as nx
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from treespec.core.tree import (
    DEFAULT_TREE_SIZES,
    Tree,
    default_tree,
    pack_bits,
    prior_acceptance,
    unpack_bits,
)

MEDUSA_CHOICES = [[0], [0, 0], [1], [0, 1], [2], [0, 0, 0]]


def chain(n: int) -> Tree:
    """A single path of n nodes: [0], [0, 0], ..."""
    return Tree.chain(n - 1)


@st.composite
def choice_lists(draw, max_nodes: int = 40, max_rank: int = 5) -> list[list[int]]:
    """A random valid choice list grown by random expansion, in shuffled order."""
    paths, seen = [()], {()}
    for _ in range(draw(st.integers(0, max_nodes - 1))):
        parent = paths[draw(st.integers(0, len(paths) - 1))]
        child = (*parent, draw(st.integers(0, max_rank - 1)))
        if child not in seen:
            seen.add(child)
            paths.append(child)
    return draw(st.permutations([list(p) for p in paths[1:]]))


# ----- a known small tree -----


def test_known_tree_tensors():
    t = Tree.from_choices(MEDUSA_CHOICES)
    # nodes: 0=root 1=[0] 2=[1] 3=[2] 4=[0,0] 5=[0,1] 6=[0,0,0]
    assert t.choices == ((0,), (1,), (2,), (0, 0), (0, 1), (0, 0, 0))
    assert (len(t), t.num_nodes, t.max_depth, t.max_rank, t.num_leaves) == (7, 7, 3, 3, 4)
    assert t.parents.tolist() == [-1, 0, 0, 0, 1, 1, 4]
    assert t.depth.tolist() == [0, 1, 1, 1, 2, 2, 3]
    assert t.head.tolist() == [-1, 0, 0, 0, 1, 1, 2]
    assert t.rank.tolist() == [0, 0, 1, 2, 0, 1, 0]
    assert all(x.dtype == torch.long for x in (t.parents, t.depth, t.head, t.rank, t.leaf_paths))
    expected_mask = [
        [1, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0, 0],
        [1, 0, 0, 1, 0, 0, 0],
        [1, 1, 0, 0, 1, 0, 0],
        [1, 1, 0, 0, 0, 1, 0],
        [1, 1, 0, 0, 1, 0, 1],
    ]
    assert t.ancestor_mask.dtype == torch.bool
    assert t.ancestor_mask.int().tolist() == expected_mask
    assert t.ancestor_bits.dtype == torch.int64
    assert t.ancestor_bits.flatten().tolist() == [0b1, 0b11, 0b101, 0b1001, 0b10011, 0b100011, 0b1010011]
    assert t.leaf_paths.tolist() == [[0, 2, -1, -1], [0, 3, -1, -1], [0, 1, 5, -1], [0, 1, 4, 6]]
    assert t.token_index(3).tolist() == [0, 1, 2, 3, 4, 5, 7]
    assert t.token_index(10).tolist() == [0, 1, 2, 3, 11, 12, 21]
    assert t.path_to(6) == [0, 1, 4, 6]
    assert t.path_to(0) == [0]
    assert t.children(0) == [1, 2, 3]
    assert t.children(1) == [4, 5]
    assert t.children(6) == []
    assert "num_nodes=7" in repr(t)


def test_token_index_gathers_candidates():
    t = Tree.from_choices(MEDUSA_CHOICES)
    root = torch.tensor([100])
    topk = torch.tensor([[10, 11, 12, 13], [20, 21, 22, 23], [30, 31, 32, 33]])  # [heads, topk]
    tokens = torch.cat([root, topk.flatten()])[t.token_index(4)]
    assert tokens.tolist() == [100, 10, 11, 12, 20, 21, 30]
    with pytest.raises(ValueError, match="topk=2"):
        t.token_index(2)


def test_chain():
    assert Tree.chain(3).choices == ((0,), (0, 0), (0, 0, 0)) and Tree.chain(0).num_nodes == 1


def test_root_only_tree():
    t = Tree.from_choices([])
    assert (t.num_nodes, t.max_depth, t.max_rank, t.num_leaves) == (1, 0, 0, 1)
    assert t.parents.tolist() == [-1]
    assert t.ancestor_mask.tolist() == [[True]]
    assert t.leaf_paths.tolist() == [[0]]
    assert t.token_index(1).tolist() == [0]
    assert t.expected_accept_length([]) == 1.0


def test_missing_earlier_sibling_is_fine():
    t = Tree.from_choices([[1], [1, 3]])
    assert t.rank.tolist() == [0, 1, 3]
    assert t.max_rank == 4
    assert t.token_index(4).tolist() == [0, 2, 8]


def test_canonicalisation():
    ref = Tree.from_choices(MEDUSA_CHOICES)
    rng = random.Random(0)
    for _ in range(5):
        shuffled = MEDUSA_CHOICES[:]
        rng.shuffle(shuffled)
        t = Tree.from_choices(shuffled)
        assert t == ref and hash(t) == hash(ref)
        assert torch.equal(t.ancestor_mask, ref.ancestor_mask)
    assert Tree.from_choices(tuple(tuple(p) for p in MEDUSA_CHOICES)) == ref
    assert Tree(MEDUSA_CHOICES) == ref
    assert Tree.from_choices(ref.choices) == ref
    assert ref != Tree.from_choices([[0]])


# ----- validation -----


@pytest.mark.parametrize(
    "choices, message",
    [
        ([[0], []], "empty choice path []"),
        ([[0], [0, -1]], "[0, -1] has a negative rank -1"),
        ([[0], [0, 1.5]], "[0, 1.5] has a non-integer rank 1.5"),
        ([[0], [0, "1"]], "[0, '1'] has a non-integer rank '1'"),
        ([[0], [True]], "[True] has a non-integer rank True"),
        ([[0], [1], [0]], "duplicate choice path [0]"),
        ([[0], [0, 1], (0, 1)], "duplicate choice path [0, 1]"),
        ([[0, 1]], "choice path [0, 1] has no parent: [0] is missing"),
        ([[0], [0, 0], [1, 2, 3], [1]], "choice path [1, 2, 3] has no parent: [1, 2] is missing"),
        ([[0], 3], "choice path 3 is not a list"),
        ("[[0]]", "choices must be a list"),
        ({(0,): 1}, "choices must be a list"),
        (None, "choices must be a list"),
    ],
)
def test_validation_errors(choices, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        Tree.from_choices(choices)


def test_max_depth():
    message = "choice path [0, 0, 0] needs 3 drafting heads but the drafter has max_depth=2"
    with pytest.raises(ValueError, match=re.escape(message)):
        Tree.from_choices(MEDUSA_CHOICES, max_depth=2)
    assert Tree.from_choices(MEDUSA_CHOICES, max_depth=3).max_depth == 3
    assert Tree.from_choices([], max_depth=0).num_nodes == 1
    with pytest.raises(ValueError, match="max_depth"):
        Tree.from_choices(MEDUSA_CHOICES, max_depth=-1)


def test_node_range():
    t = Tree.from_choices(MEDUSA_CHOICES)
    with pytest.raises(IndexError):
        t.path_to(7)
    with pytest.raises(IndexError):
        t.children(-1)


# ----- invariants on random trees -----


def check_invariants(t: Tree) -> None:
    n = t.num_nodes
    assert t.parents.shape == t.depth.shape == t.head.shape == t.rank.shape == (n,)
    assert t.ancestor_mask.shape == (n, n)
    assert t.ancestor_mask.diagonal().all()
    for i in range(n):
        path = t.path_to(i)
        assert path[0] == 0 and path[-1] == i and len(path) == int(t.depth[i]) + 1
        assert torch.nonzero(t.ancestor_mask[i]).flatten().tolist() == sorted(path)
        for c in t.children(i):
            assert int(t.parents[c]) == i and c > i
        if i > 0:
            assert t.choices[i - 1][-1] == int(t.rank[i]) and int(t.head[i]) == int(t.depth[i]) - 1
    assert t.ancestor_bits.shape == (n, (n + 63) // 64)
    assert torch.equal(unpack_bits(t.ancestor_bits, n), t.ancestor_mask)
    assert torch.equal(t.ancestor_bits, pack_bits(t.ancestor_mask))  # the words pack_bits writes
    assert t.ancestor_mask.dtype == torch.bool and t.leaf_paths.dtype == torch.long

    leaves = [i for i in range(n) if not t.children(i)]
    assert t.leaf_paths.shape == (len(leaves), t.max_depth + 1) == (t.num_leaves, t.max_depth + 1)
    ends = []
    for row in t.leaf_paths.tolist():
        nodes = [x for x in row if x >= 0]
        assert row == nodes + [-1] * (len(row) - len(nodes))  # padding only at the end
        assert nodes[0] == 0
        assert all(int(t.parents[b]) == a for a, b in itertools.pairwise(nodes))
        ends.append(nodes[-1])
    assert ends == leaves

    assert Tree.from_json(t.to_json()) == t
    g = t.to_networkx()
    assert list(g.nodes) == list(range(n)) and g.number_of_edges() == n - 1
    assert Tree.from_networkx(g) == t


@settings(max_examples=60, deadline=None)
@given(choice_lists())
def test_random_tree_invariants(choices):
    t = Tree.from_choices(choices)
    assert t.num_nodes == len(choices) + 1
    assert t == Tree.from_choices(sorted(choices))
    check_invariants(t)


@pytest.mark.parametrize("n", [63, 64, 65, 129, 200])
def test_large_trees_bits(n):
    for t in (chain(n), Tree.from_acceptance(prior_acceptance(5), n)):
        assert t.num_nodes == n
        check_invariants(t)
    # bit 63 lands on the sign bit of the int64 word
    last = chain(n).ancestor_bits[-1]
    assert last[0].item() == (-1 if n >= 64 else (1 << n) - 1)


def test_pack_bits_roundtrip():
    g = torch.Generator().manual_seed(0)
    for m in (1, 63, 64, 65, 128, 130):
        mask = torch.rand(5, m, generator=g) > 0.5
        bits = pack_bits(mask)
        assert bits.shape == (5, (m + 63) // 64)
        assert torch.equal(unpack_bits(bits, m), mask)
        for i, j in [(0, 0), (4, m - 1), (2, m // 2)]:
            assert bool((bits[i, j // 64] >> (j % 64)) & 1) == bool(mask[i, j])


# ----- serialisation -----


def test_json_format(tmp_path):
    t = Tree.from_choices(MEDUSA_CHOICES)
    data = json.loads(t.to_json())
    assert data == {"format": "treespec.tree", "version": 1, "choices": [list(p) for p in t.choices]}
    path = tmp_path / "tree.json"
    t.save(path)
    assert Tree.load(path) == t
    assert Tree.load(str(path)) == t
    with pytest.raises(ValueError, match=re.escape(f"{path}: choice path [0, 0, 0] needs 3 drafting heads")):
        Tree.load(path, max_depth=2)


@pytest.mark.parametrize(
    "text, problem",
    [
        ("{not json", "not valid JSON"),
        ("[[0], [1]]", "not a tree file"),
        ('{"format": "other", "version": 1, "choices": []}', "not a tree file"),
        ('{"format": "treespec.tree", "version": 2, "choices": []}', "unsupported tree file version 2"),
        ('{"format": "treespec.tree", "choices": []}', "unsupported tree file version None"),
        ('{"format": "treespec.tree", "version": 1}', 'missing "choices"'),
        ('{"format": "treespec.tree", "version": 1, "choices": [[0, 1]]}', "[0] is missing"),
        ('{"format": "treespec.tree", "version": 1, "choices": {"a": 1}}', "choices must be a list"),
    ],
)
def test_bad_json_file(tmp_path, text, problem):
    path = tmp_path / "bad_tree.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=re.escape(str(path)) + ".*" + re.escape(problem)):
        Tree.load(path)


def test_non_utf8_file(tmp_path):
    path = tmp_path / "binary.json"
    path.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ValueError, match=re.escape(str(path))):
        Tree.load(path)


def test_networkx():
    t = Tree.from_choices(MEDUSA_CHOICES)
    g = t.to_networkx()
    assert isinstance(g, nx.DiGraph)
    assert g.nodes[6] == {"depth": 3, "head": 2, "rank": 0, "choice": (0, 0, 0)}
    assert g.nodes[0] == {"depth": 0, "head": -1, "rank": 0, "choice": ()}
    assert sorted(g.edges) == [(0, 1), (0, 2), (0, 3), (1, 4), (1, 5), (4, 6)]

    # rebuild from edges + rank only, with arbitrary labels
    bare = nx.DiGraph()
    bare.add_node("root")
    for i in range(1, t.num_nodes):
        bare.add_node(f"n{i}", rank=int(t.rank[i]))
        parent = int(t.parents[i])
        bare.add_edge("root" if parent == 0 else f"n{parent}", f"n{i}")
    assert Tree.from_networkx(bare) == t

    no_rank = nx.DiGraph([(0, 1)])
    with pytest.raises(ValueError, match="rank"):
        Tree.from_networkx(no_rank)
    with pytest.raises(ValueError, match="tree"):
        Tree.from_networkx(nx.DiGraph([(0, 1), (2, 1)]))
    with pytest.raises(ValueError, match="non-empty"):
        Tree.from_networkx(nx.DiGraph())
    two_roots = t.to_networkx()
    two_roots.nodes[1]["choice"] = ()
    with pytest.raises(ValueError, match="exactly one root"):
        Tree.from_networkx(two_roots)


# ----- tree search -----


def test_expected_accept_length_by_hand():
    t = Tree.from_choices([[0], [1], [0, 0]])
    acc = [[0.6, 0.2], [0.5, 0.1]]
    assert t.expected_accept_length(acc) == pytest.approx(1 + 0.6 + 0.2 + 0.6 * 0.5)
    with pytest.raises(ValueError, match=re.escape("[0, 0]")):
        t.expected_accept_length([[0.6, 0.2]])
    with pytest.raises(ValueError, match="probability"):
        t.expected_accept_length([[0.6, 1.2], [0.5]])


def test_from_acceptance_by_hand():
    acc = [[0.6, 0.3], [0.5, 0.4]]
    # values: [0]=.6, [1]=.3, [0,0]=.3 (tie -> shorter path first), [0,1]=.24, [1,0]=.15, [1,1]=.12
    assert Tree.from_acceptance(acc, 1).choices == ()
    assert Tree.from_acceptance(acc, 4).choices == ((0,), (1,), (0, 0))
    assert Tree.from_acceptance(acc, 5).choices == ((0,), (1,), (0, 0), (0, 1))
    assert Tree.from_acceptance(acc, 7).num_nodes == 7
    with pytest.raises(ValueError, match="only allows 7 nodes"):
        Tree.from_acceptance(acc, 8)
    with pytest.raises(ValueError, match="num_nodes"):
        Tree.from_acceptance(acc, 0)
    with pytest.raises(ValueError, match="probability"):
        Tree.from_acceptance([[0.5, -0.1]], 2)


def all_paths(shape: list[int]) -> list[tuple[int, ...]]:
    """Every choice path for heads with shape[h] ranks each."""
    paths = []
    for d in range(1, len(shape) + 1):
        paths += itertools.product(*(range(k) for k in shape[:d]))
    return paths


def brute_force_best(acc: list[list[float]], num_nodes: int) -> float:
    """Max expected accepted length over every valid tree of num_nodes nodes."""
    paths = all_paths([len(row) for row in acc])
    best = 0.0
    for subset in itertools.combinations(paths, num_nodes - 1):
        chosen = set(subset)
        if all(len(p) == 1 or p[:-1] in chosen for p in chosen):
            best = max(best, Tree.from_choices(list(chosen)).expected_accept_length(acc))
    return best


probability = st.one_of(st.sampled_from([0.0, 0.25, 0.5, 1.0]), st.floats(0.0, 1.0))


@settings(max_examples=40, deadline=None)
@given(
    st.sampled_from([[2, 2], [3, 2], [2, 2, 2]]).flatmap(
        lambda shape: st.tuples(*(st.lists(probability, min_size=k, max_size=k) for k in shape))
    ),
    st.integers(2, 5),
)
def test_from_acceptance_is_optimal(acc, num_nodes):
    acc = [list(row) for row in acc]
    t = Tree.from_acceptance(acc, num_nodes)
    assert t.num_nodes == num_nodes
    best = brute_force_best(acc, num_nodes)
    assert t.expected_accept_length(acc) == pytest.approx(best, rel=1e-12, abs=1e-12)


def test_from_acceptance_deterministic():
    acc = [[0.5] * 3] * 3  # all ties
    t = Tree.from_acceptance(acc, 6)
    assert t.choices == ((0,), (1,), (2,), (0, 0), (0, 1))
    assert Tree.from_acceptance(torch.tensor(acc), 6) == t  # tensors work as tables too


@pytest.mark.parametrize("num_heads", [2, 3, 4, 5])
@pytest.mark.parametrize("size", DEFAULT_TREE_SIZES)
def test_default_tree(size, num_heads):
    t = default_tree(size, num_heads)
    assert t.num_nodes == size
    assert 1 <= t.max_depth <= num_heads
    assert default_tree(size, num_heads) is t  # cached
    check_invariants(t)


def test_default_tree_too_big():
    with pytest.raises(ValueError, match="only allows 11 nodes"):
        default_tree(16, num_heads=1)  # one head with 10 ranks


def test_default_tree_defaults():
    t = default_tree()
    assert t.num_nodes == 32 and t.max_depth <= 4
    assert t == Tree.from_acceptance(prior_acceptance(4), 32)
    assert Tree.from_choices(t.choices, max_depth=4) == t
