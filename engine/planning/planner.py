"""What a request has shown of its drafts' acceptance, and what probing costs it.

Each step ``batch.py``'s ``plan_batch`` gives every row the draft tokens with the most expected
tokens per millisecond for the whole step, none included, so speculation switches itself off where
it cannot pay and on again where it does (TurboSpec/SmartSpec's goodput rule, with k = 0 allowed).
A row drafts at the pessimistic end of what it has shown (one standard deviation below the
estimate) and must beat plain steps by ``MARGIN`` (the model leaves out a speculative step's
bookkeeping): a request speculates once it is sure enough to win.

Acceptance model, two numbers the request keeps learning (``Acceptance``): ``alpha``, how often
the target's next token is the drafter's first choice, and ``beta``, how often a further
candidate is right once the ones before it were wrong. So a node ranked r among its siblings
is right with probability ``alpha`` (r = 0) or ``(1 - alpha) (1 - beta)^(r - 1) beta``; a chain
of k expects ``alpha + ... + alpha^k`` accepted tokens and a tree the sum over its nodes of the
probability of their path.

A drafter that costs something to ask (a draft model, an EAGLE head) is still asked now and then:
a probe at the optimistic end (one standard deviation above), paid from a credit of
``PROBE_SHARE`` of its plain steps' modelled time. A probe's cost includes the drafter catching up
on the tokens it has not run (the prompt, at first), so probes cost a request at most about that
share, and the estimate keeps learning. Choices depend on the measured costs and the tokens seen
only, never on a random draw, so a seeded request is reproducible.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

from ..drafting.drafters import DraftTree
from ..drafting.tree import children_lists

MARGIN = 0.05  # a plan must be expected to beat plain steps by this much
PROBE_SHARE = 0.03  # probes may lose at most this share of the plain steps' time
FADE = 0.9  # per step: evidence ten steps old counts a third, twenty steps old an eighth


class Rate:
    """Beta(1, 1) counts of one kind of draft being right, fading by ``FADE`` every step."""

    def __init__(self) -> None:
        self.right = self.wrong = 0.0

    @property
    def mean(self) -> float:
        return (self.right + 1.0) / (self.right + self.wrong + 2.0)

    @property
    def spread(self) -> float:
        """One standard deviation of the Beta distribution."""
        mean, n = self.mean, self.right + self.wrong + 2.0
        return math.sqrt(mean * (1.0 - mean) / (n + 1.0))

    @property
    def lower(self) -> float:
        """The pessimistic end of what was seen: what drafting must pay at."""
        return max(0.0, self.mean - self.spread)

    @property
    def upper(self) -> float:
        """The optimistic end of what was seen: what a probe tests."""
        return min(1.0, self.mean + self.spread)

    def fade(self) -> None:
        self.right *= FADE
        self.wrong *= FADE


class Acceptance:
    """The request's running acceptance: ``first`` choices (alpha), ``later`` siblings (beta).

    Evidence fades every step, drafted or not: recent text counts most, and a long stretch of
    plain steps makes the estimate uncertain again.
    """

    def __init__(self) -> None:
        self.first, self.later = Rate(), Rate()

    def learn(self, proposal: DraftTree, emitted: Sequence[int]) -> None:
        """Walk what the target emitted down a proposal, in the verifier's order.

        At each node the first child (drafters order siblings best first) is a trial of alpha; after
        a miss each further sibling is a trial of beta until one matches, and the walk goes on
        below it. The bonus token checks the first unverified draft too, so a proposal longer
        than what was verified (prompt lookup) teaches as much as a verified one.
        """
        tokens = proposal.tokens.tolist()
        children = children_lists(proposal.parents)
        node = 0
        for token in emitted:
            kids = children[node]
            if not kids:
                return
            node = 0
            for rank, child in enumerate(kids):
                rate = self.first if rank == 0 else self.later
                if tokens[child - 1] == token:
                    rate.right += 1
                    node = child
                    break
                rate.wrong += 1
            if not node:
                return

    def fade(self) -> None:
        self.first.fade()
        self.later.fade()


def rank_probability(alpha: float, beta: float, rank: int) -> float:
    """P(the target's token is the drafter's candidate of this rank | its parent was right)."""
    return alpha if rank == 0 else (1.0 - alpha) * (1.0 - beta) ** (rank - 1) * beta


def best_tree_expected(alpha: float, beta: float, budget: int, max_depth: int) -> list[float]:
    """E[accepted] of the best tree of 0..budget nodes and at most ``max_depth`` levels.

    Siblings are exclusive, so E[accepted] is the sum over nodes of P(path accepted); the best tree
    of b nodes takes the b most probable paths, found best-first with a heap (a node's path never
    beats its parent's, nor a sibling's of better rank).
    """
    totals = [0.0]
    # (negated path probability, depth, rank among siblings, parent's path probability); min-heap
    frontier = [(-alpha, 1, 0, 1.0)]
    while len(totals) <= budget and frontier:
        neg, depth, rank, parent = heapq.heappop(frontier)
        totals.append(totals[-1] - neg)
        if depth < max_depth:
            heapq.heappush(frontier, (neg * alpha, depth + 1, 0, -neg))  # its first child
        sibling = parent * rank_probability(alpha, beta, rank + 1)
        heapq.heappush(frontier, (-sibling, depth, rank + 1, parent))  # its next sibling
    return totals + [totals[-1]] * (budget + 1 - len(totals))
