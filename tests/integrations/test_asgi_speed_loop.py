"""The speed policy's closed loop, black box: a real uvicorn upstream that speaks the in-process
engine's wire format and streams at a different speed per arm (every arm reporting acceptance well
above the breaker's floor, so only speed can move a tenant), AceSpecDec in front, the real `openai`
client, and real time. Each tenant must end on its fastest arm, follow a flip of which arm is
fastest, and every byte the client sees must be the upstream's (minus the usage chunk the
middleware forced). Each tenant asks for a model of its own, so that it learns alone (the pooled
prior across tenants is test_asgi_prior.py's)."""

from __future__ import annotations

import functools
from collections import Counter

import httpx
import openai
import pytest
from support.servers import serve_asgi
from support.tenants import tenant
from support.upstream import FakeUpstream, Script, figures

from ace_mw import AceConfig, AceController
from ace_mw.integrations import AceSpecDec

FAST, PLAIN, SLOW = 0.003, 0.010, 0.025  # seconds before each streamed chunk: gaps far above timer noise
CHUNKS = tuple(f"tok{i} " for i in range(8))
GATE = {
    "speed_min_samples": 2,
    "speed_half_life": 2,
    "explore_fraction": 0.2,
    "explore_fraction_unmeasured": 0.5,
    # An arm left unexplored goes stale within seconds: how a loser that became the fastest is found.
    "speed_half_life_s": 1.0,
}
CONFIG = {
    "mode": "prod",
    "adapter": "ace",
    "gate": GATE,
    "keys": {
        "sk-slow-spec": {"speculative": {"algorithm": "eagle_2"}},
        "sk-fast-spec": {"speculative": {"algorithm": "ngram"}},
        "sk-two": {"candidates": [{"algorithm": "eagle_2"}, {"algorithm": "ngram"}]},
        "sk-flip": {"speculative": {"algorithm": "draft_model"}},
    },
}


@pytest.fixture(scope="module")
def loop():
    upstream = FakeUpstream(
        Script(
            chunks=CHUNKS,
            figures=figures(drafted=40, accepted=36, steps=8),  # alpha 0.9: the breaker never trips
            arm_delay_s={"plain": PLAIN, "eagle_2": SLOW, "ngram": FAST, "draft_model": SLOW},
        )
    )
    controller = AceController(AceConfig.from_dict(CONFIG))
    with serve_asgi(AceSpecDec(upstream.app, controller=controller)) as url:
        yield url, upstream, controller


@functools.cache
def client(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=30)


def run(url: str, key: str, n: int, start: int = 0) -> list[str]:
    """n streamed greedy requests, each its own conversation; the arm each one ran on."""
    arms = []
    for i in range(start, start + n):
        response = client(url, key).chat.completions.with_raw_response.create(
            model=key,
            messages=[{"role": "user", "content": "hi"}],
            temperature=0.0,
            stream=True,
            extra_headers={"x-ace-conversation-id": f"{key}-{i}"},
        )
        text = "".join(chunk.choices[0].delta.content or "" for chunk in response.parse() if chunk.choices)
        assert text == "".join(CHUNKS)
        arms.append(response.headers["x-ace-speculative-decoding-arm"])
    return arms


def settled_on(arms: list[str]) -> str:
    """The arm that served most of the last requests."""
    return Counter(arms[-12:]).most_common(1)[0][0]


def test_tenant_whose_speculation_is_slower_ends_on_plain_decoding(loop):
    url, _, controller = loop
    arms = run(url, "sk-slow-spec", 40)
    assert arms[0] == "eagle_2/k5"  # a new tenant starts speculating
    assert settled_on(arms) == "plain"
    estimates = controller.store.arm_views((tenant("sk-slow-spec"), "sk-slow-spec"), controller.config.gate, 0.0)
    assert estimates["plain"].tokens_per_s > 1.3 * estimates["eagle_2/k5"].tokens_per_s


def test_tenant_whose_speculation_is_faster_keeps_it(loop):
    url, _, _ = loop
    arms = run(url, "sk-fast-spec", 40)
    assert settled_on(arms) == "ngram/k5"
    assert arms.count("plain") >= 1  # plain was measured (explored), then left


def test_tenant_with_two_candidates_ends_on_the_faster_one(loop):
    url, _, _ = loop
    arms = run(url, "sk-two", 50)
    assert settled_on(arms) == "ngram/k5"
    assert {"plain", "eagle_2/k5", "ngram/k5"} <= set(arms)  # every arm was measured


def test_choice_follows_when_speeds_flip_mid_run(loop):
    url, upstream, _ = loop
    assert settled_on(run(url, "sk-flip", 40)) == "plain"  # draft_model is the slow arm
    upstream.script.arm_delay_s = {**upstream.script.arm_delay_s, "draft_model": FAST}
    try:
        after = run(url, "sk-flip", 80, start=40)
    finally:
        upstream.script.arm_delay_s = {**upstream.script.arm_delay_s, "draft_model": SLOW}
    # The slow arm is a clear loser, barely explored, until its evidence goes stale (a half-life of
    # 1 s here, 600 s by default); explored again, a few of its samples outweigh the old estimate
    # (half-life 2 samples), so within 50 requests it serves most of the traffic.
    switched = next((i for i in range(len(after) - 8) if after[i : i + 8].count("draft_model/k5") >= 6), None)
    assert switched is not None and switched <= 50, after
    assert settled_on(after) == "draft_model/k5"


def test_client_bytes_stay_exact_on_every_arm(loop):
    """With usage asked for by the client nothing is stripped: every byte is the upstream's."""
    url, upstream, _ = loop
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    seen = set()
    for i in range(30):
        headers = {"authorization": "Bearer sk-two", "x-ace-conversation-id": f"bytes-{i}"}
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, headers=headers, timeout=30) as response:
            received = b"".join(response.iter_raw())
            seen.add(response.headers["x-ace-speculative-decoding-arm"])
        assert received == b"".join(upstream.sent[-1])
    assert len(seen) >= 2  # the comparison covered more than one arm


def test_forced_usage_never_reaches_a_client_that_did_not_ask(loop):
    url, upstream, _ = loop
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 0.0, "stream": True}
    for i in range(10):
        headers = {"authorization": "Bearer sk-fast-spec", "x-ace-conversation-id": f"strip-{i}"}
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, headers=headers, timeout=30) as response:
            received = b"".join(response.iter_raw())
        assert upstream.received[-1].json["stream_options"] == {"include_usage": True}  # forced, every arm
        sent = [chunk for chunk in upstream.sent[-1] if b'"usage"' not in chunk]
        assert received == b"".join(sent)
