"""The EAGLE drafters: ``EagleDrafter`` grows EAGLE-1's static tree (``tree_choices``),
``Eagle2Drafter`` EAGLE-2's dynamic one (for ``eagle_2`` and ``eagle_3`` alike), over any
`DraftHead` (eagle_head.py, eagle3_head.py).

Both feed every node of one depth through the head in a single batched pass with a tree mask over
the head's preallocated KV cache, and draft deterministically (top-k, ``q`` None), so the engine's
verifier keeps the output lossless whatever the head predicts.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod

import torch
from torch import Tensor

from ..model.step import Step
from .drafters import DraftTree, Plan
from .eagle_head import DraftHead
from .tree import EAGLE1_TREE, StaticTree, ancestor_mask, node_depths, rerank, topk_children

# Below this frontier probability mass a further head pass costs more than the tokens it can add:
# one pass is about a quarter of a target step for the fixture on this project's CPU
# (benchmarks/eagle_drafting.py), and there it cut head passes 4x at no loss of accepted tokens
# per step. Large targets on a GPU (a head pass ~7% of a step) would pay for a lower floor.
MIN_FRONTIER_MASS = 0.25


class HeadDrafter(ABC):
    """Per-request drafting state over a preallocated head KV cache of the request's own.

    The head cache holds one entry per committed pair (f_j, t_{j+1}) at slot and position j; the
    tree part of a step lives in the slots after them and is simply overwritten next step, so
    "dropping" it costs nothing. Pairs the target has confirmed wait in ``_pending`` until the next
    ``propose`` runs them through the head in one pass together with the root; after plain steps
    (no proposal) that pass catches up on all of them at once.
    """

    def __init__(self, head: DraftHead, target, max_tree_inputs: int):
        """The drafter drafts in a head cache of its own (its row's), so many requests draft with one head."""
        self.head = head
        self.taps = head.taps  # the target features the engine must hand to reset/accept
        self.embed = target.embed_tokens
        self.device = target.embed_tokens.weight.device
        head.setup_drafting(target, target.max_seq_len + max_tree_inputs)
        self.step = functools.partial(head.step, cache=head.drafting_cache(target.max_seq_len + max_tree_inputs))
        self.committed = 0  # pairs in the head cache
        self._pending: list[tuple[Tensor, Tensor]] = []  # confirmed (features [m, H], next tokens [m])

    def reset(self, input_ids: Tensor, hidden: Tensor) -> None:
        """``input_ids`` [L+1] = prompt + first sampled token, ``hidden`` [L, F] = prompt features
        (F = H, or len(taps) x H for a head fed by several target layers)."""
        self.committed = 0
        self._pending = [(hidden.reshape(-1, hidden.shape[-1]), input_ids.reshape(-1)[1:])]

    def accept(self, tokens: Tensor, hidden: Tensor) -> None:
        """``tokens`` [m+1] emitted this step, ``hidden`` [m+1, H]: the features that predicted them."""
        self._pending.append((hidden.reshape(-1, hidden.shape[-1]), tokens.reshape(-1)))

    @torch.inference_mode()
    def propose(self, plan: Plan) -> DraftTree:
        root_feature = self._commit_pending()
        return self._grow(root_feature, plan)

    @property
    def pending(self) -> int:
        """Confirmed pairs the next ``propose`` runs through the head first."""
        return sum(ids.numel() for _, ids in self._pending)

    @property
    @abstractmethod
    def largest(self) -> int:
        """The most nodes a tree of this drafter has."""

    @abstractmethod
    def propose_at_most(self, tokens: int) -> DraftTree:
        """A tree of at most ``tokens`` nodes, parents first: a batch's plan gives each row a count."""

    def _commit_pending(self) -> Tensor:
        """Run the confirmed pairs through the head; returns the root's predicted feature [1, H]."""
        if not self._pending:
            raise RuntimeError("call reset() before propose(), and accept() after each step")
        feats, ids = (torch.cat(parts) for parts in zip(*self._pending, strict=True))
        self._pending = []
        m = ids.numel()
        out = self.step(feats[None], ids[None], self.embed, Step.span(self.committed, m, self.device))
        self.committed += m
        return out[0, -1:]

    def _expand(
        self, feats: Tensor, tokens: Tensor, depth: int, slots: Tensor, tree_mask: Tensor
    ) -> tuple[Tensor, Tensor]:
        """Feed ``q`` tree nodes of one ``depth`` (1 = child of the root) in one head pass.

        ``feats`` [q, H] are their parents' predicted features, ``slots`` [q] their tree slots and
        ``tree_mask`` Bool [q, tree_len] their ancestors-or-self among the tree slots. Returns the
        log-probs of their children [q, draft vocabulary] and their own predicted features [q, H].
        """
        n = self.committed
        prefix = torch.ones(tree_mask.shape[0], n, dtype=torch.bool, device=self.device)
        at = Step(
            torch.full_like(slots, n - 1 + depth),
            slots + n,
            torch.cat([prefix, tree_mask], dim=1),
            n + tree_mask.shape[1],
        )
        out = self.step(feats[None], tokens[None], self.embed, at)
        return self.head.draft_logprobs(out[0]), out[0]

    @abstractmethod
    def _grow(self, root_feature: Tensor, plan: Plan) -> DraftTree:
        """Build this step's tree, at most ``plan``, from the root's predicted feature [1, H]."""


class EagleDrafter(HeadDrafter):
    """EAGLE: the tree shape is fixed by ``tree_choices``; node i takes its parent's ``ranks[i]``-th token.
    A plan of depth d grows the levels up to d only (nodes are ordered by depth, so they are a prefix)."""

    def __init__(self, head: DraftHead, target, tree_choices: list[list[int]] | None = None):
        tree = StaticTree.from_choices(EAGLE1_TREE if tree_choices is None else tree_choices)
        if max(tree.fan_out) > head.draft_vocab_size:
            raise ValueError(
                f"tree_choices: rank {max(tree.fan_out) - 1} is beyond the vocabulary of {head.draft_vocab_size} tokens"
            )
        super().__init__(head, target, len(tree))
        self.tree = tree
        self.depth_of = node_depths(tree.parents).tolist()
        self.parents = tree.parents.to(self.device)
        mask = ancestor_mask(tree.parents)
        row_of = torch.full((len(tree),), -1, dtype=torch.long)
        # per fed depth: (fed nodes, their parents, tree mask, children, parent row, child ranks, fan-out)
        self.plan: list[tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, int]] = []
        for depth in range(1, len(tree.levels)):
            fed, children = tree.expand[depth], tree.levels[depth]
            row_of[fed] = torch.arange(fed.numel())
            tree_len = int(fed.max()) + 1
            step = (
                fed,
                tree.parents[fed],
                mask[fed, :tree_len],
                children,
                row_of[tree.parents[children]],
                tree.ranks[children],
            )
            nodes, parents, tree_mask, kids, parent_row, ranks = (t.to(self.device) for t in step)
            self.plan.append((nodes, parents, tree_mask, kids, parent_row, ranks, tree.fan_out[depth]))
        self.first, self.first_ranks = (t.to(self.device) for t in (tree.levels[0], tree.ranks[tree.levels[0]]))

    @property
    def largest(self) -> int:
        return len(self.tree)

    def propose_at_most(self, tokens: int) -> DraftTree:
        """The static tree's first ``tokens`` nodes (the levels they reach grown, the rest cut)."""
        n = min(tokens, len(self.tree))
        return self.propose(Plan(n, self.depth_of[n - 1])).prefix(n)

    def _grow(self, root_feature: Tensor, plan: Plan) -> DraftTree:
        tree = self.tree
        tokens = torch.empty(len(tree), dtype=torch.long, device=self.device)
        feats = root_feature.new_empty(len(tree), root_feature.shape[-1])
        top = self.head.to_target(torch.topk(self.head.draft_logprobs(root_feature)[0], tree.fan_out[0]).indices)
        tokens[self.first] = top[self.first_ranks]
        levels = self.plan[: plan.depth - 1]
        for depth, (fed, fed_parents, tree_mask, children, parent_row, ranks, fan_out) in enumerate(levels, 1):
            in_feats = root_feature.expand(fed.numel(), -1) if depth == 1 else feats[fed_parents]
            logp, out = self._expand(in_feats, tokens[fed], depth, fed, tree_mask)
            feats[fed] = out
            tokens[children] = self.head.to_target(torch.topk(logp, fan_out, dim=-1).indices[parent_row, ranks])
        n = int(tree.levels[plan.depth - 1][-1]) + 1  # the nodes of depth <= plan.depth
        return DraftTree(tokens[:n], self.parents[:n], None)


class Eagle2Drafter(HeadDrafter):
    """EAGLE-2: expand the ``top_k`` best nodes per depth by cumulative log-prob, keep the best ``plan.tokens``.

    ``total_tokens`` and ``depth`` size the buffers for the largest plan; each step's plan may ask
    for less (a smaller budget also narrows the frontier to ``min(top_k, budget)``). A level is
    expanded only while its frontier holds at least ``min_frontier_mass`` of the draft's
    probability (EAGLE-2's observation: draft confidence tracks acceptance), so an unsure head
    stops early and a confident one drafts deep. 0 gives EAGLE-2 exactly.
    """

    def __init__(
        self,
        head: DraftHead,
        target,
        total_tokens: int,
        depth: int = 6,
        top_k: int = 10,
        min_frontier_mass: float = MIN_FRONTIER_MASS,
    ):
        if total_tokens < 1 or depth < 1 or top_k < 1:
            raise ValueError(
                f"eagle_2: total_tokens, depth and top_k must be >= 1, got {total_tokens}, {depth}, {top_k}"
            )
        # A node ranked below ``total_tokens`` among its siblings or its level is outranked by at least
        # ``total_tokens`` nodes, so neither it nor its descendants can be kept: wider is wasted work.
        k = min(top_k, total_tokens, head.draft_vocab_size)
        fed = (depth - 1) * k
        super().__init__(head, target, fed)
        self.total_tokens, self.depth, self.top_k = total_tokens, depth, k
        self.min_frontier_mass = min_frontier_mass
        n_cand = k + (depth - 1) * k * k
        dev = self.device
        self.cand_tokens = torch.empty(n_cand, dtype=torch.long, device=dev)
        self.cand_scores = torch.empty(n_cand, device=dev)
        self.cand_parents = torch.empty(n_cand, dtype=torch.long, device=dev)
        self.fed_mask = torch.zeros(fed, fed, dtype=torch.bool, device=dev)  # ancestors-or-self among fed slots
        self.fed_slots = torch.arange(fed, device=dev)  # depth d's frontier of k nodes: slots (d-1)k .. dk-1
        self.root_children = torch.arange(k, device=dev)  # candidate indices of the first level
        self.zero = torch.zeros(1, device=dev)

    @property
    def largest(self) -> int:
        return self.total_tokens

    def propose_at_most(self, tokens: int) -> DraftTree:
        return self.propose(Plan(min(tokens, self.total_tokens), min(tokens, self.depth)))

    def _grow(self, root_feature: Tensor, plan: Plan) -> DraftTree:
        budget, k = plan.tokens, min(self.top_k, plan.tokens)
        rows_by_depth = self.fed_slots[: (plan.depth - 1) * k].view(-1, k)
        tok, score = topk_children(self.zero, self.head.draft_logprobs(root_feature), k)
        tok = self.head.to_target(tok)
        self.cand_tokens[:k], self.cand_scores[:k], self.cand_parents[:k] = tok[0], score[0], -1
        front_idx, front_tok, front_score = self.root_children[:k], tok[0], score[0]
        front_feat, parent_rows = root_feature.expand(k, -1), None
        recorded = k
        for depth in range(1, plan.depth):
            if recorded >= budget and float(front_score.max()) <= float(
                torch.topk(self.cand_scores[:recorded], budget).values[-1]
            ):
                break  # scores only fall along a path, so no descendant could make the budget: save the passes
            if float(front_score.exp().sum()) < self.min_frontier_mass:
                break  # the next level's expected extra accepted tokens (at most this mass) won't pay for a pass
            rows = rows_by_depth[depth - 1]
            self.fed_mask[rows] = False if parent_rows is None else self.fed_mask[parent_rows]
            self.fed_mask[rows, rows] = True
            logp, out = self._expand(front_feat, front_tok, depth, rows, self.fed_mask[rows, : depth * k])
            tok, score = topk_children(front_score, logp, k)
            tok, score = self.head.to_target(tok.flatten()), score.flatten()
            base = k + (depth - 1) * k * k
            self.cand_tokens[base : base + k * k] = tok
            self.cand_scores[base : base + k * k] = score
            self.cand_parents[base : base + k * k] = front_idx.repeat_interleave(k)
            best = torch.topk(score, k).indices
            front_idx, front_tok, front_score = base + best, tok[best], score[best]
            front_feat, parent_rows = out[best // k], rows[best // k]
            recorded = base + k * k
        kept, parents = rerank(self.cand_scores[:recorded], self.cand_parents[:recorded], budget)
        return DraftTree(self.cand_tokens[kept], parents, None)
