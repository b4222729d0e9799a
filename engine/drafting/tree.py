"""Draft-tree utilities: pure tensor logic shared by the EAGLE drafters and the verifier.

A draft tree is described by ``parents`` (LongTensor[n], ``-1`` = child of the root). The root is the
last emitted token, which the target has not processed yet, so a verify pass feeds ``[root] + nodes``:
"input index" 0 is the root and node ``i`` is input index ``i + 1``. Nodes are always ordered so that
parents precede children, which makes every construction below a single forward sweep.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

# EAGLE-1's default static tree (``mc_sim_7b_63`` in the EAGLE repository): 25 nodes, depth 5,
# fan-out 4 at the root. Each path lists the sibling rank taken at every level (0 = top-1 token).
EAGLE1_TREE: list[list[int]] = [
    [0],
    [1],
    [2],
    [3],
    [0, 0],
    [0, 1],
    [0, 2],
    [1, 0],
    [1, 1],
    [2, 0],
    [2, 1],
    [3, 0],
    [0, 0, 0],
    [0, 0, 1],
    [0, 0, 2],
    [0, 1, 0],
    [0, 1, 1],
    [0, 2, 0],
    [0, 2, 1],
    [1, 0, 0],
    [0, 0, 0, 0],
    [0, 0, 0, 1],
    [0, 0, 0, 2],
    [0, 0, 0, 0, 0],
    [0, 0, 0, 0, 1],
]


def validate_parents(parents: Tensor) -> None:
    """Raise ValueError unless every parent is -1 or an earlier node."""
    idx = torch.arange(parents.numel())
    if parents.dim() != 1 or bool(((parents < -1) | (parents >= idx)).any()):
        raise ValueError(f"tree parents must precede their children, got {parents.tolist()}")


def node_depths(parents: Tensor) -> Tensor:
    """Depth of every node (1 = child of the root). LongTensor[n]."""
    depths: list[int] = []
    for p in parents.tolist():
        depths.append(1 if p < 0 else depths[p] + 1)
    return torch.tensor(depths, dtype=torch.long)


def ancestor_mask(parents: Tensor) -> Tensor:
    """Bool[n, n]: ``mask[i, j]`` is True when node j is node i or one of its ancestors."""
    n = parents.numel()
    rows: list[list[bool]] = []  # plain lists: per-element tensor writes cost more than the whole build
    for i, p in enumerate(parents.tolist()):
        row = rows[p].copy() if p >= 0 else [False] * n
        row[i] = True
        rows.append(row)
    return torch.tensor(rows, dtype=torch.bool).reshape(n, n)


def children_lists(parents: Tensor) -> list[list[int]]:
    """Children in input-index space: entry 0 is the root, entry i + 1 is node i; siblings keep draft order."""
    children: list[list[int]] = [[] for _ in range(parents.numel() + 1)]
    for i, p in enumerate(parents.tolist()):
        children[p + 1].append(i + 1)
    return children


def retrieve_paths(parents: Tensor) -> Tensor:
    """One root-to-leaf path per leaf in input-index space (root = 0), right-padded with -1:
    EAGLE's retrieve indices, for callers that gather per path. The engine's walk needs only the
    children lists, so the verify layout does not build these each step.

    LongTensor[leaves, max_depth + 1]; with no nodes, the single path ``[[0]]``.
    """
    n = parents.numel()
    if n == 0:
        return torch.zeros(1, 1, dtype=torch.long)
    plist = parents.tolist()
    is_parent = [False] * n
    for p in plist:
        if p >= 0:
            is_parent[p] = True
    paths = []
    for leaf in (i for i in range(n) if not is_parent[i]):
        path, node = [], leaf
        while node >= 0:
            path.append(node + 1)
            node = plist[node]
        paths.append([0] + path[::-1])
    width = max(len(p) for p in paths)
    return torch.tensor([p + [-1] * (width - len(p)) for p in paths], dtype=torch.long)


@dataclass(frozen=True)
class VerifyLayout:
    """What one verify pass over ``[root] + nodes`` needs, all in input-index space."""

    positions: Tensor  # LongTensor[n + 1]: depth offsets to add to the current length (root 0)
    mask: Tensor  # Bool[n + 1, n + 1]: ancestors-or-self, the root visible to all
    children: list[list[int]]  # children[i]: inputs whose parent is input i, in draft order

    @classmethod
    def from_parents(cls, parents: Tensor) -> VerifyLayout:
        parents = parents.to("cpu", torch.long)
        validate_parents(parents)
        n = parents.numel()
        mask = torch.zeros(n + 1, n + 1, dtype=torch.bool)
        mask[:, 0] = True
        mask[1:, 1:] = ancestor_mask(parents)
        positions = torch.cat([torch.zeros(1, dtype=torch.long), node_depths(parents)])
        return cls(positions, mask, children_lists(parents))

    def attention_mask(self, prefix_len: int) -> Tensor:
        """Bool[n + 1, prefix_len + n + 1]: the whole cached prefix, then the tree mask."""
        prefix = torch.ones(self.mask.shape[0], prefix_len, dtype=torch.bool)
        return torch.cat([prefix, self.mask], dim=1)


def longest_greedy_path(tokens: Tensor, parents: Tensor, target_argmax: Tensor) -> list[int]:
    """Input indices of the longest accepted path under greedy verification, root first.

    ``tokens`` [n] are the draft tokens and ``target_argmax`` [n + 1] the target's argmax at every
    input; node i is accepted iff its parent was accepted and ``tokens[i] == target_argmax[parent]``.
    """
    layout_children = children_lists(parents)
    path, node = [0], 0
    arg = target_argmax.tolist()
    toks = tokens.tolist()
    while True:
        nxt = next((c for c in layout_children[node] if toks[c - 1] == arg[node]), None)
        if nxt is None:
            return path
        path.append(nxt)
        node = nxt


@dataclass(frozen=True)
class StaticTree:
    """A tree fixed by ``tree_choices``: node i is reached by taking sibling rank ``ranks[i]`` under ``parents[i]``."""

    parents: Tensor  # LongTensor[n], -1 = root
    ranks: Tensor  # LongTensor[n]: which top-k entry of the parent's distribution the node takes
    depths: Tensor  # LongTensor[n]
    levels: list[Tensor]  # node indices per depth, levels[0] = depth 1
    expand: list[Tensor]  # expand[d]: nodes of depth d (levels[d - 1]) that have children; expand[0] is unused
    fan_out: list[int]  # fan_out[d]: children to draw per expanded node at depth d + 1 (max rank + 1)

    @classmethod
    def from_choices(cls, tree_choices: list[list[int]]) -> StaticTree:
        """Build from paths such as ``[[0], [1], [0, 0]]``; every prefix of a path must be listed too."""
        paths = _validated_paths(tree_choices)
        index = {p: i for i, p in enumerate(paths)}
        parents = torch.tensor([index[p[:-1]] if len(p) > 1 else -1 for p in paths], dtype=torch.long)
        ranks = torch.tensor([p[-1] for p in paths], dtype=torch.long)
        depths = torch.tensor([len(p) for p in paths], dtype=torch.long)
        max_depth = int(depths.max())
        levels = [torch.nonzero(depths == d).flatten() for d in range(1, max_depth + 1)]
        has_children = torch.zeros(len(paths), dtype=torch.bool)
        has_children[parents[parents >= 0]] = True
        expand = [torch.empty(0, dtype=torch.long)] + [lvl[has_children[lvl]] for lvl in levels[:-1]]
        fan_out = [int(ranks[lvl].max()) + 1 for lvl in levels]
        return cls(parents, ranks, depths, levels, expand, fan_out)

    def __len__(self) -> int:
        return self.parents.numel()


def _validated_paths(tree_choices: list[list[int]]) -> list[tuple[int, ...]]:
    if not isinstance(tree_choices, (list, tuple)) or not tree_choices:
        raise ValueError("tree_choices: expected a non-empty list of paths such as [[0], [1], [0, 0]]")
    paths = set()
    for raw in tree_choices:
        if (
            not isinstance(raw, (list, tuple))
            or not raw
            or not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in raw)
        ):
            raise ValueError(f"tree_choices: each path must be a non-empty list of ranks >= 0, got {raw!r}")
        path = tuple(raw)
        if path in paths:
            raise ValueError(f"tree_choices: duplicate path {list(path)}")
        paths.add(path)
    for path in paths:
        if len(path) > 1 and path[:-1] not in paths:
            raise ValueError(f"tree_choices: path {list(path)} needs its prefix {list(path[:-1])}")
    return sorted(paths, key=lambda p: (len(p), p))


def topk_children(parent_scores: Tensor, logprobs: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """EAGLE-2 expansion: each frontier node's top-k tokens, scored by cumulative log-prob.

    ``parent_scores`` [f], ``logprobs`` [f, V] -> (tokens [f, k], scores [f, k]).
    """
    top = torch.topk(logprobs, k, dim=-1)
    return top.indices, parent_scores[:, None] + top.values


def rerank(scores: Tensor, parents: Tensor, budget: int) -> tuple[Tensor, Tensor]:
    """Keep the ``budget`` best-scoring candidates as a tree (EAGLE-2's rerank).

    Candidates are in creation order (parents first) with scores that never rise along a path.
    A stable descending sort breaks ties by creation order, so a parent always outranks its
    children and the kept set is closed under ancestors. Returns (kept candidate indices in
    creation order, their parents re-indexed into the kept list, -1 = root).
    """
    order = torch.sort(scores, descending=True, stable=True).indices[:budget]
    kept = torch.sort(order).values
    remap = torch.full((scores.numel() + 1,), -1, dtype=torch.long, device=scores.device)
    remap[kept + 1] = torch.arange(kept.numel(), device=scores.device)
    return kept, remap[parents[kept] + 1]
