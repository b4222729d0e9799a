"""`AceController.status()`: what the status page shows, from the controller's own state (an
injected clock, samples fed through the store's API), and the page rendered from it."""

from __future__ import annotations

import pytest
from support.clock import Clock

from ace_mw import AceConfig, AceController, RequestView, hash_key
from ace_mw.decide.samples import SpeedSample
from ace_mw.integrations.status_page import render_status
from ace_mw.state import InMemoryStateStore

GATE = {"speed_min_samples": 2, "explore_fraction": 0.0, "explore_fraction_unmeasured": 0.0, "min_samples": 2}
KEY = "sk-status-test"


def controller(**overrides) -> tuple[AceController, Clock]:
    clock = Clock(100.0)
    data = {"mode": "prod", "gate": GATE, "candidates": [{"algorithm": "eagle_2"}, {"algorithm": "ngram"}], **overrides}
    return AceController(AceConfig.from_dict(data), clock=clock), clock


def tenant_of(key: str) -> str:
    return hash_key(key)[len("sha256:") :][:16]


def feed(ace: AceController, arm: str, rate: float, n: int = 3, key: str = KEY) -> None:
    gate = ace.config.gate
    for _ in range(n):
        ace.store.record_speed((tenant_of(key), "m"), arm, SpeedSample(rate, 1.0, "stream"), gate, 100.0)


def decide(ace: AceController, key: str = KEY) -> None:
    view = RequestView(
        "POST", "/v1/chat/completions", {"authorization": f"Bearer {key}"}, {"model": "m", "temperature": 0}
    )
    observer = ace.observe(ace.decide(view))
    if observer is not None:  # None past the read rate: nothing to read or record
        observer.finish()


def row(ace: AceController) -> dict:
    (only,) = ace.status()["tenants"]
    return only


def test_the_chosen_arm_is_the_measured_fastest_and_its_speedup_is_over_plain():
    ace, _ = controller()
    decide(ace)
    feed(ace, "plain", 50.0)
    feed(ace, "eagle_2/k5", 40.0)
    feed(ace, "ngram/k5", 80.0)
    status = row(ace)
    assert status["chosen_arm"] == "ngram/k5"
    assert status["speedup"] == pytest.approx(80.0 / 50.0)
    assert [(a["arm"], a["measured"]) for a in status["arms"]] == [
        ("plain", True),
        ("eagle_2/k5", True),
        ("ngram/k5", True),
    ]
    assert [a["tokens_per_s"] for a in status["arms"]] == pytest.approx([50.0, 40.0, 80.0])


def test_plain_is_chosen_when_speculation_measured_slower():
    ace, _ = controller()
    decide(ace)
    feed(ace, "plain", 50.0)
    feed(ace, "eagle_2/k5", 40.0)
    feed(ace, "ngram/k5", 50.5)  # within the 2 % margin: not worth drafting
    assert (row(ace)["chosen_arm"], row(ace)["speedup"]) == ("plain", 1.0)


def test_an_arm_with_too_little_evidence_counts_as_unmeasured_but_still_informs():
    ace, _ = controller()
    decide(ace)
    feed(ace, "plain", 50.0)
    feed(ace, "ngram/k5", 500.0, n=1)  # one sample, two needed to count as measured
    status = row(ace)
    assert [a["measured"] for a in status["arms"]] == [True, False, False]
    # one sample at 10x plain is uncertain evidence, but evidence: the posterior prefers ngram
    assert (status["chosen_arm"], status["chosen_reason"]) == ("ngram/k5", "ok")
    assert status["speedup"] == pytest.approx(10.0, rel=0.01)


def test_an_open_breaker_keeps_the_tenant_on_plain():
    ace, clock = controller()
    feed(ace, "ngram/k5", 80.0)
    feed(ace, "plain", 50.0)
    gate = ace.config.gate
    for _ in range(3):
        ace.store.record((tenant_of(KEY), "m"), 0.1, probe=False, gate=gate, now=clock.now)
    status = row(ace)
    assert status["breaker"]["state"] == "open"
    assert status["breaker"]["reopens_in_s"] == gate.cooldown_s
    assert status["chosen_arm"] == "plain"


def test_the_acceptance_policy_always_chooses_the_first_candidate():
    ace, _ = controller(gate={**GATE, "policy": "acceptance"})
    decide(ace)
    feed(ace, "plain", 90.0)
    assert row(ace)["chosen_arm"] == "eagle_2/k5"


def test_arms_of_an_earlier_config_are_listed_after_the_current_ones():
    ace, _ = controller()
    feed(ace, "draft_model/k3", 70.0)
    assert [(a["arm"], a["current"]) for a in row(ace)["arms"]] == [
        ("plain", True),
        ("eagle_2/k5", True),
        ("ngram/k5", True),
        ("draft_model/k3", False),
    ]


def test_verdicts_by_reason_are_kept_per_tenant_and_evicted_with_it():
    ace, _ = controller(gate={**GATE, "max_tracked_tenants": 2})
    for key in ("sk-a", "sk-a", "sk-b", "sk-c"):
        decide(ace, key)
    rows = {r["tenant"]: r["decisions"] for r in ace.status()["tenants"]}
    assert rows == {tenant_of("sk-b"): {"ok": 1}, tenant_of("sk-c"): {"ok": 1}}  # sk-a evicted, counts too
    assert ace.status()["decisions"] == {"applied": {"ok": 4}}


def test_responses_past_the_read_rate_are_counted_per_tenant_and_shown():
    ace, _ = controller(gate={**GATE, "max_measured_per_s": 1.0})  # the clock stands still: one read
    for _ in range(3):
        decide(ace)
    status = row(ace)
    assert (status["decisions"], status["unread"]) == ({"ok": 3}, 2)
    page = render_status({**ace.status(), "failures": {}})
    assert 'ok 3<br><span class="muted">2 not measured (read-rate cap)</span>' in page


def test_process_counts_cover_every_outcome_and_a_temperature_gate_is_not_per_tenant():
    ace, _ = controller()
    decide(ace)
    hot = RequestView("POST", "/v1/chat/completions", {}, {"model": "m", "temperature": 1.2})
    ace.observe(ace.decide(hot)).finish()
    ace.observe(ace.decide(RequestView("POST", "/v1/chat/completions", {}, None, "not_json"))).finish()
    assert ace.status()["decisions"] == {
        "applied": {"ok": 1},
        "gated": {"temperature": 1},
        "off": {"body_unreadable:not_json": 1},
    }
    assert [r["tenant"] for r in ace.status()["tenants"]] == [tenant_of(KEY)]


def test_store_health_is_passed_through_whatever_it_reports():
    class FleetStore(InMemoryStateStore):
        def health(self):
            return {"backend": "redis", "degraded": True, "degraded_since": 86400.0, "fleet_view_age_s": 12.5}

    ace = AceController(AceConfig.from_dict({"mode": "prod"}), store=FleetStore())
    report = ace.status()
    assert report["store"] == {
        "backend": "redis",
        "degraded": True,
        "degraded_since": 86400.0,
        "fleet_view_age_s": 12.5,
    }
    page = render_status({**report, "failures": {}})
    assert '<dt>degraded</dt><dd><span class="warn">True</span></dd>' in page
    assert '<dt>degraded_since</dt><dd><span class="warn">1970-01-02 00:00:00 UTC (' in page
    assert "<dt>fleet_view_age_s</dt><dd>12.5</dd>" in page


def test_the_status_limit_bounds_the_tenants_shown():
    ace, _ = controller()
    for i in range(5):
        decide(ace, f"sk-{i}")
    assert [r["tenant"] for r in ace.status(limit=2)["tenants"]] == [tenant_of("sk-4"), tenant_of("sk-3")]


def test_each_arm_shows_its_own_acceptance_explored_arms_included():
    """The breaker judges the arm the tenant runs; the status page shows every arm's own rolling
    acceptance, from the responses each served."""
    import json

    candidates = [{"algorithm": "eagle_2", "pool": "eagle"}, {"algorithm": "ngram", "pool": "ngram"}]
    pools = {"baseline": "http://b", "eagle": "http://e", "ngram": "http://n"}
    ace, _ = controller(gate={**GATE, "policy": "acceptance"}, adapter="vllm", candidates=candidates, pools=pools)
    view = RequestView(
        "POST", "/v1/chat/completions", {"authorization": f"Bearer {KEY}"}, {"model": "m", "temperature": 0}
    )
    for accepted in (6, 8):
        observer = ace.observe(ace.decide(view))
        observer.start(200, "application/json")
        stats = {"num_draft_tokens": 10, "num_accepted_draft_tokens": accepted, "num_spec_steps": 3}
        body = {"usage": {"completion_tokens": 20}, "metrics": {"speculative_decoding": stats}}
        observer.feed(json.dumps(body).encode(), more_body=False)
        observer.finish()
    arms = {a["arm"]: a for a in row(ace)["arms"]}
    decay = ace.config.gate.decay
    assert arms["eagle_2/k5@eagle"]["acceptance"] == pytest.approx(0.6 * decay + 0.8 * (1 - decay))
    assert arms["eagle_2/k5@eagle"]["acceptance_responses"] == 2
    assert arms["plain"]["acceptance"] is None and arms["ngram/k5@ngram"]["acceptance_responses"] == 0
    assert "acceptance 0.6" in render_status(ace.status())
