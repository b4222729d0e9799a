"""One (tenant, model)'s decision state and its admission: the acceptance breaker (gate.py), the
decode-speed estimates of its arms and the plans built on them (speed.py), and the budget of
responses to read; `TenantState.admit` is the gates' verdict for one request that passed the
temperature gate. The stores (state/) keep one per key and share them; they decide nothing.
Not thread-safe by itself: a store calls it under its own lock.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import NamedTuple

from ..config import GateConfig
from ..vocabulary import Reason
from .gate import Breaker, judged_arms, unjudged
from .load import Joining
from .samples import RequestShape, SpeedSample
from .speed import (
    EXPLORE,
    JOINED,
    NO_PRIORS,
    OK,
    PRIOR,
    SLOWER,
    ArmEstimate,
    ArmPlan,
    Choice,
    Prior,
    best_candidate,
    plan_arms,
)

BREAKER_OPEN = Reason.BREAKER_OPEN
PROBE = Reason.PROBE
# Admission reasons whose responses are read only within gate.max_measured_per_s (an exploring
# request beyond it runs the chosen arm instead); breaker probes are always read.
SAMPLED = (OK, SLOWER, PRIOR, EXPLORE, JOINED, BREAKER_OPEN)


class Admission(NamedTuple):
    """What the gates decided for one request that passed the temperature gate."""

    state: str  # the breaker's state: "closed" | "open" | "half_open"
    arm: int  # index into the settings' arms: 0 is plain decoding, i >= 1 the i-th candidate
    reason: str  # "ok" | "slower" | "prior" | "explore" | "probe" | "breaker_open"
    probe: bool  # a breaker probe: its response must be recorded or released
    speedup: float | None  # estimated speed of the chosen arm over plain decoding
    measured: bool = True  # the response is read (figures, speed); else it passes unread


class ArmView(NamedTuple):
    """A read-only copy of one arm's speed estimate."""

    tokens_per_s: float | None
    samples: float  # decayed evidence, now
    age_s: float | None  # since its last sample (None before any)
    misses: int


HELD = Choice(0, BREAKER_OPEN, None)


def _held(found: Choice) -> Choice:
    """What a request the breaker holds back runs, `found` among the arms it allows: plain
    decoding, unless explored, says why it runs plain (`breaker_open`)."""
    return found if found.arm or found.reason == EXPLORE else HELD


MAX_PLANS = 32  # plans kept per tenant: one per load the arms were at (decide/load.py)


class TenantState:
    """The breaker, the arm estimates and the gates' verdicts of one (tenant, model). Not
    thread-safe by itself."""

    __slots__ = (
        "breaker",
        "arms",
        "decisions",
        "plan",
        "plans",
        "plan_version",
        "labels",
        "reads",
        "reads_at",
        "unread",
        "shape",
    )

    def __init__(self) -> None:
        self.breaker = Breaker()
        self.arms: dict[str, ArmEstimate] = {}  # arm label -> estimate (labels survive config reloads)
        # reason -> admissions ("ok", "slower", "explore", "probe", "breaker_open"): a handful of
        # keys, kept and evicted with the tenant, so bounded by the same LRU cap
        self.decisions: dict[str, int] = {}
        self.plan: ArmPlan | None = None  # the speed policy's last plan, shared by requests until it goes stale
        # The plans of the arms at each load (decide/load.py: the same arms at other bands are
        # other labels); the same version and staleness rules as `plan`.
        self.plans: dict[tuple[str, ...], ArmPlan] = {}
        self.plan_version = -1  # the prior pool's version the plans were built with
        self.labels: tuple[str, ...] = ()  # the arms of the last admission (the status page's plan)
        # A token bucket of responses to read (gate.max_measured_per_s, one second's worth deep).
        self.reads = math.inf  # a new key starts full
        self.reads_at = 0.0
        self.unread = 0  # admissions whose response was not read
        self.shape = RequestShape()  # its usual request, what whole-request samples are learnt as

    def arms_changed(self) -> None:
        """An arm's estimate changed (a sample, a miss, the fleet's view): plan afresh."""
        self.plan = None
        self.plans.clear()

    def admit(
        self,
        arms: tuple[str, ...],
        gate: GateConfig,
        now: float,
        bucket: float,
        priors: Callable[[], Mapping[str, Prior]] = lambda: NO_PRIORS,
        version: int = 0,
        joinable: Joining | None = None,
        settled: Callable[[], frozenset[str]] = frozenset,
    ) -> Admission:
        """The breaker first (a collapse of acceptance wins over the drafters it judges), then the
        speed policy, then whether the response is read. `priors()` gives the pooled priors of the
        arms, `version` says whether they changed since the plan was made, `joinable` where a request
        on shared cores should join (ArmPlan.joined; its pools run a batch `now`, else they are
        idle and it is where the pinned requests go), `settled()` the
        candidates owed no first sample here (speed.settled_candidates; asked only when a plan is made)."""
        state, admitted, probe = self.breaker.admit(gate, now, bucket)
        self.labels = arms
        plan: ArmPlan | None = None  # the plan the choice comes from
        kept: tuple[int, ...] | None = None  # where that plan is over some of the arms: their indices
        speed = gate.policy == "speed"
        judged = judged_arms(arms, gate.policy)
        if probe:
            arm = best_candidate(self.arms, arms, gate, now, priors(), judged)
            waits = joinable is not None and joinable.now and not joinable.pools[arm]
            if not waits and speed and not all(judged):
                plan = self._plan(arms, gate, now, priors, version, settled)
                waits = plan.exploited.arm != arm or (joinable is not None and plan.joined(joinable) is not None)
            if waits:
                # A probe waits while pools that share their cores run another pool's batch (it
                # would start a second batch and slow every request in flight, as an exploration
                # would: decide/load.py), and is not sent where the speed policy would not run the
                # drafter it tries now (prompt lookup or plain is faster, or at idle the request
                # would open on the pinned requests' pool): nobody would act on its answer.
                self.breaker.release()
                admitted = probe = False
        if not admitted:
            choice = HELD
            if not all(judged):
                # What the breaker does not hold back (prompt lookup) is chosen among as ever,
                # exploration included: else the estimates of the arms it allows go stale while it
                # is open, and a stale one keeps the tenant on the wrong arm of those.
                labels, kept = unjudged(arms, judged)
                joining = joinable.only(kept) if joinable is not None else None
                plan, found = self._placed(labels, joining, bucket, gate, now, priors, version, settled)
                choice = _held(found)
        elif probe:
            choice = Choice(arm, PROBE, None)
        elif not speed:
            choice = Choice(1, OK, None)
        else:
            plan, choice = self._placed(arms, joinable, bucket, gate, now, priors, version, settled)
        measured = True
        if choice.reason in SAMPLED and not self.take_read(gate.max_measured_per_s, now):
            if choice.reason == EXPLORE and plan is not None:
                # Exploring without reading would run a slower arm for nothing: run the chosen one.
                choice = plan.exploited if kept is None else _held(plan.exploited)
            measured = False
            self.unread += 1
        arm, reason, speedup = choice
        if kept is not None:
            arm = kept[arm]
        self.decisions[reason] = self.decisions.get(reason, 0) + 1
        return Admission(state, arm, reason, probe, speedup, measured)

    def _placed(
        self,
        arms: tuple[str, ...],
        joinable: Joining | None,
        bucket: float,
        gate: GateConfig,
        now: float,
        priors: Callable[[], Mapping[str, Prior]],
        version: int,
        settled: Callable[[], frozenset[str]],
    ) -> tuple[ArmPlan, Choice]:
        """The speed plan of `arms` and the request's place by it: the batch to join on shared
        cores (ArmPlan.joined), else the plan's choice for its `bucket`."""
        plan = self._plan(arms, gate, now, priors, version, settled)
        joined = plan.joined(joinable) if joinable is not None else None
        return plan, plan.choose(bucket) if joined is None else joined

    def _plan(
        self,
        arms: tuple[str, ...],
        gate: GateConfig,
        now: float,
        priors: Callable[[], Mapping[str, Prior]],
        version: int,
        settled: Callable[[], frozenset[str]] = frozenset,
    ) -> ArmPlan:
        """The speed plan of `arms` (labels at their load), the cached one while it holds."""
        plan = self.plan
        if plan is None or plan.labels is not arms:
            plan = self.plans.get(arms)
        if plan is None or plan.gate is not gate or now >= plan.valid_until or self.plan_version != version:
            if self.plan_version != version or len(self.plans) >= MAX_PLANS:
                self.plans.clear()
            plan = self.plans[arms] = plan_arms(self.arms, arms, gate, now, priors(), settled())
            self.plan_version = version
        self.plan = plan
        return plan

    def chosen(self, gate: GateConfig, now: float, priors: Mapping[str, Prior]) -> tuple[str, str, float | None] | None:
        """(arm label, reason, speedup) of where the last admission's arms send traffic outside
        exploration now; None before any admission."""
        if not self.labels:
            return None
        arm, reason, speedup = plan_arms(self.arms, self.labels, gate, now, priors).exploited
        return self.labels[arm], reason, speedup

    def take_read(self, rate: float, now: float) -> bool:
        """Whether the response of a request admitted at `now` is read: at most `rate` per second,
        bursts up to one second's worth, evenly spaced under steady load (so the reads of a busy
        key spread over time rather than bunching at the start of each second)."""
        if rate == math.inf:
            return True
        reads = min(max(rate, 1.0), self.reads + (now - self.reads_at) * rate)
        self.reads_at = now
        if reads >= 1.0:
            self.reads = reads - 1.0
            return True
        self.reads = reads
        return False

    def record_speed(self, arm: str, sample: SpeedSample | None, gate: GateConfig, now: float) -> SpeedSample | None:
        """Learn one response's sample (None: it gave none); the sample as learnt (a whole
        request's at the tenant's usual request)."""
        estimate = self.arms.get(arm)
        if estimate is None:
            estimate = self.arms[arm] = ArmEstimate()
        if sample is None:
            estimate.miss()
        else:
            sample = self.shape.usual(sample, gate.speed_decay)
            estimate.add(sample, gate, now)
        self.arms_changed()
        return sample

    def arm_views(self, gate: GateConfig, now: float) -> dict[str, ArmView]:
        return {
            label: ArmView(a.rate, a.evidence(gate, now), now - a.updated_at if a.weight else None, a.misses)
            for label, a in self.arms.items()
        }
