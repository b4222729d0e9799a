"""EAGLE, EAGLE-2 and EAGLE-3 are lossless for ANY head: greedy output equals plain decoding token for
token, and sampled output is distributed exactly as plain sampling of the target."""

import copy
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from ace_mw.engine import Engine, SpecParams
from ace_mw.engine.eagle import EagleHead
from ace_mw.engine.eagle3 import Eagle3Head
from ace_mw.engine.model import ModelConfig, Transformer
from ace_mw.engine.sampling import logits_to_probs

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MODELS = Path(__file__).resolve().parent.parent / "models"
TRAINED_HEAD = MODELS / "ace-tiny-chat-eagle"
TRAINED_HEAD3 = MODELS / "ace-tiny-chat-eagle3"
SPECS = {
    "eagle_default_tree": SpecParams("eagle"),
    "eagle_custom_tree": SpecParams("eagle", tree_choices=[[0], [1], [0, 0], [0, 1], [0, 0, 0], [1, 0]]),
    "eagle_2_small_budget": SpecParams("eagle_2", num_speculative_tokens=4, total_tokens=6),
    "eagle_2_large_budget": SpecParams("eagle_2", num_speculative_tokens=6, total_tokens=40),
    "eagle_3_small_budget": SpecParams("eagle_3", num_speculative_tokens=4, total_tokens=6),
    "eagle_3_large_budget": SpecParams("eagle_3", num_speculative_tokens=6, total_tokens=40),
}


def eval_prompts(n: int) -> list[list[dict]]:
    conversations = json.loads((MODELS / "chat_eval.json").read_text())
    return [[{"role": "user", "content": c["turns"][0][1][:400]}] for c in conversations[:n]]


@pytest.fixture(scope="module")
def random_head_engine(tmp_path_factory):
    target_config = json.loads((MODELS / "ace-tiny-chat" / "config.json").read_text())
    torch.manual_seed(0)
    head_dir, head3_dir = tmp_path_factory.mktemp("random-head"), tmp_path_factory.mktemp("random-head3")
    EagleHead.for_target(target_config).save_pretrained(head_dir)
    draft_ids = torch.randperm(target_config["vocab_size"])[:2048]
    Eagle3Head.for_target(target_config, draft_ids.sort().values, taps=(1, 3, 5)).save_pretrained(head3_dir)
    return Engine.from_pretrained(MODELS / "ace-tiny-chat", eagle=[head_dir, head3_dir], max_context=1024)


@pytest.fixture(scope="module")
def prompts():
    return eval_prompts(2)


@pytest.fixture(scope="module")
def plain_ids(random_head_engine, prompts):
    """Plain greedy decoding of the target (no head involved), computed once."""
    return [random_head_engine.generate(m, max_new_tokens=32).token_ids for m in prompts]


@pytest.mark.parametrize("name", SPECS)
def test_greedy_output_with_a_random_head_equals_plain_decoding(random_head_engine, prompts, plain_ids, name):
    fast = [random_head_engine.generate(m, max_new_tokens=32, speculative=SPECS[name]) for m in prompts]
    assert [f.token_ids for f in fast] == plain_ids
    assert all(f.stats.drafted > 0 for f in fast)


@pytest.fixture(scope="module")
def trained_head_engine():
    heads = [h for h in (TRAINED_HEAD, TRAINED_HEAD3) if h.exists()]
    if not heads:
        pytest.skip("no trained head is in models/ yet")
    return Engine.from_pretrained(MODELS / "ace-tiny-chat", eagle=heads, max_context=1024)


@pytest.mark.parametrize("name", SPECS)
def test_greedy_output_with_the_trained_head_equals_plain_decoding_and_accepts_drafts(
    trained_head_engine, prompts, plain_ids, name
):
    if (trained_head_engine.eagle3 if SPECS[name].algorithm == "eagle_3" else trained_head_engine.eagle) is None:
        pytest.skip(f"no trained head for {SPECS[name].algorithm} in models/ yet")
    fast = [trained_head_engine.generate(m, max_new_tokens=32, speculative=SPECS[name]) for m in prompts]
    assert [f.token_ids for f in fast] == plain_ids
    assert sum(f.stats.accepted for f in fast) > 0


# --- sampling: a tiny vocabulary makes the drafts hit often, at every depth ------------------------

VOCAB = 6
PROMPT = [1, 4, 2, 2, 5]


class DigitTokenizer:
    """Test double: prompt strings are digit strings, one token per digit."""

    eos_token_id = None

    def __call__(self, text, add_special_tokens=False):
        return SimpleNamespace(input_ids=[int(c) for c in text])

    def decode(self, ids, skip_special_tokens=True):
        return "".join(str(i) for i in ids)


@pytest.fixture(scope="module")
def tiny_engines():
    """The same tiny target and heads in fp32 and in bf16."""
    tiny = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": VOCAB,
        "max_position_embeddings": 256,
    }
    config = ModelConfig.from_hf(tiny)
    torch.manual_seed(1)
    target = Transformer(config).eval()
    with torch.no_grad():  # a peakier target than the random init, so several tokens matter
        target.lm_head.weight.mul_(3.0)
    head = EagleHead.for_target(config).eval()
    # An EAGLE-3 head that can draft 5 of the 6 tokens: token 4 must still come out at its probability.
    head3 = Eagle3Head.for_target(tiny, torch.tensor([0, 1, 2, 3, 5]), taps=(0, 1, 1)).eval()
    engines = {}
    for dtype in (torch.float32, torch.bfloat16):
        parts = [copy.deepcopy(m).to(dtype) for m in (target, head, head3)]
        engines[dtype] = Engine(parts[0], DigitTokenizer(), eagle=parts[1], eagle3=parts[2], max_context=64)
    return engines


def exact_joint(engine: Engine, temperature: float, top_p: float) -> torch.Tensor:
    """p(t1, t2, t3) of plain sampling, by enumerating every prefix with full forwards."""
    model = engine.model

    def probs(ids):
        logits, _ = model(torch.tensor([ids]), torch.arange(len(ids)))
        return logits_to_probs(logits[0, -1], temperature, top_p)

    joint = torch.zeros(VOCAB, VOCAB, VOCAB)
    with torch.inference_mode():
        p1 = probs(PROMPT)
        for a in range(VOCAB):
            p2 = probs(PROMPT + [a])
            for b in range(VOCAB):
                joint[a, b] = p1[a] * p2[b] * probs(PROMPT + [a, b])
    return joint


def chi_square_p_value(counts: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """Pearson chi-square over the cells expected to hold at least 5 samples (the rest pooled)."""
    n = counts.sum()
    expected = expected_probs * n
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum().view(1)]).double()
    exp = torch.cat([expected[big], expected[~big].sum().view(1)]).double()
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    dof = int(keep.sum()) - 1
    return float(
        torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64))
    )


SAMPLED = {
    "eagle": SpecParams("eagle", tree_choices=[[0], [1], [2], [0, 0], [0, 1], [1, 0]]),
    "eagle_2": SpecParams("eagle_2", num_speculative_tokens=3, total_tokens=8),
    "eagle_3": SpecParams("eagle_3", num_speculative_tokens=3, total_tokens=8),
}


# bf16: the reference is plain sampling of the same bf16 target; one case runs by default, the rest are slow.
@pytest.mark.parametrize(
    "name,dtype",
    [(n, torch.float32) for n in SAMPLED]
    + [pytest.param(n, torch.bfloat16, marks=[] if n == "eagle_3" else pytest.mark.slow) for n in SAMPLED],
    ids=lambda v: str(v).removeprefix("torch."),
)
# Floors on accepted drafts, and on trials accepting two in one step, so the rule is really exercised
# (a peaky T=0.7 target accepts a random head's drafts less often).
@pytest.mark.parametrize("temperature,top_p,min_accepted,min_deep", [(1.0, 1.0, 400, 10), (0.7, 0.9, 100, 0)])
def test_sampled_first_three_tokens_follow_the_target_distribution(
    tiny_engines, name, dtype, temperature, top_p, min_accepted, min_deep
):
    tiny_engine, spec = tiny_engines[dtype], SAMPLED[name]
    trials = 1000
    joint = exact_joint(tiny_engine, temperature, top_p)
    counts = torch.zeros(VOCAB, VOCAB, VOCAB)
    accepted = deep = 0
    prompt = "".join(map(str, PROMPT))
    for seed in range(trials):
        out = tiny_engine.generate(
            prompt, max_new_tokens=3, temperature=temperature, top_p=top_p, seed=seed, speculative=spec
        )
        counts[tuple(out.token_ids)] += 1
        accepted += out.stats.accepted
        deep += out.stats.accepted >= 2
    assert accepted >= min_accepted and deep >= min_deep
    assert chi_square_p_value(counts.flatten(), joint.flatten()) > 1e-3
    for dim in (0, 1, 2):  # each position's marginal, where a biased rule shows first
        others = tuple(d for d in range(3) if d != dim)
        assert chi_square_p_value(counts.sum(others), joint.sum(others)) > 1e-3
