"""The closed-loop workload: who sends what, and what each policy's configuration decides for it."""

from __future__ import annotations

from collections import Counter

import pytest

pytest.importorskip("torch")  # ace_mw.engine

from ace_mw import AceConfig, AceController, RequestView
from ace_mw.demo import workload
from ace_mw.demo.workload import FLAKY, KEYS, PREDICTABLE, TENANTS, UNPREDICTABLE, FlakyPlan, Probe
from ace_mw.engine.prompts import CATEGORIES

ALGORITHMS = ("eagle_2", "draft_model", "ngram")
HEADER = "x-ace-skill-speculative-decoding"


@pytest.fixture(scope="module")
def prompts():
    return workload.workload_prompts()


@pytest.fixture(scope="module")
def plan():
    return FlakyPlan(
        (Probe("code", "predictable", 0.0, 0, 0.9), Probe("chat", "also predictable", 0.0, 0, 0.8)),
        (Probe("chat", "hot", 0.7, 1000, 0.1),),
    )


def base(pace_s: float = 3.0) -> dict:
    return workload.demo_config("ace", pace_s, ALGORITHMS)


def decide(policy: str, tenant: str, temperature: float = 0.0, header: str | None = None, conversation: str = "c"):
    controller = AceController(workload.policy_config(base(), policy))
    headers = {"authorization": f"Bearer {KEYS[tenant]}"}
    if header:
        headers[HEADER] = header
    body = {"model": "m", "messages": [], "temperature": temperature, "user": conversation}
    return controller.decide(RequestView("POST", "/v1/chat/completions", headers, body))


def test_workload_is_deterministic_and_mixed(prompts, plan):
    requests = workload.build_workload(200, prompts, plan, seed=3)
    assert requests == workload.build_workload(200, prompts, plan, seed=3)
    assert requests != workload.build_workload(200, prompts, plan, seed=4)
    assert {r.category for r in requests} == set(CATEGORIES)
    temperatures = {r.temperature for r in requests}
    assert min(temperatures) == 0.0 and max(temperatures) == 1.2
    assert {r.stream for r in requests} == {True, False}
    assert {r.tenant for r in requests} == {t.name for t in TENANTS}
    assert {r.header for r in requests if r.tenant == "header"} == {None, "prod", "off"}
    assert all(r.header is None for r in requests if r.tenant != "header")


def test_tenants_get_their_weight_of_the_traffic_evenly_spread():
    schedule = [t.name for t in workload.tenant_schedule(100)]
    total = sum(t.weight for t in TENANTS)
    counts = Counter(schedule)
    for tenant in TENANTS:
        assert abs(counts[tenant.name] - 100 * tenant.weight / total) <= 1
    assert all(a != b or a == FLAKY for a, b in zip(schedule, schedule[1:], strict=False))  # no runs


def test_flaky_tenant_turns_unpredictable_mid_run_then_predictable_again(prompts, plan):
    flaky = [r for r in workload.build_workload(100, prompts, plan) if r.tenant == FLAKY]
    phases = [r.phase for r in flaky]
    changes = [phases[0]] + [b for a, b in zip(phases, phases[1:], strict=False) if a != b]
    assert changes == [PREDICTABLE, UNPREDICTABLE, PREDICTABLE]
    assert all(r.stream for r in flaky)  # every response is a speed sample, so its arms are soon measured
    assert {(r.prompt, r.temperature) for r in flaky if r.phase == UNPREDICTABLE} == {("hot", 0.7)}
    assert {r.prompt for r in flaky if r.phase == PREDICTABLE} == {"predictable", "also predictable"}


def test_calibration_keeps_the_clearest_prompts_of_each_phase():
    high = [Probe("code", str(a), 0.0, 0, a) for a in (0.5, 0.9, None, 0.7, 0.8)]
    low = [Probe("chat", str(a), 0.7, 0, a) for a in (0.5, 0.0, 0.3, 0.2)]
    chosen = workload.choose_flaky_plan(high, low, per_phase=2)
    assert [p.alpha for p in chosen.predictable] == [0.9, 0.8]
    assert [p.alpha for p in chosen.unpredictable] == [0.0, 0.2]


@pytest.mark.parametrize("tenant", [t.name for t in TENANTS])
def test_always_on_speculates_every_request_with_the_first_candidate(tenant):
    decision = decide("always-on", tenant, temperature=1.2, header="off")
    assert (decision.outcome, decision.reason) == ("applied", "ok")
    assert decision.directive.enabled
    first = workload.policy_config(base(), "always-on").org.candidates[0]
    if tenant == "org":
        assert decision.directive.algorithm == first.algorithm


@pytest.mark.parametrize("tenant", [t.name for t in TENANTS])
def test_always_off_never_speculates(tenant):
    decision = decide("always-off", tenant, header="prod")
    assert decision.outcome == "off" and not decision.directive.enabled


def test_adaptive_keeps_the_demo_tenants_settings():
    assert decide("adaptive", "shadow").outcome == "shadow"
    assert decide("adaptive", "org", temperature=1.0).reason == "temperature"
    assert decide("adaptive", "header", header="prod").outcome == "applied"
    assert decide("adaptive", "header", header="off").reason == "mode_off"
    assert "override_not_permitted" in decide("adaptive", "org", header="off").notes
    canary = [decide("adaptive", "canary", conversation=f"c{i}").reason for i in range(200)]
    assert 0 < canary.count("ok") < 30 and canary.count("canary_excluded") > 170
    assert decide("adaptive", "multi").arm == "eagle_2/k6"  # the first candidate, until measured
    assert workload.policy_config(base(), "adaptive").gate.policy == "speed"
    assert workload.policy_config(base(), "acceptance").gate.policy == "acceptance"


def test_a_missing_drafter_falls_back_to_the_orgs_algorithm():
    config = workload.policy_config(workload.demo_config("ace", 3.0, ["ngram"]), "adaptive")
    algorithms = {c.algorithm for settings in config.key_table.values() for c in settings.candidates}
    assert algorithms == {"ngram"}
    assert all(len(set(s.candidates)) == len(s.candidates) for s in config.key_table.values())


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="unknown policy"):
        workload.policy_config(base(), "sometimes")


def test_the_gates_clocks_follow_the_runs_pace():
    slow, fast = (workload.policy_config(base(pace), "adaptive").gate for pace in (10.0, 0.5))
    assert slow.cooldown_s == pytest.approx(20 * fast.cooldown_s, rel=0.05)
    assert slow.max_cooldown_s == pytest.approx(2 * slow.cooldown_s, rel=0.01)
    assert slow.speed_half_life_s > fast.speed_half_life_s >= 600


def test_the_prior_warm_up_seeds_every_temperature_band_of_every_category(prompts):
    """The warm-up stands for a gateway's earlier traffic: greedy and sampled alike, so that a
    tenant's first hot request finds its band's pooled prior as its first greedy one does."""
    warm, requests = workload.prior_warm_up(base(), prompts)
    assert workload.band_temperatures(AceConfig.from_dict(warm).gate) == (0.0, 0.7)
    seen = Counter((r.tenant, r.temperature) for r in requests)
    tenants = {r.tenant for r in requests}
    assert len(tenants) == len([c for c in prompts if prompts[c]])
    assert set(seen) == {(t, temperature) for t in tenants for temperature in (0.0, 0.7)}
    assert len(set(seen.values())) == 1  # every band of every category as often
