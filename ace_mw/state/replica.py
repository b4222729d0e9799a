"""What one replica keeps of a key: its local state, plus what it has not yet shared with the
fleet (`FleetTenant`), and a transition another replica won (`FleetEvent`). Merging is `fleet.py`'s;
the wire is `redis_store.py`'s."""

from __future__ import annotations

from typing import NamedTuple

from ..config import GateConfig
from ..decide.gate import CLOSED, OPEN
from ..decide.speed import ArmEstimate
from ..decide.tenant import TenantState
from .fleet import ARM_SUMS, NO_TIME_DECAY, Evidence, FleetView, Push, fold
from .memory import BreakerKey


class FleetEvent(NamedTuple):
    """A key's breaker as the fleet holds it after a won transition, on the local clock."""

    epoch: int
    state: str
    trips: int
    cooldown: float
    open_until: float


class FleetTenant(TenantState):
    """A TenantState that also keeps what it has not yet shared with the fleet."""

    __slots__ = ("key", "name", "fleet_epoch", "synced_epoch", "new_alpha", "new_speed", "refused")

    def __init__(self, key: BreakerKey, name: str) -> None:
        super().__init__()
        self.key = key
        self.name = name  # its Redis hash
        self.fleet_epoch = -1  # the fleet's breaker epoch this state derives from (-1: never synced)
        self.synced_epoch = 0  # the local breaker's epoch at the last sync: differs after a local transition
        self.new_alpha = Evidence.empty(1)  # acceptance samples since the last push (this episode)
        self.new_speed: dict[str, Evidence] = {}  # speed samples since the last push, per arm
        self.refused = 0  # probe-eligible requests turned away for want of a slot since the last push

    def take(self, gate: GateConfig, now: float) -> Push:
        """What to push now; the pending samples start afresh."""
        b = self.breaker
        alpha_sum, weight, samples = b.episode()
        want = 0 if b.state == CLOSED else min(gate.max_concurrent_probes, b.probes + self.refused)
        new = self.new_speed
        arms = [(label, new.get(label) or Evidence.empty(ARM_SUMS), _evidence(arm)) for label, arm in self.arms.items()]
        push = Push(
            self.fleet_epoch,
            b.epoch != self.synced_epoch,
            CLOSED if b.state == CLOSED else OPEN,
            b.trips,
            b.cooldown,
            b.open_until - now,
            Evidence((alpha_sum,), weight, samples),
            self.new_alpha,
            arms,
            want,
            b.epoch,
            self.refused,
        )
        self.new_alpha, self.new_speed, self.refused = Evidence.empty(1), {}, 0
        return push

    def restore(self, push: Push, gate: GateConfig) -> None:
        """The push failed: its samples go back in front of those that came since."""
        if self.breaker.epoch == push.local_epoch:  # else the episode it belonged to is over
            self.new_alpha = fold(push.breaker_new, self.new_alpha, gate.decay, NO_TIME_DECAY)
        for label, new, _ in push.arms:
            later = self.new_speed.get(label) or Evidence.empty(ARM_SUMS)
            self.new_speed[label] = fold(new, later, gate.speed_decay, gate.speed_half_life_s)
        self.refused += push.refused

    def settle(self, push: Push, view: FleetView, gate: GateConfig) -> None:
        """The push landed: the local state becomes the fleet's, plus what came in meanwhile."""
        b = self.breaker
        self.fleet_epoch, self.synced_epoch = view.epoch, push.local_epoch
        if b.epoch == push.local_epoch:  # no local transition while the push was on the wire
            episode = fold(view.breaker, self.new_alpha, gate.decay, NO_TIME_DECAY)
            b.adopt(view.state, view.trips, view.cooldown, view.open_until, _episode(episode))
            b.probe_slots = None if b.state == CLOSED else view.grant
        for label, fleet in view.arms.items():
            new = self.new_speed.get(label)
            merged = fold(fleet, new, gate.speed_decay, gate.speed_half_life_s) if new else fleet
            arm = self.arms.get(label) or self.arms.setdefault(label, ArmEstimate())
            arm.set_sums(merged.sums)
            arm.weight, arm.updated_at = merged.weight, merged.at
        if view.arms:
            self.arms_changed()

    def adopt_event(self, event: FleetEvent) -> None:
        """Another replica's transition, heard before this key's next sync."""
        self.breaker.adopt(event.state, event.trips, event.cooldown, event.open_until, (0.0, 0.0, 0))
        self.breaker.probe_slots = None if event.state == CLOSED else 0  # slots come with the next sync
        self.fleet_epoch = event.epoch
        self.new_alpha = Evidence.empty(1)


def _evidence(arm: ArmEstimate) -> Evidence:
    return Evidence(arm.sums, arm.weight, 0, arm.updated_at)


def _episode(evidence: Evidence) -> tuple[float, float, int]:
    return evidence.sums[0], evidence.weight, evidence.count
