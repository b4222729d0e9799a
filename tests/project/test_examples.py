"""Each example runs with its one documented command (as a subprocess) and does what it says."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import grpc
import httpx
import openai
import pytest
from support.paths import ROOT
from support.servers import serve_asgi
from support.upstream import FakeUpstream, Script, figures

from ace_mw.integrations import generation_pb2 as pb
from ace_mw.integrations import generation_pb2_grpc


@contextmanager
def example(*args: str) -> Iterator[str]:
    """Run `python -m examples.<name> ...` from the repo root; yield the address it listens on."""
    process = subprocess.Popen(
        [sys.executable, "-m", *args], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        line = process.stdout.readline()
        if not line.startswith("listening on "):
            process.kill()
            raise AssertionError(f"example did not start: {line!r} {process.stderr.read()}")
        yield line.split()[-1]
    finally:
        process.terminate()
        process.wait(10)


@pytest.fixture(scope="module")
def gateway():
    speculative, baseline = (
        FakeUpstream(Script(figures=figures(10, 8, 4)), "speculative"),
        FakeUpstream(name="baseline"),
    )
    with serve_asgi(speculative.app) as spec_url, serve_asgi(baseline.app) as base_url:
        with example(
            "examples.gateway",
            "--port",
            "0",
            "--speculative-url",
            spec_url,
            "--speculative-runs",
            "eagle_2/k5",
            "--baseline-url",
            base_url,
        ) as url:
            yield url, speculative, baseline


def chat(url: str, **fields):
    client = openai.OpenAI(base_url=url + "/v1", api_key="sk-gw", max_retries=0, timeout=20)
    return client.chat.completions.with_raw_response.create(
        model="m", messages=[{"role": "user", "content": "hi"}], **fields
    )


def test_gateway_routes_applied_requests_to_the_speculative_pool(gateway):
    url, speculative, baseline = gateway
    raw = chat(url, temperature=0.0)
    assert raw.headers["x-upstream-name"] == "speculative"
    assert raw.headers["x-ace-speculative-decoding"] == "applied"
    assert raw.parse().choices[0].message.content == "Hello, world"


def test_gateway_routes_gated_requests_to_the_baseline_pool(gateway):
    url, _, _ = gateway
    raw = chat(url, temperature=1.5)
    assert (raw.headers["x-upstream-name"], raw.headers["x-ace-speculative-decoding"]) == ("baseline", "gated")


def test_gateway_streams_every_upstream_byte(gateway):
    url, speculative, _ = gateway
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=20) as response:
        received = b"".join(response.iter_raw())
    assert received == b"".join(speculative.sent[-1])


def test_gateway_takes_key_settings_from_a_config_file(tmp_path):
    config = tmp_path / "ace.toml"
    config.write_text('mode = "prod"\nadapter = "vllm"\n[keys.sk-quiet]\nmode = "off"\n')
    speculative, baseline = FakeUpstream(name="speculative"), FakeUpstream(name="baseline")
    with serve_asgi(speculative.app) as spec_url, serve_asgi(baseline.app) as base_url:
        with example(
            "examples.gateway",
            "--port",
            "0",
            "--config",
            str(config),
            "--speculative-url",
            spec_url,
            "--baseline-url",
            base_url,
        ) as url:
            client = openai.OpenAI(base_url=url + "/v1", api_key="sk-quiet", max_retries=0, timeout=20)
            raw = client.chat.completions.with_raw_response.create(
                model="m", messages=[{"role": "user", "content": "hi"}], temperature=0.0
            )
    assert (raw.headers["x-upstream-name"], raw.headers["x-ace-speculative-decoding"]) == ("baseline", "off")


def test_grpc_server_example_applies_speculation():
    with example("examples.grpc_server", "--port", "0") as target, grpc.insecure_channel(target) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        response, call = stub.Generate.with_call(
            pb.GenerateRequest(model="m", prompt="one two three four", temperature=0.0),
            metadata=[("authorization", "Bearer sk-1")],
        )
    assert response.text == "one two three four "
    assert response.speculative_decoding.num_spec_steps == 2
    assert dict(call.trailing_metadata())["x-ace-speculative-decoding"] == "applied"


def test_grpc_aio_server_example_streams():
    with example("examples.grpc_server", "--port", "0", "--aio") as target, grpc.insecure_channel(target) as channel:
        responses = list(
            generation_pb2_grpc.GenerationStub(channel).GenerateStream(
                pb.GenerateRequest(model="m", prompt="a b", temperature=0.0)
            )
        )
    assert [r.text for r in responses] == ["a ", "b "]
    assert responses[-1].speculative_decoding.num_draft_tokens == 5


def test_otel_console_example_prints_decision_attributes():
    done = subprocess.run(
        [sys.executable, "-m", "examples.otel_console"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert '"ace.spec_decode.decision": "applied"' in done.stdout
    assert '"ace.spec_decode.reason": "temperature"' in done.stdout
    assert '"ace.spec_decode.acceptance_rate": 0.4' in done.stdout


def test_gateway_routes_each_arm_to_its_named_pool_and_follows_the_file(tmp_path):
    """A [pools] table with a pool per arm: the candidate's requests reach its pool, hot ones the
    baseline; a saved change of the file moves the pool's URL without a restart."""
    lookup, other, baseline = (FakeUpstream(name=n) for n in ("lookup", "other", "baseline"))
    with serve_asgi(lookup.app) as lookup_url, serve_asgi(other.app) as other_url, serve_asgi(baseline.app) as base_url:
        config = tmp_path / "ace.toml"

        def save(lookup_at: str) -> None:
            aside = tmp_path / "ace.toml.new"
            aside.write_text(
                'mode = "prod"\nadapter = "llamacpp"\n[gate]\npolicy = "acceptance"\n'
                f'[pools]\nbaseline = "{base_url}"\nlookup = "{lookup_at}"\n'
                '[[candidates]]\nalgorithm = "ngram"\npool = "lookup"\n'
            )
            aside.replace(config)

        save(lookup_url)
        with example("examples.gateway", "--port", "0", "--config", str(config)) as url:
            assert chat(url, temperature=0.0).headers["x-upstream-name"] == "lookup"
            assert chat(url, temperature=1.0).headers["x-upstream-name"] == "baseline"
            save(other_url)
            deadline = time.monotonic() + 10
            while chat(url, temperature=0.0).headers["x-upstream-name"] != "other":
                assert time.monotonic() < deadline, "the saved pools never applied"
                time.sleep(0.2)
