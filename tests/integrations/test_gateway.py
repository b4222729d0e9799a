"""`ace-mw gateway`'s app in this process: AceSpecDec in front of a proxy that streams each request
to the pool its decision names, pools read from the config in force."""

from __future__ import annotations

from contextlib import contextmanager

import httpx
import openai
import pytest
from support.ports import free_port, listening_socket
from support.servers import serve_asgi, wait_for
from support.upstream import FakeUpstream, Script, figures

from ace_mw.integrations import gateway
from ace_mw.integrations.gateway import build_app, candidate, forwardable, parser, pool_argument


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


# -- pools that fail -----------------------------------------------------------------------------


def refused_url() -> str:
    """A loopback URL nothing listens on: connections are refused at once."""
    return f"http://127.0.0.1:{free_port()}"


@contextmanager
def silent_pool():
    """A pool that accepts connections and never answers."""
    sock = listening_socket()
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        sock.close()


def gateway_config(pools: dict[str, str], **upstream) -> dict:
    candidates = [{"algorithm": "ngram", "pool": name} for name in pools if name != "baseline"]
    gate = {"policy": "acceptance", "max_measured_per_s": 1000}
    return {
        "mode": "prod",
        "adapter": "vllm",
        "pools": pools,
        "candidates": candidates,
        "gate": gate,
        "upstream": upstream,
    }


def test_a_refused_pool_answers_502_in_openais_shape_and_no_traceback(caplog):
    with serve_asgi(FakeUpstream(name="baseline").app) as base:
        app = build_app(gateway_config({"baseline": base, "speculative": refused_url()}, eject_after_failures=100))
        with serve_asgi(app) as url:
            with pytest.raises(openai.APIStatusError) as caught:
                chat(url, temperature=0.0)
    assert caught.value.status_code == 502
    assert caught.value.body["type"] == "bad_gateway" and "'speculative'" in caught.value.body["message"]
    # one warning line, no traceback of the app's
    assert any("'speculative' could not be reached" in r.getMessage() for r in caplog.records)
    assert not [r for r in caplog.records if "Exception in ASGI application" in r.getMessage()]


def test_a_pool_that_never_answers_gets_a_504_after_the_configured_wait():
    with serve_asgi(FakeUpstream(name="baseline").app) as base, silent_pool() as silent:
        config = gateway_config({"baseline": base, "speculative": silent}, first_byte_timeout_s=0.5)
        with serve_asgi(build_app(config)) as url:
            with pytest.raises(openai.APIStatusError) as caught:
                chat(url, temperature=0.0)
    assert caught.value.status_code == 504 and caught.value.body["type"] == "gateway_timeout"


def test_a_failing_pool_is_ejected_its_requests_fall_back_and_it_comes_back():
    """Envoy's outlier detection: two failures in a row eject the speculative pool; requests go to
    the baseline pool meanwhile (reason pool_ejected); once the ejection is over the pool is tried
    again, and serves."""
    broken_port = free_port()
    speculative = FakeUpstream(Script(figures=figures(10, 8, 4)), "speculative")
    with serve_asgi(FakeUpstream(name="baseline").app) as base:
        pools = {"baseline": base, "speculative": f"http://127.0.0.1:{broken_port}"}
        app = build_app(gateway_config(pools, eject_after_failures=2, ejection_s=1.0))
        with serve_asgi(app) as url:
            for _ in range(2):
                with pytest.raises(openai.APIStatusError):
                    chat(url, temperature=0.0)
            fallen = chat(url, temperature=0.0)
            assert fallen.headers["x-upstream-name"] == "baseline"
            assert fallen.headers["x-ace-speculative-decoding-reason"] == "pool_ejected"
            health = httpx.get(url + "/health", timeout=5).json()
            assert health["status"] == "ok" and health["pools"]["speculative"]["ejected"] is True
            status = app.controller.status()["pools"]["speculative"]
            assert status["ejected"] and status["ejections"] == 1
            with serve_asgi(speculative.app, port=broken_port):
                wait_for(lambda: not app.controller.pool_health()["speculative"]["ejected"], 5, "the ejection to end")
                back = chat(url, temperature=0.0)
            assert back.headers["x-upstream-name"] == "speculative"
            assert back.headers["x-ace-speculative-decoding-reason"] == "ok"


def test_a_pool_dying_mid_stream_gives_the_client_what_it_sent_then_an_error_and_teaches_nothing():
    dying = FakeUpstream(Script(chunks=["a", "b", "c", "d"], die_after=2, figures=figures(10, 8, 4)), "speculative")
    with serve_asgi(FakeUpstream(name="baseline").app) as base, serve_asgi(dying.app) as spec:
        app = build_app(gateway_config({"baseline": base, "speculative": spec}))
        with serve_asgi(app) as url:
            received = bytearray()
            with pytest.raises(httpx.RemoteProtocolError):
                with httpx.stream(
                    "POST",
                    url + "/v1/chat/completions",
                    json={"model": "m", "messages": [], "temperature": 0, "stream": True},
                    headers={"authorization": "Bearer sk-gw"},
                    timeout=20,
                ) as response:
                    for chunk in response.iter_raw():
                        received += chunk
            wait_for(lambda: app.controller.status()["tenants"], 5, "the response to finish")
    sent = b"".join(dying.sent[-1])
    assert bytes(received) == sent and b"[DONE]" not in sent  # what the pool sent, nothing invented
    (row,) = app.controller.status()["tenants"]
    assert row["breaker"]["samples"] == 0  # a broken answer teaches nothing


def test_models_and_health_answer_for_an_openai_client():
    with serve_asgi(FakeUpstream(name="baseline").app) as base:
        with serve_asgi(build_app({"mode": "prod", "adapter": "vllm", "pools": {"baseline": base}})) as url:
            client = openai.OpenAI(base_url=url + "/v1", api_key="sk-gw", max_retries=0, timeout=20)
            assert [m.id for m in client.models.list()]
            assert httpx.get(url + "/health", timeout=5).json()["status"] == "ok"


def test_without_a_config_each_pool_is_labelled_by_what_it_says_it_runs():
    assert candidate("ngram/k4") == {"algorithm": "ngram", "pool": "ngram/k4", "num_speculative_tokens": 4}
    assert candidate("eagle3") == {"algorithm": "eagle_3", "pool": "eagle3"}
    assert candidate("speculative", "draft/k6") == {
        "algorithm": "draft_model",
        "pool": "speculative",
        "num_speculative_tokens": 6,
    }
    with pytest.raises(SystemExit, match="pool 'speculative': say what it runs"):
        candidate("speculative")


def test_the_command_line_gateway_labels_arms_by_their_pools():
    with serve_asgi(FakeUpstream(Script(figures=figures(10, 8, 4)), "ngram").app) as ngram:
        with serve_asgi(FakeUpstream(name="baseline").app) as base:
            args = parser().parse_args(["--pool", f"baseline={base}", "--pool", f"ngram/k4={ngram}"])
            served = {}
            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(gateway, "serve", lambda app, host, port: served.setdefault("app", app))
                gateway.run(args)
            with serve_asgi(served["app"]) as url:
                answer = chat(url, temperature=0.0)
    assert answer.headers["x-ace-speculative-decoding-arm"] == "ngram/k4@ngram"
    assert answer.headers["x-upstream-name"] == "ngram"
