"""The compiled one-token step (engine/model/compiled.py) on the real fixture, fp32 CPU.

Tolerance: inductor's generated kernels sum in another order than the eager ones (on the fixture the
logits differ by about 1e-5), so the compiled engine's greedy output may leave the eager engine's
only where the eager run's top two logits are within FP32_NEAR_TIE of each other, as for batching.
"""

import json
import os
import subprocess
import sys
import tempfile

import httpx
import openai
import pytest
import torch
from support.engine_costs import ALTERNATING
from support.near_ties import assert_equal_up_to_ties
from support.paths import MODELS
from support.ports import free_port
from support.servers import wait_for

from ace_mw.engine import Engine, SpecParams
from ace_mw.engine.model.step import Step
from ace_mw.engine.server import app

TARGET = MODELS / "ace-tiny-chat"
FP32_NEAR_TIE = 1e-3  # 100x the measured compiled-vs-eager logit error
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def eager(one_torch_thread):
    return Engine.from_pretrained(TARGET, costs=ALTERNATING)


@pytest.fixture(scope="module")
def compiled(one_torch_thread):
    return Engine.from_pretrained(TARGET, costs=ALTERNATING, steps="compiled")


@pytest.fixture(scope="module")
def prompts(eager):
    data = json.loads((MODELS / "chat_eval.json").read_text())
    return [eager.tokenizer.encode(c["turns"][0][1][:300]) for c in data[:10]]


def graphs_compiled() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def test_compiled_step_gives_the_eager_logits(eager, compiled):
    ids = torch.randint(0, eager.model.config.vocab_size, (1, 48), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        for engine in (eager, compiled):
            engine.model(ids[:, :40], Step.span(0, 40, engine.device), last_logits_only=True)
        for position, q in [(40, 1), (41, 1), (42, 4), (42, 2), (42, 1), (43, 5)]:  # a chain rewrites its slots
            tokens, at = ids[:, position : position + q], Step.span(position, q, eager.device)
            want, want_hidden = eager.step_model(tokens, at)
            got, got_hidden = compiled.step_model(tokens, at)
            torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
            torch.testing.assert_close(got_hidden, want_hidden, atol=1e-4, rtol=0)


@pytest.mark.parametrize("spec", [None, SpecParams(algorithm="ngram")], ids=["baseline", "ngram"])
def test_decoding_runs_the_compiled_step_with_no_recompiles(compiled, prompts, spec):
    """Plain steps, and prompt lookup's chains of every length, after the warm-up's graphs."""
    before = graphs_compiled()
    calls = 0
    step = compiled.step_model.compiled

    def counting(*args):
        nonlocal calls
        calls += 1
        return step(*args)

    compiled.step_model.compiled = counting
    try:
        for prompt in prompts[:2]:  # different lengths: the attended length is dynamic
            text = compiled.tokenizer.decode(prompt)
            out = compiled.generate(text, max_new_tokens=NEW_TOKENS, speculative=spec)
            assert len(out.token_ids) > 1
    finally:
        compiled.step_model.compiled = step
    assert calls >= 2 * (NEW_TOKENS // 4)  # every step after the prefill
    assert graphs_compiled() == before


@pytest.mark.parametrize("spec", [None, SpecParams(algorithm="ngram")], ids=["baseline", "ngram"])
def test_greedy_output_equals_the_eager_engines_up_to_near_ties(eager, compiled, prompts, spec):
    """With prompt lookup the verify passes are compiled chains, the plain steps between them too."""
    baseline = [eager.generate(eager.tokenizer.decode(p), max_new_tokens=NEW_TOKENS).token_ids for p in prompts]
    assert_equal_up_to_ties(compiled, eager.model, prompts, baseline, spec, NEW_TOKENS, FP32_NEAR_TIE, 0.9)


def test_the_planner_prices_compiled_steps_by_their_measured_ratio(compiled):
    step = compiled.step_model
    assert set(step.timed) == {1, 8} and all(ratio > 0 for ratio in step.timed.values())
    want = {q: ms * step.ratio(q) for q, ms in ALTERNATING.verify.as_dict().items()}
    assert compiled.costs.verify.as_dict() == want
    assert step.ratio(2) == step.timed[1] and step.ratio(6) == step.timed[8] and step.ratio(64) == 1.0


def test_with_verify_scaled_scales_only_the_verify_curve():
    costs = ALTERNATING.with_verify_scaled(lambda q: 0.5 if q == 1 else 1.0)
    assert costs.verify(1) == ALTERNATING.verify(1) / 2 and costs.verify(8) == ALTERNATING.verify(8)
    assert costs.draft_model is ALTERNATING.draft_model and costs.lookup_ms == ALTERNATING.lookup_ms


def test_an_unknown_way_to_run_steps_is_refused_before_anything_is_measured(eager):
    with pytest.raises(ValueError, match="auto, eager, static, compiled"):
        Engine(eager.model, eager.tokenizer, steps="graphs")


def test_the_server_refuses_a_compiled_step_with_batching(capsys):
    with pytest.raises(SystemExit):
        app.main(["--target", str(TARGET), "--compile-decode", "--max-num-seqs", "4"])
    assert "--max-num-seqs 1" in capsys.readouterr().err


def test_the_server_serves_with_its_decode_step_compiled(compiled, prompts):
    """``--compile-decode --max-num-seqs 1`` from the command line: it says it compiles, and answers
    what the compiled engine in this process answers (the same generated kernels, one thread)."""
    port = free_port()
    command = [sys.executable, "-m", "ace_mw.engine.server", "--target", str(TARGET), "--port", str(port)]
    command += ["--max-num-seqs", "1", "--compile-decode"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    with tempfile.TemporaryFile() as log:
        process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            url = f"http://127.0.0.1:{port}"
            wait_for(lambda: _healthy(url) or process.poll() is not None, timeout=600, what="the server to start")
            assert process.poll() is None, "the server exited"
            client = openai.OpenAI(base_url=url + "/v1", api_key="sk-test", max_retries=0, timeout=120)
            text = compiled.tokenizer.decode(prompts[4])
            answer = client.completions.create(model=TARGET.name, prompt=text, max_tokens=NEW_TOKENS, temperature=0.0)
            assert answer.choices[0].text == compiled.generate(text, max_new_tokens=NEW_TOKENS).text
        finally:
            process.terminate()
            process.wait(timeout=30)
        log.seek(0)
        assert b"compiling the one-token decode step" in log.read()


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def test_without_a_cxx_compiler_the_server_says_so_in_one_line(tmp_path):
    """An empty inductor cache and no compiler: the server exits with one line naming the flag."""
    command = [sys.executable, "-m", "ace_mw.engine.server", "--target", str(TARGET)]
    command += ["--max-num-seqs", "1", "--compile-decode", "--port", str(free_port())]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CXX": str(tmp_path / "no-such-c++")}
    env["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path / "inductor")
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert "cannot compile the decode step" in last and "C++ compiler" in last and "--compile-decode" in last
