"""The whole loop through uvicorn and the openai client: low acceptance trips one tenant's breaker,
the cooldown passes (injected clock), probes see high acceptance and close it again; another
tenant speculates throughout."""

from __future__ import annotations

import openai
import pytest
from support.clock import Clock
from support.servers import serve_asgi, wait_for
from support.tenants import tenant
from support.upstream import FakeUpstream, Script, figures

from ace_mw.config import AceConfig
from ace_mw.controller import AceController
from ace_mw.integrations import AceSpecDec

GATE = {
    "policy": "acceptance",  # the breaker's loop alone; the speed policy's is in test_asgi_speed_loop.py
    "min_samples": 3,
    "alpha_floor": 0.55,
    "reenable_threshold": 0.65,
    "cooldown_s": 30,
    "probe_fraction": 0.0,
    "max_concurrent_probes": 2,
    "min_probe_samples": 2,
}
LOW, HIGH = figures(10, 2, 10), figures(10, 9, 5)


@pytest.fixture(scope="module")
def loop():
    clock = Clock()
    upstream = FakeUpstream(Script(figures=LOW))
    controller = AceController(AceConfig.from_dict({"mode": "prod", "gate": GATE}), clock=clock)
    with serve_asgi(AceSpecDec(upstream.app, controller=controller)) as url:
        yield url, upstream, controller, clock


def breaker_is(controller: AceController, key: str, state: str) -> None:
    """The client may read `[DONE]` a moment before the server sends the response's final (empty)
    message, where the middleware records the figures: wait for that, briefly."""
    view = lambda: controller.store.view((tenant(key), "m"))  # noqa: E731
    wait_for(lambda: (view().state, view().probes) == (state, 0), timeout=5, what=f"breaker {state}")


def ask(url: str, key: str) -> tuple[str, str]:
    """One streamed chat request; (outcome header, reason header)."""
    client = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=10)
    raw = client.chat.completions.with_raw_response.create(
        model="m", messages=[{"role": "user", "content": "hi"}], temperature=0.0, stream=True
    )
    list(raw.parse())
    return raw.headers["x-ace-speculative-decoding"], raw.headers["x-ace-speculative-decoding-reason"]


def test_breaker_trips_probes_and_recloses_for_one_tenant_only(loop):
    url, upstream, controller, clock = loop

    def asked() -> bool:
        return upstream.received[-1].json["use_speculative_decoding"]

    # Low acceptance: the third response (min_samples) trips tenant A's breaker.
    for _ in range(3):
        assert ask(url, "sk-a") == ("applied", "ok")
    breaker_is(controller, "sk-a", "open")
    assert ask(url, "sk-a") == ("gated", "breaker_open")
    assert asked() is False

    # Tenant B is unaffected (two low responses stay under its own min_samples).
    assert ask(url, "sk-b") == ("applied", "ok")
    assert asked() is True

    # After the cooldown, A is HALF_OPEN: probes speculate, at most max_concurrent_probes.
    clock.now += GATE["cooldown_s"]
    upstream.script = Script(figures=HIGH)
    assert ask(url, "sk-a") == ("applied", "probe")
    assert asked() is True
    assert ask(url, "sk-a") == ("applied", "probe")

    # Two high-acceptance probe responses re-close it; A speculates normally again.
    breaker_is(controller, "sk-a", "closed")
    assert ask(url, "sk-a") == ("applied", "ok")
    assert controller.store.view((tenant("sk-b"), "m")).state == "closed"
