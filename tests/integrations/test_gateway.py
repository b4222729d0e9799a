"""`ace-mw gateway`'s app in this process: AceSpecDec in front of a proxy that streams each request
to the pool its decision names, pools read from the config in force."""

from __future__ import annotations

import httpx
import openai
from support.servers import serve_asgi
from support.upstream import FakeUpstream, Script, figures

from ace_mw.integrations.gateway import build_app, forwardable, pool_argument


def chat(url: str, key: str = "sk-gw", **fields):
    client = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=20)
    return client.chat.completions.with_raw_response.create(
        model="m", messages=[{"role": "user", "content": "hi"}], **fields
    )


def test_requests_go_to_the_pool_of_their_decision_and_follow_an_update():
    speculative = FakeUpstream(Script(figures=figures(10, 8, 4)), "speculative")
    baseline, other = FakeUpstream(name="baseline"), FakeUpstream(name="other")
    with serve_asgi(speculative.app) as spec, serve_asgi(baseline.app) as base, serve_asgi(other.app) as third:
        config = {"mode": "prod", "adapter": "vllm", "pools": {"speculative": spec, "baseline": base}}
        middleware = build_app(config)
        with serve_asgi(middleware) as url:
            assert chat(url, temperature=0.0).headers["x-upstream-name"] == "speculative"
            assert chat(url, temperature=1.5).headers["x-upstream-name"] == "baseline"  # gated
            from ace_mw import AceConfig

            middleware.controller.update(AceConfig.from_dict({**config, "pools": {"baseline": third}, "mode": "off"}))
            assert chat(url, temperature=0.0).headers["x-upstream-name"] == "other"  # the config in force
            undecided = httpx.post(url + "/v1/completions", json={"model": "m", "prompt": "hi"}, timeout=20)
            assert undecided.headers["x-upstream-name"] == "other"


def test_hop_by_hop_headers_stay_on_their_hop_and_pools_parse():
    assert forwardable({"Connection": "close", "X-Keep": "1", "content-length": "3"}) == {"X-Keep": "1"}
    assert pool_argument("draft=http://d:1") == ("draft", "http://d:1")
