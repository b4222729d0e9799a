"""Temperature gate and the acceptance circuit breaker state machine (plus its in-memory store)."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ace_mw import GateConfig
from ace_mw.decide.gate import CLOSED, HALF_OPEN, OPEN, Breaker, effective_temperature, state_model

GATE = GateConfig(
    policy="acceptance",  # the breaker alone: the speed policy has its own tests (test_speed_gate.py)
    alpha_floor=0.5,
    reenable_threshold=0.7,
    ema_half_life=1e9,
    min_samples=3,
    min_probe_samples=2,
    cooldown_s=10,
    cooldown_growth=3,
    max_cooldown_s=50,
    probe_fraction=0.1,
    max_concurrent_probes=2,
    probe_timeout_s=100,
)
IN_PROBE_SHARE, OUTSIDE = 0.05, 0.5  # sticky buckets below / above probe_fraction
ARMS = ("plain", "eagle_2/k5")


def tripped(now=0.0):
    breaker = Breaker()
    for _ in range(GATE.min_samples):
        breaker.record(0.1, False, GATE, now)
    assert breaker.state == OPEN
    return breaker


def half_open():
    breaker = tripped()
    assert breaker.admit(GATE, GATE.cooldown_s, OUTSIDE) == (HALF_OPEN, True, True)
    breaker.release()
    return breaker


# -- temperature ------------------------------------------------------------------------------------


@pytest.mark.parametrize("raw, expected", [(None, 1.0), (0, 0.0), (0.7, 0.7), (2, 2.0)])
def test_usable_temperature_is_returned_as_float(raw, expected):
    assert effective_temperature(raw, 1.0) == expected


def test_missing_temperature_takes_the_configured_default():
    assert effective_temperature(None, 0.3) == 0.3


@pytest.mark.parametrize("raw", ["0.5", True, False, float("nan"), float("inf"), -0.1, 10**400, [0.5], {}])
def test_unusable_temperature_is_none(raw):
    assert effective_temperature(raw, 1.0) is None


# -- breaker: CLOSED ----------------------------------------------------------------------------------


def test_breaker_does_not_trip_before_min_samples():
    breaker = Breaker()
    for _ in range(GATE.min_samples - 1):
        breaker.record(0.0, False, GATE, 0.0)
    assert breaker.state == CLOSED


def test_breaker_trips_when_rolling_alpha_falls_below_the_floor():
    assert tripped().state == OPEN


def test_breaker_stays_closed_at_the_floor():
    breaker = Breaker()
    for _ in range(10):
        breaker.record(GATE.alpha_floor, False, GATE, 0.0)
    assert breaker.state == CLOSED


def test_trip_resets_the_rolling_alpha():
    breaker = tripped()
    assert (breaker.rolling_alpha, breaker.samples) == (None, 0)


@given(st.lists(st.floats(0, 1), min_size=1, max_size=50), st.floats(0.5, 100))
def test_rolling_alpha_is_the_half_life_weighted_mean(alphas, half_life):
    gate = GateConfig(ema_half_life=half_life, min_samples=10**6)
    breaker = Breaker()
    for alpha in alphas:
        breaker.record(alpha, False, gate, 0.0)
    weights = [0.5 ** ((len(alphas) - 1 - i) / half_life) for i in range(len(alphas))]
    expected = sum(w * a for w, a in zip(weights, alphas, strict=True)) / sum(weights)
    assert math.isclose(breaker.rolling_alpha, expected, rel_tol=1e-9, abs_tol=1e-12)


# -- breaker: OPEN ------------------------------------------------------------------------------------


def test_open_breaker_gates_requests_outside_the_probe_share():
    assert tripped().admit(GATE, 1.0, OUTSIDE) == (OPEN, False, False)


def test_open_breaker_lets_the_sticky_probe_share_through():
    assert tripped().admit(GATE, 1.0, IN_PROBE_SHARE) == (OPEN, True, True)


def test_open_breaker_caps_concurrent_probes():
    breaker = tripped()
    admitted = [breaker.admit(GATE, 1.0, IN_PROBE_SHARE)[1] for _ in range(GATE.max_concurrent_probes + 1)]
    assert admitted == [True] * GATE.max_concurrent_probes + [False]


def test_released_probe_frees_its_slot():
    breaker = tripped()
    for _ in range(GATE.max_concurrent_probes):
        breaker.admit(GATE, 1.0, IN_PROBE_SHARE)
    breaker.release()
    assert breaker.admit(GATE, 1.0, IN_PROBE_SHARE)[1]


def test_lost_probe_slots_are_freed_after_the_probe_timeout():
    breaker = tripped()
    for _ in range(GATE.max_concurrent_probes):
        breaker.admit(GATE, 1.0, IN_PROBE_SHARE)
    assert breaker.admit(GATE, 1.0 + GATE.probe_timeout_s + 1, IN_PROBE_SHARE)[1]


def test_non_probe_responses_are_ignored_while_open():
    breaker = tripped()
    breaker.record(1.0, False, GATE, 1.0)
    assert (breaker.state, breaker.samples) == (OPEN, 0)


def test_open_lasts_the_cooldown():
    breaker = tripped()
    assert breaker.admit(GATE, GATE.cooldown_s - 0.001, OUTSIDE)[0] == OPEN
    assert breaker.admit(GATE, GATE.cooldown_s, OUTSIDE)[0] == HALF_OPEN


# -- breaker: HALF_OPEN -------------------------------------------------------------------------------


def test_half_open_admits_only_bounded_probes():
    breaker = half_open()
    results = [breaker.admit(GATE, GATE.cooldown_s, OUTSIDE) for _ in range(GATE.max_concurrent_probes + 1)]
    assert results == [(HALF_OPEN, True, True)] * GATE.max_concurrent_probes + [(HALF_OPEN, False, False)]


def test_half_open_closes_at_the_reenable_threshold():
    breaker = half_open()
    for _ in range(GATE.min_probe_samples):
        breaker.admit(GATE, 10.0, OUTSIDE)
        breaker.record(GATE.reenable_threshold, True, GATE, 10.0)
    assert (breaker.state, breaker.samples, breaker.trips) == (CLOSED, 0, 0)


def test_half_open_reopens_between_floor_and_reenable_threshold():
    breaker = half_open()
    for _ in range(GATE.min_probe_samples):
        breaker.admit(GATE, 10.0, OUTSIDE)
        breaker.record(0.6, True, GATE, 10.0)  # above the floor, below re-enable: hysteresis
    assert breaker.state == OPEN


def test_half_open_waits_for_min_probe_samples():
    breaker = half_open()
    breaker.admit(GATE, 10.0, OUTSIDE)
    breaker.record(1.0, True, GATE, 10.0)
    assert breaker.state == HALF_OPEN


def test_probes_taken_while_open_count_once_the_cooldown_ends():
    breaker = tripped()
    for _ in range(GATE.min_probe_samples):
        breaker.admit(GATE, 1.0, IN_PROBE_SHARE)
        breaker.record(0.9, True, GATE, 1.0)
    assert breaker.state == OPEN
    assert breaker.admit(GATE, GATE.cooldown_s, OUTSIDE) == (CLOSED, True, False)


def test_cooldown_grows_on_consecutive_trips_up_to_the_cap():
    breaker = tripped()
    cooldowns = [breaker.cooldown]
    now = 0.0
    for _ in range(4):
        now = breaker.open_until
        for _ in range(GATE.min_probe_samples):
            breaker.admit(GATE, now, OUTSIDE)
            breaker.record(0.0, True, GATE, now)
        cooldowns.append(breaker.cooldown)
    assert cooldowns == [10, 30, 50, 50, 50]
    assert breaker.open_until == now + 50


def test_cooldown_growth_never_overflows():
    gate = GateConfig(cooldown_s=1, cooldown_growth=1e300, max_cooldown_s=60, min_samples=1, min_probe_samples=1)
    breaker = Breaker()
    breaker.record(0.0, False, gate, 0.0)
    for _ in range(5):
        now = breaker.open_until
        breaker.admit(gate, now, 0.9)
        breaker.record(0.0, True, gate, now)
    assert breaker.cooldown == 60


def test_close_restarts_the_cooldown_at_its_base():
    breaker = half_open()
    for _ in range(GATE.min_probe_samples):
        breaker.admit(GATE, 10.0, OUTSIDE)
        breaker.record(1.0, True, GATE, 10.0)
    for _ in range(GATE.min_samples):
        breaker.record(0.0, False, GATE, 20.0)
    assert (breaker.state, breaker.cooldown) == (OPEN, GATE.cooldown_s)


@settings(max_examples=200)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["admit", "record", "release"]),
            st.floats(0, 1),
            st.floats(0, 1, exclude_max=True),
            st.floats(0, 5),
        ),
        max_size=80,
    )
)
def test_probes_in_flight_never_exceed_the_cap(steps):
    breaker, now, probes = Breaker(), 0.0, []
    for action, alpha, bucket, dt in steps:
        now += dt
        if action == "admit":
            state, admitted, probe = breaker.admit(GATE, now, bucket)
            if admitted:
                probes.append(probe)
        elif action == "record" and probes:
            breaker.record(alpha, probes.pop(), GATE, now)
        elif action == "release":
            breaker.release()
        assert 0 <= breaker.probes <= GATE.max_concurrent_probes
        assert breaker.state in (CLOSED, OPEN, HALF_OPEN)


@pytest.mark.parametrize(
    ("temperature", "bands", "model"),
    [
        (None, (0.5,), "m"),
        (0.0, (0.5,), "m"),
        (0.5, (0.5,), "m"),  # a bound belongs to the band below it
        (0.51, (0.5,), "m|T>0.5"),
        (0.7, (0.5,), "m|T>0.5"),
        (0.7, (), "m"),
        (0.3, (0.3, 0.6), "m"),
        (0.31, (0.3, 0.6), "m|T>0.3"),
        (0.6, (0.3, 0.6), "m|T>0.3"),
        (0.61, (0.3, 0.6), "m|T>0.6"),
    ],
)
def test_a_tenants_state_is_keyed_by_the_temperature_band_of_the_request(temperature, bands, model):
    assert state_model("m", temperature, bands) == model
