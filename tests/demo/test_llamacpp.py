"""AceSpecDec in front of real llama.cpp servers (llama-server built from the pinned sdist by
`python -m ace_mw.demo.llamacpp build`; .ci/run builds it): a plain pool, a prompt-lookup pool and
a draft-model pool of the bundled model, on free loopback ports, driven with the real `openai`
client. The bytes reach the client as the server sent them, acceptance and decode speed are read
exactly as the server reports them, the breaker trips on the draft model's real low acceptance, and
the speed gate ends each tenant on the pool that is really fastest for its traffic.

Outside CI a machine without the binary skips these, saying how to get it; on CI they must run."""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
from support.recording import Recording
from support.servers import serve_asgi

from ace_mw import AceConfig, AceController
from ace_mw.integrations import AceSpecDec

llamacpp = pytest.importorskip("ace_mw.demo.llamacpp")
pytest.importorskip("torch")  # the GGUF converter loads the weights with it

MODEL = "ace-tiny-chat"
REPETITIVE = (
    "Repeat this list exactly, twice: alpha beta gamma delta epsilon, alpha beta gamma delta epsilon, "
    "alpha beta gamma delta epsilon."
)
OPEN = "Tell me about the history of tea in a few sentences."


@pytest.fixture(scope="module")
def pools() -> Iterator[dict[str, str]]:
    if llamacpp.server_binary() is None:
        if os.environ.get("CI"):
            pytest.fail(f"llama-server is missing on CI: .ci/run builds it ({llamacpp.HOW_TO_GET})")
        pytest.skip(f"llama-server is not built here: {llamacpp.HOW_TO_GET}")
    with llamacpp.pools(llamacpp.bundled_specs()) as servers:
        yield {name: server.url for name, server in servers.items()}


def served(pools: dict[str, str], config: dict) -> tuple[Recording, AceController]:
    controller = AceController(AceConfig.from_dict({"adapter": "llamacpp", "pools": pools, **config}))
    return Recording(pools), controller


def client(url: str, key: str = "sk-llama") -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=60)


def chat(url: str, text: str, key: str = "sk-llama", **fields):
    return client(url, key).chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": text}], temperature=0.0, max_tokens=32, **fields
    )


def tenant(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def row(controller: AceController, key: str) -> dict:
    return next(t for t in controller.status(1000)["tenants"] if t["tenant"] == tenant(key))


DRAFT_ONLY = {
    "mode": "prod",
    "gate": {"policy": "acceptance"},
    "candidates": [{"algorithm": "draft_model", "pool": "draft"}],
}


def test_the_client_gets_every_byte_the_server_sent_streamed_or_not(pools):
    recording, controller = served(pools, DRAFT_ONLY)
    with serve_asgi(AceSpecDec(recording, controller=controller)) as url:
        answer = chat(url, OPEN)
        with httpx.stream(
            "POST",
            url + "/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": OPEN}], "temperature": 0, "stream": True},
            headers={"authorization": "Bearer sk-llama"},
            timeout=60,
        ) as response:
            streamed = b"".join(response.iter_raw())
    assert answer.http_response.content == recording.received[0]
    assert streamed == recording.received[1] and streamed.endswith(b"data: [DONE]\n\n")
    assert answer.headers["x-ace-speculative-decoding-arm"] == "draft_model/k5@draft"


def test_acceptance_and_decode_speed_are_read_as_the_server_reports_them(pools):
    recording, controller = served(pools, {**DRAFT_ONLY, "gate": {"policy": "speed", "explore_fraction": 0.0}})
    with serve_asgi(AceSpecDec(recording, controller=controller)) as url:
        answer = json.loads(chat(url, OPEN).http_response.content)
    timings = answer["timings"]
    state = row(controller, "sk-llama")
    assert state["breaker"]["rolling_alpha"] == pytest.approx(timings["draft_n_accepted"] / timings["draft_n"])
    (arm,) = [a for a in state["arms"] if a["arm"] == "draft_model/k5@draft"]
    assert arm["tokens_per_s"] == pytest.approx(timings["predicted_per_second"], rel=1e-9)
    assert arm["pool"] == "draft"


def test_the_breaker_trips_on_the_draft_models_real_low_acceptance(pools):
    """The 3.6 M draft model agrees with the target on well under half of chat tokens: below the
    0.55 floor, the breaker opens and the tenant is sent to the plain pool."""
    config = {**DRAFT_ONLY, "gate": {"policy": "acceptance", "min_samples": 3, "cooldown_s": 600}}
    recording, controller = served(pools, config)
    with serve_asgi(AceSpecDec(recording, controller=controller)) as url:
        answers = [chat(url, f"{OPEN} ({i})") for i in range(3)]
        after = chat(url, OPEN)
    assert [a.headers["x-ace-speculative-decoding-reason"] for a in answers] == ["ok"] * 3
    timings = [json.loads(a.http_response.content)["timings"] for a in answers]
    assert max(t["draft_n_accepted"] / t["draft_n"] for t in timings) < 0.55  # what the server reported
    assert row(controller, "sk-llama")["breaker"]["state"] == "open"
    assert after.headers["x-ace-speculative-decoding-reason"] == "breaker_open"
    assert "draft_n" not in json.loads(after.http_response.content)["timings"]  # served by the plain pool


def direct_speed(url: str, text: str) -> float:
    """The server's own decode speed for `text`, asked directly (no middleware)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "temperature": 0, "max_tokens": 32}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=60).json()["timings"]["predicted_per_second"]


def test_the_speed_gate_ends_each_tenant_on_its_fastest_real_pool(pools):
    """Two tenants, one whose prompts repeat (prompt lookup may pay), one with open questions;
    both may run plain, prompt lookup or the draft model. After a few requests each runs on a pool
    that is fastest for its own traffic, as measured directly against the servers in the same
    rounds as the loop learned in (so a machine whose load changes, as when the suite runs on two
    workers, slows both alike), and never on the draft model's (slower here)."""
    candidates = [{"algorithm": "ngram", "pool": "ngram"}, {"algorithm": "draft_model", "pool": "draft"}]
    gate = {"policy": "speed", "speed_min_samples": 2, "explore_fraction": 0.1, "explore_fraction_unmeasured": 1.0}
    config = {"mode": "prod", "candidates": candidates, "gate": gate}
    recording, controller = served(pools, config)
    traffic = {"sk-repeats": REPETITIVE, "sk-open": OPEN}
    labels = {"baseline": "plain", "ngram": "ngram/k5@ngram", "draft": "draft_model/k5@draft"}
    direct: dict[str, dict[str, list[float]]] = {key: {label: [] for label in labels.values()} for key in traffic}
    with serve_asgi(AceSpecDec(recording, controller=controller)) as url:
        for round_ in range(14):
            for key, text in traffic.items():
                chat(url, text, key=key)
                if round_ >= 2:  # the rounds whose samples the loop's choice rests on
                    for name, pool_url in pools.items():
                        direct[key][labels[name]].append(direct_speed(pool_url, text))
    for key in traffic:
        speed = {label: statistics.median(found) for label, found in direct[key].items()}
        fastest = max(speed, key=speed.get)
        chosen = row(controller, key)["chosen_arm"]
        assert speed[labels["draft"]] < speed[fastest] and chosen != labels["draft"], (key, speed)
        # the fastest, or one within 15 % of it: two pools that close are one speed on this machine
        assert speed[chosen] >= 0.85 * speed[fastest], (key, chosen, speed)


def test_each_pool_says_what_it_is_on_the_status_page(pools):
    """/props, asked off the request path: this build ignores a per-request speculative.n_max."""
    _, controller = served(pools, DRAFT_ONLY)
    controller.start()
    try:
        deadline = time.monotonic() + 20
        while not all(p["probed"] for p in controller.status()["pools"].values()):
            assert time.monotonic() < deadline, controller.status()["pools"]
            time.sleep(0.05)
        report = controller.status()["pools"]
    finally:
        controller.close()
    for name, url in pools.items():
        assert report[name]["url"] == url and report[name]["error"] is None
        assert report[name]["facts"]["honours_n_max"] is False
        assert report[name]["facts"]["build"] == f"b1-{llamacpp.LLAMA_CPP_COMMIT}"


def test_the_demo_runs_its_workload_against_real_pools_it_starts(pools, tmp_path):
    """`ace-mw demo --engine llamacpp`: adaptive against each static pool and always-off, with the
    per-tenant oracle in the report."""
    done = subprocess.run(
        [sys.executable, "-m", "ace_mw.cli", "demo", "--engine", "llamacpp", "--requests", "6", "--max-tokens", "12"]
        + ["--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "adaptive:" in done.stdout and "always-ngram" in done.stdout and "always-off" in done.stdout
    report = (tmp_path / "report.md").read_text()
    assert "| always-draft |" in report and "against the per-tenant oracle" in report
    assert "llama.cpp llama-server 0c1e570 pools" in report


def test_the_demo_without_llama_server_says_how_to_build_it(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "ace_mw.cli", "demo", "--engine", "llamacpp", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "ACE_MW_LLAMA_SERVER": str(tmp_path / "missing")},
    )
    assert done.returncode == 2
    (line,) = done.stderr.strip().splitlines()
    assert "python -m ace_mw.demo.llamacpp build" in line
