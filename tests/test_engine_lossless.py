"""Speculative decoding changes speed, never output: greedy equality with transformers `generate`
and distributional equality with plain sampling, for every algorithm, on the real fixture (fp32 CPU).
"""

import json
from pathlib import Path

import pytest
import torch

from ace_mw.engine import Engine, SpecParams
from ace_mw.engine.drafters import DraftModelDrafter, DraftTree, NgramDrafter
from ace_mw.engine.engine import _Decode
from ace_mw.engine.sampling import Sampling

transformers = pytest.importorskip("transformers")

MODELS = Path(__file__).resolve().parents[1] / "models"
TARGET, DRAFT, EAGLE = MODELS / "ace-tiny-chat", MODELS / "ace-tiny-chat-draft", MODELS / "ace-tiny-chat-eagle"
HAS_EAGLE = (EAGLE / "config.json").exists()
N_PROMPTS, NEW_TOKENS = 10, 24
GREEDY_ALGORITHMS = [
    SpecParams("baseline"),
    SpecParams("ngram", num_speculative_tokens=10),
    SpecParams("draft_model", num_speculative_tokens=4),
    pytest.param(SpecParams("eagle"), marks=pytest.mark.skipif(not HAS_EAGLE, reason="no EAGLE head shipped")),
    pytest.param(
        SpecParams("eagle_2", total_tokens=12), marks=pytest.mark.skipif(not HAS_EAGLE, reason="no EAGLE head shipped")
    ),
]


@pytest.fixture(scope="module")
def engine(one_torch_thread):
    return Engine.from_pretrained(TARGET, draft=DRAFT, eagle=EAGLE if HAS_EAGLE else None)


@pytest.fixture(scope="module")
def conversations():
    data = json.loads((MODELS / "chat_eval.json").read_text())
    return [[{"role": "user", "content": c["turns"][0][1][:400]}] for c in data[:N_PROMPTS]]


@pytest.fixture(scope="module")
def hf_greedy(engine, conversations):
    """transformers' own greedy continuation of each conversation (eos stripped)."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32).eval()
    out = []
    with torch.inference_mode():
        for messages in conversations:
            ids = torch.tensor([engine._encode(messages)])
            new = hf.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)[0, ids.shape[1] :].tolist()
            out.append([t for t in new if t not in engine.eos_ids])
    return out


@pytest.mark.parametrize("spec", GREEDY_ALGORITHMS, ids=lambda s: s.algorithm)
def test_greedy_output_equals_transformers_generate(engine, conversations, hf_greedy, spec):
    ours = [engine.generate(m, max_new_tokens=NEW_TOKENS, speculative=spec).token_ids for m in conversations]
    assert ours == hf_greedy


@pytest.mark.parametrize("spec", GREEDY_ALGORITHMS[1:3], ids=lambda s: s.algorithm)
def test_speculation_accepts_drafts_on_the_fixture(engine, conversations, spec):
    stats = [engine.generate(m, max_new_tokens=NEW_TOKENS, speculative=spec).stats for m in conversations[:4]]
    assert sum(s.accepted for s in stats) > 0
    assert all(s.steps < s.output_tokens for s in stats if s.accepted)


# --- sampling: the distribution of the two tokens after a fixed context --------------------------

CONTEXT = [{"role": "user", "content": "Write one word."}]
TEMPERATURE, TOP_K = 2.0, 3


class FixedTreeDrafter:
    """A deterministic (q None) two-level tree on the first step, nothing afterwards."""

    def __init__(self, tokens, parents):
        self.tree = DraftTree(torch.tensor(tokens), torch.tensor(parents))
        self.used = False

    def reset(self, input_ids, hidden):
        self.used = False

    def propose(self):
        tree = self.tree if not self.used else DraftTree.chain(torch.tensor([], dtype=torch.long))
        self.used = True
        return tree

    def accept(self, tokens, hidden):
        pass


@torch.inference_mode()
def exact_pair_distribution(engine, ids):
    """P(t1, t2 | ids) under top-k sampling, by enumeration: the reference plain sampling targets."""
    model, shape = engine.model, Sampling(TEMPERATURE, top_k=TOP_K).probs
    n = len(ids)
    logits, _ = model(torch.tensor([ids]), torch.arange(n), last_logits_only=True)
    p1 = shape(logits[0, -1])
    joint = {}
    for t1 in p1.nonzero().flatten().tolist():
        logits, _ = model(torch.tensor([[t1]]), torch.tensor([n]))
        p2 = shape(logits[0, -1])
        for t2 in p2.nonzero().flatten().tolist():
            joint[(t1, t2)] = float(p1[t1] * p2[t2])
    return joint


@torch.inference_mode()
def sampled_pairs(engine, prompt, make_drafter, trials, seed=0):
    """Emit two tokens after ``prompt`` ``trials`` times, reusing one prefill (steps never touch it)."""
    sampling = Sampling(TEMPERATURE, top_k=TOP_K, generator=torch.Generator().manual_seed(seed))
    counts = {}
    root = prompt[-1]
    _, hidden = engine.model(torch.tensor([prompt[:-1]]), torch.arange(len(prompt) - 1))
    for _ in range(trials):
        drafter = make_drafter(sampling)
        decode = _Decode(engine, prompt[:-1], sampling, drafter, 0.0)
        drafter.reset(torch.tensor(prompt), hidden[0])
        emitted, cur_len = [], len(prompt) - 1
        while len(emitted) < 2:
            step = decode._step(emitted[-1] if emitted else root, cur_len)
            cur_len += len(step)
            emitted += step
        counts[tuple(emitted[:2])] = counts.get(tuple(emitted[:2]), 0) + 1
    return counts


def tv(counts, exact):
    total = sum(counts.values())
    keys = set(counts) | set(exact)
    return 0.5 * sum(abs(counts.get(k, 0) / total - exact.get(k, 0.0)) for k in keys)


def drafter_factories(engine, prompt):
    with torch.inference_mode():
        logits, _ = engine.model(torch.tensor([prompt]), torch.arange(len(prompt)), last_logits_only=True)
    top = logits[0, -1].topk(3).indices.tolist()
    return {
        "draft_model": lambda s: DraftModelDrafter(engine.draft, 2, s),
        "ngram": lambda s: NgramDrafter(3),
        "tree": lambda s: FixedTreeDrafter([top[1], top[0], top[2], top[0]], [-1, -1, -1, 1]),
    }


@pytest.fixture(scope="module")
def sampling_setup(engine):
    # The context ends with the token plain sampling would most likely emit first (the root).
    ids = engine._encode(CONTEXT)
    with torch.inference_mode():
        logits, _ = engine.model(torch.tensor([ids]), torch.arange(len(ids)), last_logits_only=True)
    prompt = ids + [int(logits[0, -1].argmax())]
    return prompt, exact_pair_distribution(engine, prompt), drafter_factories(engine, prompt)


@pytest.mark.parametrize("kind", ["draft_model", "tree"])
def test_speculative_sampling_matches_plain_sampling_distribution(engine, sampling_setup, kind):
    prompt, exact, factories = sampling_setup
    # 9 outcomes, 400 trials: TV noise about 0.04-0.06; sampling the tree from the unshaped target
    # (temperature/top-k forgotten in the walk) lands near 0.24.
    assert tv(sampled_pairs(engine, prompt, factories[kind], trials=400), exact) < 0.12


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["draft_model", "ngram", "tree"])
def test_speculative_sampling_matches_plain_sampling_distribution_tightly(engine, sampling_setup, kind):
    prompt, exact, factories = sampling_setup
    assert tv(sampled_pairs(engine, prompt, factories[kind], trials=4000, seed=1), exact) < 0.04
