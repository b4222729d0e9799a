"""The pooled prior, black box: tenants on one model teach a newcomer what each arm is worth.

A real uvicorn upstream streams at a speed per arm (EAGLE-2 at 0.4x plain, prompt lookup a
little slower than plain for everyone but some tenants, whose repetitive traffic makes it pay, and
EAGLE-2 2.7x plain for one tenant), AceSpecDec in front, the real `openai` client and real time.
Veterans measure the arms; then:
- a new tenant whose only candidate is EAGLE-2 runs at most one speculative request before it
  settles on plain decoding, and its first request is decided by the prior;
- new tenants whose own traffic makes prompt lookup pay are on it within 10 requests;
- a tenant for whom EAGLE-2 pays leaves the tight prior that says it does not (issue 40);
- the status report shows the prior per (model, arm).
"""

from __future__ import annotations

import functools

import openai
import pytest
from support.servers import serve_asgi
from support.upstream import FakeUpstream, Script, figures

from ace_mw import AceConfig, AceController
from ace_mw.integrations import AceSpecDec

PLAIN, SLOW, NEAR, FAST = 0.008, 0.020, 0.009, 0.003  # seconds before each streamed chunk
CHUNKS = tuple(f"tok{i} " for i in range(8))
REPETITIVE = tuple(f"sk-repetitive-{i}" for i in range(4))
EAGLE_PAYS = "sk-eagle-pays"
BOTH = {"candidates": [{"algorithm": "eagle_2"}, {"algorithm": "ngram"}]}
CONFIG = {
    "mode": "prod",
    "adapter": "ace",
    "gate": {"speed_min_samples": 2, "speed_half_life": 4},
    "keys": {
        **{f"sk-veteran-{i}": BOTH for i in range(3)},
        "sk-new-eagle": {"speculative": {"algorithm": "eagle_2"}},
        EAGLE_PAYS: {"speculative": {"algorithm": "eagle_2"}},
        **dict.fromkeys(REPETITIVE, {"speculative": {"algorithm": "ngram"}}),
    },
}


@pytest.fixture(scope="module")
def fleet():
    upstream = FakeUpstream(
        Script(
            chunks=CHUNKS,
            figures=figures(drafted=40, accepted=36, steps=8),  # alpha 0.9: only speed moves anyone
            arm_delay_s={"plain": PLAIN, "eagle_2": SLOW, "ngram": NEAR},
            key_arm_delay_s={**dict.fromkeys(REPETITIVE, {"ngram": FAST}), EAGLE_PAYS: {"eagle_2": FAST}},
        )
    )
    controller = AceController(AceConfig.from_dict(CONFIG))
    with serve_asgi(AceSpecDec(upstream.app, controller=controller)) as url:
        for i in range(3):
            run(url, f"sk-veteran-{i}", 30)
        yield url, controller


@functools.cache
def client(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=30)


def run(url: str, key: str, n: int) -> list[tuple[str, str]]:
    """n streamed greedy requests of one tenant, each its own conversation: (arm, reason) of each."""
    seen = []
    for i in range(n):
        response = client(url, key).chat.completions.with_raw_response.create(
            model="m",
            messages=[{"role": "user", "content": "hi"}],
            temperature=0.0,
            stream=True,
            extra_headers={"x-ace-conversation-id": f"{key}-{i}"},
        )
        assert "".join(c.choices[0].delta.content or "" for c in response.parse() if c.choices) == "".join(CHUNKS)
        seen.append(
            (response.headers["x-ace-speculative-decoding-arm"], response.headers["x-ace-speculative-decoding-reason"])
        )
    return seen


def test_a_new_tenant_settles_on_plain_from_what_the_others_measured(fleet):
    url, _ = fleet
    seen = run(url, "sk-new-eagle", 20)
    assert seen[0] == ("plain", "prior")  # decided on its first request, by the prior
    assert sum(arm != "plain" for arm, _ in seen) <= 1, seen


def test_tenants_whose_traffic_makes_a_candidate_pay_leave_the_prior(fleet):
    """Four tenants whose repetitive traffic makes prompt lookup pay 2.7x where the veterans'
    prior says 0.9x: a chance that it pays for them too, so each measures it itself at once, and is
    on it from then on. (As they join, the prior follows them: past half of its weight they are the
    prior.)"""
    url, _ = fleet
    reached = []
    for key in REPETITIVE:
        seen = run(url, key, 16)
        arms = [arm for arm, _ in seen]
        on = next((i for i in range(len(arms) - 4) if arms[i : i + 4].count("ngram/k5") >= 3), None)
        assert on is not None, (key, seen)
        assert arms[-4:].count("ngram/k5") >= 3, arms  # and stays there
        reached.append(on)
    assert max(reached) <= 10, reached


def test_a_tenant_for_whom_a_candidate_pays_leaves_a_tight_prior_that_says_it_does_not(fleet):
    """Three veterans measured EAGLE-2 at 0.4x plain; for this tenant it runs at 2.7x. Probability
    matching alone would never send it there: its first own sample is owed (speed.first_sample_due),
    after its first request, which the prior decides. It is on EAGLE-2 for >= 8 of requests 16-25."""
    url, _ = fleet
    seen = run(url, EAGLE_PAYS, 25)
    arms = [arm for arm, _ in seen]
    assert seen[0] == ("plain", "prior"), seen
    assert arms[15:25].count("eagle_2/k5") >= 8, seen


def test_the_status_report_shows_the_prior_per_model_and_arm(fleet):
    _, controller = fleet
    priors = {(p["model"], p["arm"]): p for p in controller.status()["priors"]}
    eagle, ngram = priors["m", "eagle_2/k5"], priors["m", "ngram/k5"]
    # every veteran measured prompt lookup; EAGLE-2 only those that tried it before the prior spoke
    assert eagle["tenants"] >= 1 and ngram["tenants"] >= 3
    assert 0.25 < eagle["speedup"] < 0.6  # measured at about PLAIN / SLOW = 0.4
    assert ngram["speedup"] > 0.7  # PLAIN / NEAR = 0.89 for the veterans, 2.7 for the repetitive tenants
