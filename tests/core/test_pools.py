"""What the configured pools are, asked off the request path (pools.py): a pool that is down,
answers garbage to its probe, or answers without the engine's figures never fails a request, and
the status page says so."""

from __future__ import annotations

import socket
import time

import httpx
import pytest
from starlette.applications import Starlette
from starlette.responses import JSONResponse, PlainTextResponse
from starlette.routing import Route
from support.servers import serve_asgi, wait_for
from support.upstream import FakeUpstream

from ace_mw import AceConfig, AceController
from ace_mw.adapters import get_adapter
from ace_mw.integrations import AceSpecDec
from ace_mw.integrations.status_page import render_status

CHAT = "/v1/chat/completions"
BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 0.0}


def closed_port() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


def props_app(answer) -> Starlette:
    """An engine double whose /props answers `answer` and whose completions are a fake engine's."""
    engine = FakeUpstream()
    return Starlette(routes=[Route("/props", lambda request: answer), *engine.app.routes])


def test_unreachable_garbage_and_foreign_pools_fail_nothing_and_show_on_the_status_page():
    garbage = props_app(PlainTextResponse("<html>not an engine</html>"))
    good = props_app(
        JSONResponse({"default_generation_settings": {"params": {"speculative.n_max": 16}}, "build_info": "b1-x"})
    )
    with serve_asgi(garbage) as garbage_url, serve_asgi(good) as good_url:
        config = {
            "mode": "prod",
            "adapter": "llamacpp",
            "gate": {"policy": "acceptance"},
            "pools": {"baseline": good_url, "lookup": garbage_url, "down": closed_port()},
            "candidates": [{"algorithm": "ngram", "pool": "lookup"}, {"algorithm": "draft_model", "pool": "down"}],
        }
        controller = AceController(AceConfig.from_dict(config))
        proxy = FakeUpstream()  # answers every pool's requests: an OpenAI server without llama.cpp's timings
        with serve_asgi(AceSpecDec(proxy.app, controller=controller)) as url:
            controller.start()
            try:
                wait_for(lambda: all(p["probed"] for p in controller.status()["pools"].values()), what="the probes")
                answers = [httpx.post(url + CHAT, json=BODY, timeout=10) for _ in range(6)]
                report = controller.status()
            finally:
                controller.close()
    assert all(a.status_code == 200 and a.json()["choices"][0]["message"]["content"] for a in answers)
    pools = report["pools"]
    assert pools["baseline"]["facts"] == {"honours_n_max": True, "build": "b1-x", "model": None}
    assert "not llama-server's /props" in pools["lookup"]["error"] or "JSONDecodeError" in pools["lookup"]["error"]
    assert pools["down"]["error"].startswith("URLError")
    assert pools["lookup"]["responses"] == {"no_figures": 6}
    warnings = report["warnings"]
    assert len(warnings) == 3 and render_status(report).count('data-warning="pool"') == 3
    assert warnings[0].startswith("pool lookup (") and "probe failed" in warnings[0]
    assert warnings[1] == "pool lookup: its last 6 responses carried none of the engine's figures"
    assert warnings[2].startswith("pool down (") and "probe failed: URLError" in warnings[2]


def test_a_probed_pool_whose_responses_carry_no_figures_is_flagged():
    good = props_app(JSONResponse({"default_generation_settings": {"params": {}}, "build_info": "b1-y"}))
    with serve_asgi(good) as good_url:
        config = {
            "mode": "prod",
            "adapter": "llamacpp",
            "gate": {"policy": "acceptance"},
            "pools": {"baseline": good_url, "lookup": good_url},
            "candidates": [{"algorithm": "ngram", "pool": "lookup"}],
        }
        controller = AceController(AceConfig.from_dict(config))
        with serve_asgi(AceSpecDec(FakeUpstream().app, controller=controller)) as url:
            controller.start()
            try:
                wait_for(lambda: controller.status()["pools"]["lookup"]["probed"], what="the probe")
                for _ in range(5):
                    assert httpx.post(url + CHAT, json=BODY, timeout=10).status_code == 200
                report = controller.status()
            finally:
                controller.close()
    assert report["pools"]["lookup"]["facts"]["honours_n_max"] is False
    assert report["warnings"] == ["pool lookup: its last 5 responses carried none of the engine's figures"]
    assert "carried none of the engine" in render_status(report)


def test_pools_of_an_adapter_without_a_probe_are_listed_unasked():
    """SGLang's adapter has no probe (vLLM's asks /v1/models, llama.cpp's /props)."""
    config = {"mode": "prod", "adapter": "sglang", "pools": {"baseline": closed_port(), "speculative": closed_port()}}
    controller = AceController(AceConfig.from_dict(config))
    controller.start()
    try:
        time.sleep(0.2)
        pools = controller.status()["pools"]
    finally:
        controller.close()
    assert set(pools) == {"baseline", "speculative"} and not any(p["probed"] or p["error"] for p in pools.values())


def test_a_vllm_pool_says_its_model_and_context():
    answer = {
        "object": "list",
        "data": [{"id": "ace-tiny-chat", "object": "model", "owned_by": "vllm", "max_model_len": 2048}],
    }
    assert get_adapter("vllm").read_probe(answer) == {
        "model": "ace-tiny-chat",
        "max_model_len": 2048,
        "owned_by": "vllm",
    }
    for wrong in ({}, {"data": []}, [1], {"data": "x"}):
        with pytest.raises(ValueError):
            get_adapter("vllm").read_probe(wrong)
