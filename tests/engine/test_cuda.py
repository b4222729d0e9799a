"""On a GPU: the engine's loop stays lossless for every algorithm.

Skipped without CUDA (CI has none); `benchmarks/gpu_check.sh` runs it on a GPU machine. A GPU runs
other GEMM kernels for other shapes, so even fp32 is exact only up to rounding: outputs must match
plain decoding on the same device except after ties, FP32_TIE in fp32 (GPU fp32
GEMMs differ by about 1e-6 relative between shapes, so 1e-3 logits is a wide margin on logits
below 30) and near_ties.BF16_NEAR_TIE in bf16 (the same reasoning as on the CPU).
"""

import json

import pytest
import torch
from support.near_ties import BF16_NEAR_TIE, assert_equal_up_to_ties
from support.paths import MODELS
from support.tiny_target import assert_distributed_as, exact_joint, sampled_counts, tiny_engine

from ace_mw.engine import Engine, SpecParams
from ace_mw.engine.model.transformer import Transformer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

TARGET = MODELS / "ace-tiny-chat"
FP32_TIE = 1e-3
N_PROMPTS, NEW_TOKENS = 10, 48
SPECS = [
    SpecParams("baseline", self_gate=False),
    SpecParams("ngram", self_gate=False),
    SpecParams("draft_model", self_gate=False),
    SpecParams("eagle", self_gate=False),
    SpecParams("eagle_2", self_gate=False),
    SpecParams("eagle_3", self_gate=False),
]


def heads(tmp_path_factory) -> list:
    from ace_mw.engine.drafting.eagle3_head import Eagle3Head

    head3 = MODELS / "ace-tiny-chat-eagle3"
    if not (head3 / "config.json").exists():
        head3 = tmp_path_factory.mktemp("head3")
        torch.manual_seed(0)
        config = json.loads((TARGET / "config.json").read_text())
        Eagle3Head.for_target(config, torch.arange(0, 8192, 4), taps=(1, 3, 5)).save_pretrained(head3)
    return [MODELS / "ace-tiny-chat-eagle", head3]


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def setup(request, tmp_path_factory):
    """(engine, plain-decoding baselines, fp32 reference, prompts, tolerance) per dtype."""
    dtype = request.param
    kwargs = {"eagle": heads(tmp_path_factory), "draft": MODELS / "ace-tiny-chat-draft", "device": "cuda"}
    engine = Engine.from_pretrained(TARGET, dtype=dtype, max_context=1024, **kwargs)
    data = json.loads((MODELS / "chat_eval.json").read_text())
    prompts = [engine._encode([{"role": "user", "content": c["turns"][0][1][:400]}]) for c in data[:N_PROMPTS]]
    baseline = [engine.generate(engine.tokenizer.decode(p), max_new_tokens=NEW_TOKENS).token_ids for p in prompts]
    reference = Transformer.from_pretrained(TARGET, device="cuda")
    reference.setup_cache(1200)
    tolerance, min_identical = (FP32_TIE, 0.9) if dtype == torch.float32 else (BF16_NEAR_TIE, 0.5)
    return engine, baseline, reference, prompts, tolerance, min_identical


@pytest.mark.parametrize("spec", SPECS[1:], ids=lambda s: s.algorithm)
def test_speculative_output_equals_plain_decoding_up_to_ties(setup, spec):
    engine, baseline, reference, prompts, tolerance, min_identical = setup
    assert_equal_up_to_ties(engine, reference, prompts, baseline, spec, NEW_TOKENS, tolerance, min_identical)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_sampling_on_a_gpu_follows_the_target_distribution(dtype):
    engine = tiny_engine(dtype, device="cuda")
    spec = SpecParams("eagle_3", num_speculative_tokens=3, total_tokens=8, self_gate=False)
    counts, accepted, _, _ = sampled_counts(engine, spec, temperature=1.0, top_p=1.0, trials=1000)
    assert accepted >= 300
    assert_distributed_as(counts, exact_joint(engine, 1.0, 1.0))
