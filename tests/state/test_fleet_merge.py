"""The merge of a fleet's evidence (ace_mw/state/fleet.py) and a replica's bookkeeping around it
(FleetTenant in ace_mw/state/redis_store.py), without Redis: pooled sums equal one estimator fed every
replica's samples, a replica's own push is never counted twice, a failed push loses nothing, and
probe slots cap a breaker's probes. The same merge inside Redis's Lua script is tested against a
real redis-server in test_redis_store.py."""

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ace_mw.config import GateConfig
from ace_mw.decide.gate import CLOSED, HALF_OPEN, OPEN, Breaker
from ace_mw.decide.samples import SpeedSample
from ace_mw.decide.speed import ArmEstimate
from ace_mw.state.fleet import ARM_SUMS, NO_TIME_DECAY, Evidence, FleetView, fold, parse_reply
from ace_mw.state.replica import FleetTenant

GATE = GateConfig(min_samples=4, speed_half_life=5, speed_half_life_s=30.0, max_concurrent_probes=3)
ARM = "eagle_2/k5"

# (value, seconds since the previous sample)
runs = st.lists(st.tuples(st.floats(0.0, 1.0), st.floats(0.0, 20.0)), min_size=0, max_size=12)


def fed(samples, start: float = 0.0, decay: float = GATE.speed_decay, half_life_s: float = 30.0) -> Evidence:
    """One estimator fed `samples` (value, gap) from `start`: each value v is a (v, 1 - v) pair, so
    both sums are exercised."""
    evidence, now = Evidence.empty(2), start
    for value, gap in samples:
        now += gap
        evidence.add((value, 1.0 - value), decay, half_life_s, now)
    return evidence


def close(a: Evidence, b: Evidence) -> bool:
    return (
        all(math.isclose(x, y, rel_tol=1e-9, abs_tol=1e-12) for x, y in zip(a.sums, b.sums, strict=True))
        and math.isclose(a.weight, b.weight, rel_tol=1e-9, abs_tol=1e-12)
        and a.count == b.count
        and math.isclose(a.at, b.at, abs_tol=1e-9)
    )


# -- Evidence is the estimators' own arithmetic ---------------------------------------------------


def test_evidence_adds_acceptance_like_the_breaker():
    breaker, evidence = Breaker(), Evidence.empty(1)
    for alpha in (0.9, 0.8, 0.95):
        breaker.record(alpha, False, GATE, 0.0)
        evidence.add((alpha,), GATE.decay, NO_TIME_DECAY, 0.0)
    assert breaker.episode() == pytest.approx((evidence.sums[0], evidence.weight, evidence.count))


def test_evidence_adds_speed_like_an_arm_estimate():
    arm, evidence = ArmEstimate(), Evidence.empty(ARM_SUMS)
    for now, (tokens, seconds) in ((1.0, (100, 2.0)), (4.0, (50, 0.5)), (40.0, (80, 1.0))):
        sample = SpeedSample(tokens, seconds, "stream")
        arm.add(sample, GATE, now)
        evidence.add(sample.sums, GATE.speed_decay, GATE.speed_half_life_s, now)
    assert (arm.tokens, arm.seconds, arm.logs, arm.squares, arm.weight, arm.updated_at) == pytest.approx(
        (*evidence.sums, evidence.weight, evidence.at)
    )


# -- fold: the merge --------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(runs, runs)
def test_fold_equals_one_estimator_fed_both_runs(first, second):
    a = fed(first)
    b = fed(second, start=a.at)  # the second run comes after the first, as a later push does
    assert close(fold(a, b, GATE.speed_decay, 30.0), fed(first + second))


@settings(max_examples=100, deadline=None)
@given(runs, runs, runs)
def test_fold_is_associative(x, y, z):
    a = fed(x)
    b = fed(y, start=a.at)
    c = fed(z, start=b.at or a.at)
    left = fold(fold(a, b, GATE.speed_decay, 30.0), c, GATE.speed_decay, 30.0)
    right = fold(a, fold(b, c, GATE.speed_decay, 30.0), GATE.speed_decay, 30.0)
    assert close(left, right)


def test_a_fleet_pools_every_replicas_batches_like_one_estimator():
    """Three replicas push their batches in turn; the fleet's sums are those of one estimator fed
    the batches in arrival order, and each replica counts its own batch once."""
    batches = {
        "a": [(0.9, 1.0), (0.8, 1.0)],
        "b": [(0.2, 0.5), (0.3, 0.5), (0.1, 0.5)],
        "c": [(0.7, 2.0)],
    }
    fleet, stream, now = Evidence.empty(2), [], 0.0
    for _ in range(3):  # each replica sends one batch per sync
        for samples in batches.values():
            batch = fed(samples, start=now)
            now = batch.at
            fleet = fold(fleet, batch, GATE.speed_decay, 30.0)
            stream += samples
    assert close(fleet, fed(stream))
    assert fleet.count == 3 * sum(len(s) for s in batches.values())


def test_an_empty_push_changes_nothing_and_a_first_push_seeds():
    base = fed([(0.5, 1.0), (0.6, 1.0)])
    assert fold(base, Evidence.empty(2), GATE.speed_decay, 30.0) is base
    assert close(fold(Evidence.empty(2), base, GATE.speed_decay, 30.0), base)


# -- a replica's bookkeeping: FleetTenant -----------------------------------------------------------


def fleet_answer(tenant_push, fleet: Evidence, arms: dict[str, Evidence], epoch: int = 0) -> FleetView:
    """What the script answers for a push into an existing episode (no transition): the fleet's
    sums with the push folded in (Redis's arithmetic is checked against this in test_redis_store)."""
    breaker = fold(fleet, tenant_push.breaker_new, GATE.decay, NO_TIME_DECAY)
    merged = {
        label: fold(arms.get(label, Evidence.empty(ARM_SUMS)), new, GATE.speed_decay, 30.0)
        for label, new, _ in tenant_push.arms
    }
    return FleetView(False, 0, epoch, CLOSED, 0, 0.0, 0.0, breaker, {**arms, **merged})


def record(tenant: FleetTenant, alpha: float, speed: tuple[float, float] | None, now: float) -> None:
    """What RedisStateStore.record / record_speed do to a tenant."""
    samples = tenant.breaker.samples
    tenant.breaker.record(alpha, False, GATE, now)
    if tenant.breaker.samples != samples:
        tenant.new_alpha.add((alpha,), GATE.decay, NO_TIME_DECAY, now)
    if speed is not None:
        tenant.record_speed(ARM, SpeedSample(*speed, "stream"), GATE, now)
        sums = SpeedSample(*speed, "stream").sums
        tenant.new_speed.setdefault(ARM, Evidence.empty(ARM_SUMS)).add(sums, GATE.speed_decay, 30.0, now)


def test_settle_takes_the_fleet_state_plus_what_came_during_the_push():
    """Samples recorded while the push was on the wire are not in the fleet's answer: they are
    folded on top, and they (only they) go out with the next push."""
    tenant = FleetTenant(("t", "m"), "ace:s:t:m")
    others = fed([(0.9, 0.0), (0.85, 0.0)], decay=GATE.decay, half_life_s=NO_TIME_DECAY)  # other replicas
    others = Evidence(others.sums[:1], others.weight, others.count)
    for i, alpha in enumerate((0.7, 0.75, 0.8)):
        record(tenant, alpha, (100.0, 1.0), float(i))
    push = tenant.take(GATE, 3.0)
    assert push.breaker_new.count == 3 and push.arms[0][1].count == 3
    record(tenant, 0.65, (60.0, 1.0), 3.5)  # arrives while the push is on the wire

    fleet_arm = fed([(0.5, 1.0)], start=0.0)
    fleet_sums = (200.0, 4.0, math.log(50.0), math.log(50.0) ** 2)
    view = fleet_answer(push, others, {ARM: Evidence(fleet_sums, fleet_arm.weight, 1, 0.5)})
    tenant.settle(push, view, GATE)

    expected = fold(view.breaker, Evidence((0.65,), 1.0, 1), GATE.decay, NO_TIME_DECAY)
    assert tenant.breaker.episode() == pytest.approx((expected.sums[0], expected.weight, expected.count))
    assert tenant.breaker.samples == 2 + 3 + 1  # others', the push's, and the one in flight: each once
    arm = tenant.arms[ARM]
    merged = fold(view.arms[ARM], tenant.new_speed[ARM], GATE.speed_decay, 30.0)
    assert (*arm.sums, arm.weight) == pytest.approx((*merged.sums, merged.weight))

    again = tenant.take(GATE, 4.0)
    assert again.breaker_new.count == 1 and again.breaker_new.sums == pytest.approx((0.65,))
    assert again.arms[0][1].count == 1


def test_a_failed_push_puts_its_samples_back_in_front():
    tenant = FleetTenant(("t", "m"), "ace:s:t:m")
    record(tenant, 0.9, (100.0, 1.0), 0.0)
    record(tenant, 0.8, (90.0, 1.0), 1.0)
    push = tenant.take(GATE, 1.0)
    record(tenant, 0.7, (80.0, 1.0), 2.0)
    tenant.restore(push, GATE)
    everything = Evidence.empty(1)
    for alpha in (0.9, 0.8, 0.7):
        everything.add((alpha,), GATE.decay, NO_TIME_DECAY, 0.0)
    retry = tenant.take(GATE, 2.0)
    assert retry.breaker_new.sums == pytest.approx(everything.sums) and retry.breaker_new.count == 3
    assert retry.arms[0][1].count == 3


def test_a_local_trip_is_pushed_as_a_transition_from_the_epoch_last_seen():
    tenant = FleetTenant(("t", "m"), "ace:s:t:m")
    tenant.fleet_epoch = 4
    for i in range(GATE.min_samples):
        tenant.breaker.record(0.1, False, GATE, float(i))
    assert tenant.breaker.state == OPEN
    push = tenant.take(GATE, 10.0)
    assert push.event and push.base == 4 and push.state == OPEN and push.trips == 1
    assert push.open_in == pytest.approx(GATE.cooldown_s - (10.0 - (GATE.min_samples - 1)))
    view = FleetView(True, 1, 5, OPEN, 1, GATE.cooldown_s, tenant.breaker.open_until, Evidence.empty(1), {})
    tenant.settle(push, view, GATE)
    assert tenant.fleet_epoch == 5 and not tenant.take(GATE, 11.0).event
    assert tenant.breaker.probe_slots == 1  # the lease the fleet granted


def test_a_transition_lost_to_another_replica_is_replaced_by_the_winner():
    tenant = FleetTenant(("t", "m"), "ace:s:t:m")
    for i in range(GATE.min_samples):
        tenant.breaker.record(0.1, False, GATE, float(i))
    push = tenant.take(GATE, 5.0)
    winner = FleetView(False, 0, 1, OPEN, 3, 120.0, 900.0, Evidence.empty(1), {})  # someone's third trip
    tenant.settle(push, winner, GATE)
    b = tenant.breaker
    assert (b.state, b.trips, b.cooldown, b.open_until, b.probe_slots) == (OPEN, 3, 120.0, 900.0, 0)


def test_reply_times_map_onto_the_local_clock():
    fields = ["e", "3", "st", "open", "tr", "1", "cd", "30", "ou", "1030.5", "bs", "0.5", "bw", "1", "bn", "1"]
    fields += ["t:x", "10", "s:x", "2", "l:x", "3.2", "q:x", "10.5", "w:x", "1.5", "n:x", "2", "u:x", "999.5"]
    fields += ["t:y", "10", "s:y", "2", "w:y", "1", "n:y", "1", "u:y", "999.5"]  # a replica without noise sums
    view = parse_reply(json.dumps(["1000.5", 1, 2, fields]), local_now=50.0)  # local = redis - 950.5
    assert view.arms["x"].sums == (10.0, 2.0, 3.2, 10.5) and view.arms["y"].sums == (10.0, 2.0, 0.0, 0.0)
    assert view.open_until == pytest.approx(80.0) and view.arms["x"].at == pytest.approx(49.0)
    assert (view.accepted, view.grant, view.epoch, view.state) == (True, 2, 3, OPEN)


# -- probe slots ------------------------------------------------------------------------------------


@pytest.mark.parametrize("slots, admitted", [(None, 3), (1, 1), (0, 0)])
def test_probe_slots_cap_the_probes_a_process_sends(slots, admitted):
    breaker = Breaker()
    for _ in range(GATE.min_samples):
        breaker.record(0.1, False, GATE, 0.0)
    breaker.probe_slots = slots
    later = breaker.open_until + 1.0  # HALF_OPEN: every request may probe
    probes = [breaker.admit(GATE, later, 0.5)[2] for _ in range(10)]
    assert breaker.state == HALF_OPEN and sum(probes) == admitted
