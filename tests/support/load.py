"""A controller whose requests go to pools at load, driven through the real path (decide,
observe, answer): tests/core/test_load.py and test_shared_cores.py."""

from __future__ import annotations

import json

from ace_mw import AceConfig, AceController, RequestView
from support import tenants
from support.clock import Clock

POOLS = {"baseline": "http://b", "ngram": "http://n"}
NGRAM = "ngram/k4@ngram"


def controller(load_aware: bool = True, load_scope: str = "pool", clock: Clock | None = None) -> AceController:
    candidates = [{"algorithm": "ngram", "num_speculative_tokens": 4, "pool": "ngram"}]
    gate = {"speed_min_samples": 2, "explore_fraction": 0.0, "max_measured_per_s": 1000}
    config = {
        "mode": "prod",
        "adapter": "vllm",
        "pools": POOLS,
        "candidates": candidates,
        "gate": gate,
        "upstream": {"load_aware": load_aware, "load_scope": load_scope},
    }
    return AceController(AceConfig.from_dict(config), clock=clock or Clock(100.0))


VIEW = RequestView(
    "POST", "/v1/chat/completions", {"authorization": "Bearer sk-load"}, {"model": "m", "temperature": 0, "user": "u"}
)


def view(i: int) -> RequestView:
    """A request of conversation `i`: its sticky bucket (exploration's draw) is fixed by it."""
    body = {"model": "m", "temperature": 0, "user": f"conversation-{i}"}
    return RequestView("POST", "/v1/chat/completions", {"authorization": "Bearer sk-load"}, body)


def answer(controller: AceController, decision, rate: float, acceptance: float | None = None) -> None:
    """A non-streaming vLLM answer of 33 tokens decoded at `rate` tokens/s (with its drafts'
    `acceptance`, where it drafted)."""
    observer = controller.observe(decision)
    observer.start(200, "application/json")
    body = {"usage": {"completion_tokens": 33}, "metrics": {"generation_time_ms": 32 / rate * 1000}}
    if acceptance is not None:
        drafted = 40
        body["metrics"]["speculative_decoding"] = {
            "num_draft_tokens": drafted,
            "num_accepted_tokens": round(drafted * acceptance),
            "num_spec_steps": 10,
            "draft_acceptance_rate": round(drafted * acceptance) / drafted,
        }
    observer.feed(json.dumps(body).encode(), more_body=False)
    observer.finish()


def busy(ace: AceController, pool: str, requests: int) -> list[object]:
    """`requests` other requests in flight on `pool` (as if decided and not yet answered)."""
    tokens = [object() for _ in range(requests)]
    for token in tokens:
        ace._in_flight.start(pool, token)
    return tokens


def idle(ace: AceController, pool: str, tokens: list[object]) -> None:
    for token in tokens:
        ace._in_flight.end(pool, token)


def teach(ace: AceController, pools: str | tuple[str, ...], phases) -> None:
    """For each (others, rates): with `others` requests in flight on each of `pools`, 16 requests
    answered at their arm's rate, through the real path (decide, observe)."""
    pools = (pools,) if isinstance(pools, str) else pools
    for others, rates in phases:
        held = {pool: busy(ace, pool, others) for pool in pools}
        for i in range(16):
            decision = ace.decide(view(i))
            answer(ace, decision, rates[decision.arm])
        for pool, tokens in held.items():
            idle(ace, pool, tokens)


def tenant() -> str:
    return tenants.tenant("sk-load")


def row(ace: AceController) -> dict:
    return next(t for t in ace.status()["tenants"] if t["tenant"] == tenant())
