"""Hot-path cost of the control plane: decide + inject per request (`AceController.begin`, the
path both integrations run: decision, injection, the body encoded back, the response's observer),
observe per SSE chunk.

Prints p50/p99 in microseconds against the targets of issue 2 (decide+inject p50 <= 20 us,
p99 <= 100 us; SSE observe <= 5 us per typical chunk) and, with a recording span, issue 40's
(p99 <= 15 us). Run: python benchmarks/hot_path.py
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from collections import deque
from collections.abc import Callable

from opentelemetry.sdk.trace import TracerProvider

from ace_mw import AceConfig, AceController, RequestView, hash_key
from ace_mw.integrations.json_body import BodyWriter

KEY = "sk-live-7f3a9c2e41d84b6a"


def chat_body() -> dict:
    """A typical ~2 KB streaming chat request."""
    turns = [
        {"role": "system", "content": "You are a concise assistant for a software team. " * 6},
        {"role": "user", "content": "Summarise the design of our rate limiter and list its failure modes. " * 8},
        {"role": "assistant", "content": "The limiter is a token bucket per tenant with a shared refill. " * 10},
        {"role": "user", "content": "Now write a Python function that checks a bucket. " * 3},
    ]
    return {
        "model": "llama-3-8b-instruct",
        "messages": turns,
        "temperature": 0.2,
        "top_p": 0.95,
        "max_tokens": 512,
        "stream": True,
        "user": "user-1842",
    }


def controller(tracer_provider=None) -> AceController:
    keys = {
        hash_key(f"sk-team-{i}"): {"mode": "prod", "speculative": {"num_speculative_tokens": 4}} for i in range(200)
    }
    keys[hash_key(KEY)] = {"mode": "prod"}
    config = AceConfig.from_dict(
        {
            "mode": "shadow",
            "adapter": "ace",
            "keys": keys,
            "speculative": {"algorithm": "eagle_2", "num_speculative_tokens": 5},
        }
    )
    return AceController(config, tracer_provider=tracer_provider)


def measure(step: Callable[[int], None], iterations: int) -> tuple[float, float]:
    """p50 and p99 of one call, in microseconds; after each, untimed, the oldest response's
    observer is finished once more than `IN_FLIGHT` are open (the response's own work)."""
    for i in range(min(2000, iterations)):  # warm-up
        step(i)
        finish_observers(IN_FLIGHT)
    samples = []
    clock = time.perf_counter_ns
    gc.disable()
    try:
        for i in range(iterations):
            start = clock()
            step(i)
            samples.append(clock() - start)
            finish_observers(IN_FLIGHT)
    finally:
        gc.enable()
    samples.sort()
    return samples[len(samples) // 2] / 1e3, samples[int(len(samples) * 0.99)] / 1e3


def decide_inject(ace: AceController, body: dict, headers: dict) -> Callable[[int], None]:
    """`AceController.begin`, the path both integrations run: decide, inject (the body written
    back as the ASGI middleware encodes it), and the response's observer, released at once."""
    outcome = ace.decide(RequestView("POST", "/v1/chat/completions", headers, body)).outcome
    print(f"  decide+inject with {sorted(headers)}: outcome {outcome!r}")
    raw = json.dumps(body).encode()

    def step(i: int) -> None:
        request = RequestView("POST", "/v1/chat/completions", headers, body, request_id=str(i))
        _, observer = ace.begin(request, BodyWriter(raw, body).write)
        if observer is not None:
            open_observers.append(observer)  # finished outside the timing (the response's work)

    return step


# Responses streaming at once: a server holds one observer per response in flight, not one per
# request it has ever begun (20,000 kept open, as this benchmark once did, timed the allocator
# growing its arenas as much as the decision).
IN_FLIGHT = 64
open_observers: deque = deque()


def finish_observers(keep: int = 0) -> None:
    while len(open_observers) > keep:
        open_observers.popleft().finish(error="benchmark")


def sse_chunks(count: int) -> list[bytes]:
    """vLLM-shaped stream chunks: one token each, a usage chunk with figures at the end."""

    def event(payload: dict) -> bytes:
        return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"

    base = {
        "id": "chatcmpl-8f1c2b",
        "object": "chat.completion.chunk",
        "created": 1764460000,
        "model": "llama-3-8b-instruct",
    }
    chunks = [
        event(
            {
                **base,
                "choices": [{"index": 0, "delta": {"content": f" token{i}"}, "logprobs": None, "finish_reason": None}],
            }
        )
        for i in range(count - 2)
    ]
    chunks.append(
        event(
            {
                **base,
                "choices": [],
                "usage": {"prompt_tokens": 480, "completion_tokens": count},
                "metrics": {
                    "speculative_decoding": {
                        "num_draft_tokens": 400,
                        "num_accepted_draft_tokens": 310,
                        "num_spec_steps": 80,
                    }
                },
            }
        )
    )
    chunks.append(b"data: [DONE]\n\n")
    return chunks


def observe_per_chunk(ace: AceController, body: dict, headers: dict, rounds: int) -> tuple[float, float, int]:
    """Per-chunk cost of feeding a whole stream through a fresh observer, `rounds` streams."""
    chunks = sse_chunks(256)
    request = RequestView("POST", "/v1/chat/completions", {**headers, "x-ace-skill-speculative-decoding": "prod"}, body)
    decision = ace.decide(request)
    injection = ace.inject(decision, body).injection
    samples = []
    clock = time.perf_counter_ns
    gc.disable()
    try:
        for _ in range(rounds):
            observer = ace.observe(decision, injection)
            observer.start(200, "text/event-stream")
            for chunk in chunks:
                start = clock()
                observer.feed(chunk)
                samples.append(clock() - start)
            observer.finish()
    finally:
        gc.enable()
    samples.sort()
    return samples[len(samples) // 2] / 1e3, samples[int(len(samples) * 0.99)] / 1e3, len(chunks[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--iterations", type=int, default=20_000)
    args = parser.parse_args()
    body = chat_body()
    headers = {"authorization": f"Bearer {KEY}", "content-type": "application/json"}
    print(f"request body: {len(json.dumps(body))} bytes; {args.iterations} iterations per row")
    rows = []
    ace = controller()
    rows.append(
        ("decide+inject, prod (no OTel SDK)", *measure(decide_inject(ace, body, headers), args.iterations), 20, 100)
    )
    finish_observers()
    shadow = {**headers, "x-ace-skill-speculative-decoding": "shadow"}
    rows.append(("decide+inject, shadow header", *measure(decide_inject(ace, body, shadow), args.iterations), 20, 100))
    finish_observers()
    sdk = TracerProvider()
    traced = controller(sdk)
    tracer = sdk.get_tracer("bench")
    with tracer.start_as_current_span("server"):
        rows.append(
            (
                "decide+inject, recording server span",
                *measure(decide_inject(traced, body, headers), args.iterations),
                20,
                15,
            )
        )
        finish_observers()
    p50, p99, size = observe_per_chunk(ace, body, headers, max(1, args.iterations // 256))
    rows.append((f"SSE observe per chunk (~{size} B)", p50, p99, 5, None))
    print(f"\n{'path':<42} {'p50 us':>8} {'p99 us':>8}   target")
    for name, p50, p99, t50, t99 in rows:
        ok = p50 <= t50 and (t99 is None or p99 <= t99)
        target = f"p50 <= {t50}" + (f", p99 <= {t99}" if t99 else "")
        print(f"{name:<42} {p50:>8.2f} {p99:>8.2f}   {target:<22} {'ok' if ok else 'MISSED'}")


if __name__ == "__main__":
    main()
