"""How much to draft each step: the plan with the most expected tokens per second, none included.

A step that runs plan P (a chain of k tokens, or a tree of b nodes over d levels) costs
``draft_ms(P) + verify_ms(b + 1)`` on this machine (``cost.py``) and emits ``1 + E[accepted | P]``
tokens; a plain step costs one target forward and emits one token. Each step runs the plan with
the most tokens per millisecond for the request's running acceptance, so speculation switches
itself off where it cannot pay and on again where it does (TurboSpec/SmartSpec's goodput rule,
with k = 0 allowed). Drafting is decided at the pessimistic end of what the request has shown
(one standard deviation below the estimate) and must beat plain steps by ``MARGIN`` (the model
leaves out a speculative step's bookkeeping): a request speculates once it is sure enough to win.

Acceptance model, two numbers the request keeps learning (``Acceptance``): ``alpha``, how often
the target's next token is the drafter's first choice, and ``beta``, how often a further
candidate is right once the ones before it were wrong. So a node ranked r among its siblings
is right with probability ``alpha`` (r = 0) or ``(1 - alpha) (1 - beta)^(r - 1) beta``; a chain
of k expects ``alpha + ... + alpha^k`` accepted tokens and a tree the sum over its nodes of the
probability of their path.

Otherwise a drafter that costs something to ask is still asked now and then: a probe with the
cheapest plan that would pay at the optimistic end (one standard deviation above), paid from a
credit of ``PROBE_SHARE`` of its plain steps' modelled time. A probe's cost includes the drafter
catching up on the tokens it has not run (the prompt, at first), so probes cost a request at most
about that share, and the estimate keeps learning. Choices depend on the measured costs and the
tokens seen only, never on a clock or a random draw, so a seeded request is reproducible.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence

from ..drafting.drafters import PLAIN, DraftTree, Plan
from ..drafting.tree import StaticTree, children_lists
from .cost import CostCurve, EngineCosts

GRID = 50  # alpha and beta are looked up at 1/GRID resolution
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


class Menu:
    """The plans one request can run, what each costs here, and the best one at any acceptance.

    ``expected(alpha, beta)`` gives E[accepted] for every plan, in ``plans`` order. The best plan
    of a grid cell is computed the first time a request needs it, then looked up. Plans larger
    than a step's ``cap`` (a lookup that found fewer tokens) are left out of that step's choice.
    """

    def __init__(
        self,
        plans: Sequence[Plan],
        draft_ms: Callable[[Plan], float],
        expected: Callable[[float, float], Sequence[float]],
        costs: EngineCosts,
        catch_up_ms: Callable[[int], float] = lambda unseen: 0.0,
    ):
        """``catch_up_ms(n)``: what a proposal costs beyond ``draft_ms`` when the drafter has not
        seen the last ``n`` emitted tokens (after plain steps)."""
        self.plans = [PLAIN, *plans]
        self.catch_up_ms = catch_up_ms
        self.index = {plan: i for i, plan in enumerate(self.plans)}
        self.cost_ms = [draft_ms(p) + costs.verify(p.tokens + 1) for p in self.plans]
        self.baseline_ms = costs.verify(1)  # plain decoding, with no drafter at all
        self.largest = self.largest_within(None)
        self._expected = expected
        self._cells: dict[tuple[int, int, int | None], tuple[int, int]] = {}

    def best(self, acceptance: tuple[float, float], cap: int | None = None) -> Plan:
        """The plan with the most expected tokens per millisecond, PLAIN unless one beats it by MARGIN."""
        return self.plans[self._cell(acceptance, cap)[0]]

    def cheapest_paying(self, acceptance: tuple[float, float]) -> Plan:
        """The cheapest plan expected to beat plain steps by MARGIN (PLAIN if none does)."""
        return self.plans[self._cell(acceptance, None)[1]]

    def _cell(self, acceptance: tuple[float, float], cap: int | None) -> tuple[int, int]:
        i, j = (round(min(max(x, 0.0), 1.0) * GRID) for x in acceptance)
        if (i, j, cap) not in self._cells:
            expected = [0.0, *self._expected(i / GRID, j / GRID)]
            rates = [(1.0 + e) / ms for e, ms in zip(expected, self.cost_ms, strict=True)]
            allowed = [k for k, p in enumerate(self.plans) if cap is None or p.tokens <= cap]
            paying = [k for k in allowed if rates[k] > (1.0 + MARGIN) * rates[0]]
            best = max(paying, key=rates.__getitem__, default=0)
            self._cells[i, j, cap] = best, min(paying, key=self.cost_ms.__getitem__, default=0)
        return self._cells[i, j, cap]

    def largest_within(self, cap: int | None) -> Plan:
        return max((p for p in self.plans if cap is None or p.tokens <= cap), key=lambda p: (p.tokens, p.depth))

    def cost(self, plan: Plan) -> float:
        return self.cost_ms[self.index[plan]]


def chain_menu(k_max: int, draft_ms: Callable[[Plan], float], costs: EngineCosts) -> Menu:
    """Chains of 1..k_max tokens."""
    plans = [Plan(k, k) for k in range(1, k_max + 1)]

    def expected(alpha: float, beta: float) -> list[float]:
        return [sum(alpha**i for i in range(1, k + 1)) for k in range(1, k_max + 1)]

    return Menu(plans, draft_ms, expected, costs)


def lookup_menu(k_max: int, costs: EngineCosts) -> Menu:
    """Prompt lookup: the lookup runs every step (plain ones too); verifying is what the plan adds."""
    return chain_menu(k_max, lambda p: costs.lookup_ms, costs)


def draft_model_menu(k_max: int, costs: EngineCosts) -> Menu:
    """A draft model: one forward per drafted token, the first also catching up on what the last
    step emitted (typically two tokens; after plain steps, all of them)."""
    draft = measured(costs.draft_model, "draft model")
    one, first = draft(1), draft(2)
    menu = chain_menu(k_max, lambda p: first + (p.tokens - 1) * one if p.tokens else 0.0, costs)
    menu.catch_up_ms = lambda unseen: max(0.0, draft(unseen) - first)
    return menu


def dynamic_tree_menu(budget: int, depth: int, top_k: int, costs: EngineCosts) -> Menu:
    """EAGLE-2 trees of 1..budget nodes over 1..depth levels: a root pass, then one head level
    over a frontier of min(top_k, b) nodes per further level."""
    head = measured(costs.head_level, "EAGLE head")
    plans = [Plan(b, d) for d in range(1, depth + 1) for b in range(d, budget + 1)]

    def draft_ms(p: Plan) -> float:
        return head(1) + (p.depth - 1) * head(min(top_k, p.tokens)) if p.tokens else 0.0

    def expected(alpha: float, beta: float) -> list[float]:
        by_depth = {d: best_tree_expected(alpha, beta, budget, d) for d in range(1, depth + 1)}
        return [by_depth[p.depth][p.tokens] for p in plans]

    return Menu(plans, draft_ms, expected, costs, head_catch_up(costs))


def static_tree_menu(tree: StaticTree, costs: EngineCosts) -> Menu:
    """EAGLE's fixed tree cut after 1..all of its levels."""
    head = measured(costs.head_level, "EAGLE head")
    sizes = [int(level[-1]) + 1 for level in tree.levels]  # nodes of depth <= d
    plans = [Plan(n, d) for d, n in enumerate(sizes, 1)]
    fed = [0] + [len(e) for e in tree.expand[1:]]  # nodes fed through the head to grow depth d + 1

    def draft_ms(p: Plan) -> float:
        return head(1) + sum(head(fed[d]) for d in range(1, p.depth)) if p.tokens else 0.0

    def expected(alpha: float, beta: float) -> list[float]:
        by_node = static_tree_expected(tree, alpha, beta)
        return [by_node[n] for n in sizes]

    return Menu(plans, draft_ms, expected, costs, head_catch_up(costs))


def head_catch_up(costs: EngineCosts) -> Callable[[int], float]:
    """An EAGLE head's root pass runs every confirmed pair it has not seen; one is in ``draft_ms``."""
    commit = measured(costs.head_commit, "EAGLE head")
    return lambda unseen: max(0.0, commit(unseen) - commit(1))


def measured(curve: CostCurve | None, drafter: str) -> CostCurve:
    """A drafter's cost curve, which exists when the engine was loaded (or costed) with it."""
    if curve is None:
        raise ValueError(f"no {drafter} costs: the engine's cost table was made without one")
    return curve


def static_tree_expected(tree: StaticTree, alpha: float, beta: float) -> list[float]:
    """E[accepted] of the first 0..n nodes of a fixed tree: the sum of their path probabilities."""
    path: list[float] = []
    for parent, rank in zip(tree.parents.tolist(), tree.ranks.tolist(), strict=True):
        path.append((path[parent] if parent >= 0 else 1.0) * rank_probability(alpha, beta, rank))
    totals = [0.0]
    for p in path:
        totals.append(totals[-1] + p)
    return totals


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


class DraftPlanner:
    """One request's plan per step, what it learned, and what its steps were modelled to cost.

    With ``gate`` off every step runs the largest plan (fixed drafting, as configured).
    """

    def __init__(self, menu: Menu, gate: bool = True, unseen: int = 1, probe_share: float = PROBE_SHARE):
        """``unseen``: tokens the drafter has not run yet when decoding starts (its prompt)."""
        self.menu, self.gate, self.probe_share = menu, gate, probe_share
        self.acceptance = Acceptance()
        self.credit = 0.0  # milliseconds probes may still lose
        self.probing = False  # this step runs a plan only to learn
        self.unseen = unseen  # tokens the drafter has not run: the prompt, then what plain steps emitted
        self.modelled_ms = 0.0
        self.emitted = 0

    def choose(self, cap: int | None = None, probe: bool = True) -> Plan:
        """This step's plan; ``probe`` False for drafters that are asked every step anyway."""
        self.probing = False
        if not self.gate:
            return self.menu.largest if cap is None else self.menu.largest_within(cap)
        first, later = self.acceptance.first, self.acceptance.later
        plan = self.menu.best((first.lower, later.lower), cap)
        if plan == PLAIN and probe:
            candidate = self.menu.cheapest_paying((first.upper, later.upper))
            # Probe only with credit for the worst case: nothing accepted.
            if candidate != PLAIN and self._cost(candidate) - self.menu.cost(PLAIN) <= self.credit:
                self.probing = True
                return candidate
        return plan

    def _cost(self, plan: Plan) -> float:
        """The modelled cost of running ``plan`` now, catching up on unseen tokens included."""
        return self.menu.cost(plan) + (self.menu.catch_up_ms(self.unseen) if plan.tokens else 0.0)

    def observe(self, proposal: DraftTree, emitted: Sequence[int]) -> None:
        """Learn from what the target emitted after a proposal (verified or not)."""
        self.acceptance.learn(proposal, emitted)

    def record(self, plan: Plan, emitted: int) -> None:
        """Book one step: its modelled cost and tokens; a plain step earns probe credit, a probe
        spends what it cost beyond plain steps emitting as many tokens; fade the evidence."""
        cost = self._cost(plan)
        self.modelled_ms += cost
        self.emitted += emitted
        if plan == PLAIN:
            self.credit += self.probe_share * cost
        elif self.probing:
            self.credit -= cost - emitted * self.menu.cost(PLAIN)
        self.unseen = emitted if plan.tokens else self.unseen + emitted
        self.acceptance.fade()

    @property
    def expected_speedup(self) -> float:
        """Tokens per modelled millisecond over plain decoding's: this request's own speed estimate."""
        return self.emitted * self.menu.baseline_ms / self.modelled_ms if self.modelled_ms else 1.0
