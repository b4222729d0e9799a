"""The main demo: the bundled model served in-process, with the ace-mw middleware deciding per request.

    python examples/demo.py

It loads `models/ace-tiny-chat` (with its EAGLE head and draft model) into the in-process engine,
puts `AceSpecDec` in front of the engine's OpenAI-compatible app, serves it with uvicorn on
loopback and drives it with the real `openai` client: greedy requests get speculation injected,
a hot request is gated by temperature, a header switches one request off or to shadow, and a key
configured for the draft model (or prompt lookup) gets that algorithm. The table shows what the middleware decided
(response headers), what the engine reported (acceptance) and the speed, and checks that greedy
speculative output equals the plain output token for token.
"""

from __future__ import annotations

import argparse
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import openai
import uvicorn

from ace_mw import AceConfig
from ace_mw.engine import Engine
from ace_mw.engine.bundled import exit_if_missing
from ace_mw.engine.server import create_app
from ace_mw.integrations import AceSpecDec

MODELS = Path(__file__).resolve().parent.parent / "models"
PROMPT = "Write a Python function that returns the n-th Fibonacci number, with a docstring."
HEADER = "X-ACE-Skill-Speculative-Decoding"

CONFIG = {
    "mode": "prod",
    "adapter": "ace",  # the in-process engine honours per-request speculative body fields
    "speculative": {"algorithm": "eagle_2", "num_speculative_tokens": 5},
    "keys": {
        "sk-demo-team-a": {},
        "sk-demo-team-b": {"speculative": {"algorithm": "draft_model", "num_speculative_tokens": 4}},
        "sk-demo-team-c": {"speculative": {"algorithm": "ngram"}},
    },
}


@dataclass
class Case:
    label: str
    key: str
    temperature: float
    header: str | None = None
    stream: bool = False


CASES = [
    Case("plain (header off)", "sk-demo-team-a", 0.0, header="off"),
    Case("team A, greedy", "sk-demo-team-a", 0.0),
    Case("team A, greedy, streamed", "sk-demo-team-a", 0.0, stream=True),
    Case("team B, greedy (draft model)", "sk-demo-team-b", 0.0),
    Case("team C, greedy (prompt lookup)", "sk-demo-team-c", 0.0),
    Case("team A, T=0.9", "sk-demo-team-a", 0.9),
    Case("team A, shadow header", "sk-demo-team-a", 0.0, header="shadow"),
]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def serve(app, port: int) -> uvicorn.Server:
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    return server


def run_case(base_url: str, case: Case, max_tokens: int) -> dict:
    client = openai.OpenAI(base_url=base_url, api_key=case.key)
    headers = {HEADER: case.header} if case.header else None
    request = {
        "model": "ace-tiny-chat",
        "messages": [{"role": "user", "content": PROMPT}],
        "temperature": case.temperature,
        "max_tokens": max_tokens,
        "seed": 7,
        "extra_headers": headers,
    }
    started = time.perf_counter()
    if case.stream:
        # Asking for usage keeps the final chunk, where the engine reports acceptance; without it
        # the middleware removes the usage chunk it forced.
        raw = client.chat.completions.with_raw_response.create(
            stream=True, stream_options={"include_usage": True}, **request
        )
        text, metrics, first = "", None, None
        for chunk in raw.parse():
            if chunk.choices and chunk.choices[0].delta.content:
                first = first or time.perf_counter()
                text += chunk.choices[0].delta.content
            metrics = (chunk.model_extra or {}).get("metrics") or metrics
    else:
        raw = client.chat.completions.with_raw_response.create(**request)
        completion = raw.parse()
        text, metrics, first = (
            completion.choices[0].message.content,
            (completion.model_extra or {}).get("metrics"),
            None,
        )
    elapsed = time.perf_counter() - started
    spec = (metrics or {}).get("speculative_decoding") or {}
    return {
        "case": case,
        "decision": raw.headers.get("x-ace-speculative-decoding", "-"),
        "reason": raw.headers.get("x-ace-speculative-decoding-reason", "-"),
        "text": text,
        "alpha": spec.get("draft_acceptance_rate"),
        "tau": spec.get("mean_acceptance_length"),
        "elapsed": elapsed,
        "ttft": (first - started) if first else None,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-tokens", type=int, default=96)
    args = parser.parse_args(argv)

    exit_if_missing(MODELS / "ace-tiny-chat", "the bundled target model")
    exit_if_missing(MODELS / "ace-tiny-chat-draft", "the bundled draft model")
    eagle = MODELS / "ace-tiny-chat-eagle"
    print(f"loading {MODELS / 'ace-tiny-chat'} (EAGLE head: {'yes' if eagle.exists() else 'no'}) ...")
    engine = Engine.from_pretrained(
        MODELS / "ace-tiny-chat", eagle=eagle if eagle.exists() else None, draft=MODELS / "ace-tiny-chat-draft"
    )
    # The demo shows what the middleware decides per request, so the engine drafts what it is told
    # every step (self_gate=False); left to itself it would draft only what pays on this machine.
    app = AceSpecDec(create_app(engine, self_gate=False), config=AceConfig.from_dict(CONFIG))
    port = free_port()
    server = serve(app, port)
    base_url = f"http://127.0.0.1:{port}/v1"
    print(f"serving on {base_url} with AceSpecDec in front\n")
    try:
        run_case(base_url, CASES[0], 8)  # warm-up
        rows = [run_case(base_url, case, args.max_tokens) for case in CASES]
    finally:
        server.should_exit = True

    plain = rows[0]
    print(
        f"{'request':30} {'decision':9} {'reason':12} {'alpha':>6} {'tau':>5} {'time s':>7} {'vs plain':>8}  same text"
    )
    for row in rows:
        case = row["case"]
        same = "yes" if row["text"] == plain["text"] else ("n/a" if case.temperature > 0 else "NO")
        alpha = f"{row['alpha']:.2f}" if row["alpha"] is not None else "-"
        tau = f"{row['tau']:.2f}" if row["tau"] is not None else "-"
        print(
            f"{case.label:30} {row['decision']:9} {row['reason']:12} {alpha:>6} {tau:>5} "
            f"{row['elapsed']:7.2f} {plain['elapsed'] / row['elapsed']:7.2f}x  {same}"
        )
    print(f"\ngreedy answer ({len(plain['text'])} chars):\n{plain['text']}")


if __name__ == "__main__":
    main()
