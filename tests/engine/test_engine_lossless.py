"""Speculative decoding changes speed, never output: greedy equality with transformers `generate`
and distributional equality with plain sampling, for every algorithm, drafting every step or
self-gated (plain and speculative steps mixed), on the real fixture (fp32 CPU).
"""

import json

import pytest
import torch
from support.engine_costs import ALTERNATING
from support.pairs import TEMPERATURE, TOP_K, exact_distribution, tv
from support.paths import MODELS
from support.stats import chi_square_p_value

from ace_mw.engine import Engine, SamplingParams, SpecParams
from ace_mw.engine.drafting.drafters import DraftTree
from ace_mw.engine.generation import collect

transformers = pytest.importorskip("transformers")

TARGET, DRAFT, EAGLE = MODELS / "ace-tiny-chat", MODELS / "ace-tiny-chat-draft", MODELS / "ace-tiny-chat-eagle"
EAGLE3 = MODELS / "ace-tiny-chat-eagle3"
HAS_EAGLE, HAS_EAGLE3 = (EAGLE / "config.json").exists(), (EAGLE3 / "config.json").exists()
N_PROMPTS, NEW_TOKENS = 10, 24
NEEDS_EAGLE = pytest.mark.skipif(not HAS_EAGLE, reason="no EAGLE head shipped")
NEEDS_EAGLE3 = pytest.mark.skipif(not HAS_EAGLE3, reason="no EAGLE-3 head shipped")
GREEDY_ALGORITHMS = [
    SpecParams("baseline"),
    SpecParams("ngram", num_speculative_tokens=10, self_gate=False),
    SpecParams("draft_model", num_speculative_tokens=4, self_gate=False),
    pytest.param(SpecParams("eagle", self_gate=False), marks=NEEDS_EAGLE),
    pytest.param(SpecParams("eagle_2", total_tokens=12, self_gate=False), marks=NEEDS_EAGLE),
    pytest.param(SpecParams("eagle_3", total_tokens=12, self_gate=False), marks=NEEDS_EAGLE3),
]
SELF_GATED = [
    SpecParams("ngram"),
    SpecParams("draft_model"),
    pytest.param(SpecParams("eagle"), marks=NEEDS_EAGLE),
    pytest.param(SpecParams("eagle_2"), marks=NEEDS_EAGLE),
    pytest.param(SpecParams("eagle_3"), marks=NEEDS_EAGLE3),
]


@pytest.fixture(scope="module")
def engine(one_torch_thread):
    # A forced cost table: self-gated requests mix plain and speculative steps, on any machine.
    heads = [h for h, shipped in ((EAGLE, HAS_EAGLE), (EAGLE3, HAS_EAGLE3)) if shipped]
    return Engine.from_pretrained(TARGET, draft=DRAFT, eagle=heads, costs=ALTERNATING, compile_decode=False)


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


@pytest.mark.parametrize("spec", SELF_GATED, ids=lambda s: s.algorithm)
def test_self_gated_greedy_output_equals_transformers_generate_while_mixing_plain_steps(
    engine, conversations, hf_greedy, spec
):
    results = [engine.generate(m, max_new_tokens=NEW_TOKENS, speculative=spec) for m in conversations]
    assert [r.token_ids for r in results] == hf_greedy
    assert any(0 < r.stats.plain_steps < r.stats.steps for r in results)  # the scenario really mixes


@pytest.mark.parametrize("spec", GREEDY_ALGORITHMS[1:3], ids=lambda s: s.algorithm)
def test_speculation_accepts_drafts_on_the_fixture(engine, conversations, spec):
    stats = [engine.generate(m, max_new_tokens=NEW_TOKENS, speculative=spec).stats for m in conversations[:4]]
    assert sum(s.accepted for s in stats) > 0
    assert all(s.steps < s.output_tokens for s in stats if s.accepted)


# --- sampling: the distribution of the two tokens after a fixed context --------------------------

CONTEXT = [{"role": "user", "content": "Write one word."}]
# A raw prompt that repeats itself: prompt lookup proposes what followed the first token before, and
# the target, sampled at T = 2 over its top 3, accepts it only sometimes.
NGRAM_PROMPT = "1, 2, 3, 1, 2, 3, 1, 2,"
TRIALS = 400
MIN_P_VALUE = 1e-3  # a correct implementation fails one run in a thousand (per seed and platform)


class SiblingsDrafter:
    """Proposes, once, the target's 2nd and 3rd likeliest next tokens as siblings (each with its own
    2nd and 3rd likeliest continuation below the first), deterministically (q None); nothing after.
    The likeliest token is reachable only through the residual left after both siblings are rejected."""

    taps = ()

    def __init__(self, engine):
        self.engine, self.tree = engine, None

    @torch.inference_mode()
    def ranked(self, ids):
        logits, _ = self.engine.model(torch.tensor([ids]), torch.arange(len(ids)), last_logits_only=True)
        return logits[0, -1].topk(3).indices.tolist()

    def reset(self, input_ids, hidden):
        ids = input_ids.tolist()
        first = self.ranked(ids)
        second = self.ranked(ids + [first[1]])
        self.tree = DraftTree(torch.tensor([first[1], first[2], second[1], second[2]]), torch.tensor([-1, -1, 0, 0]))

    def propose(self, plan):
        tree, self.tree = self.tree, None
        return tree.prefix(plan.tokens) if tree is not None else DraftTree.chain(torch.tensor([], dtype=torch.long))

    def accept(self, tokens, hidden):
        pass


CASES = {  # kind -> (prompt, what drafts: an algorithm, or the siblings drafter)
    "draft_model": (CONTEXT, SpecParams("draft_model", 2, self_gate=False)),
    "ngram": (NGRAM_PROMPT, SpecParams("ngram", 3, self_gate=False)),
    "tree": (CONTEXT, SpecParams("ngram", 2, self_gate=False)),
    "gated_ngram": (NGRAM_PROMPT, SpecParams("ngram", 2)),
}


def ending_at_eos(tokens, eos_ids):
    """The tokens up to the first eos, which stands for all of them: a request ends there."""
    for i, t in enumerate(tokens):
        if t in eos_ids:
            return (*tokens[:i], "eos")
    return tuple(tokens)


def sampled(engine, kind, trials, seed=0):
    """The first three tokens of ``trials`` seeded requests of four, so the step after the first
    verifies drafts (two at most) for the second and third, and whether the step after that drafts
    may depend on what the first accepted. Returns the counts of each outcome and the requests' stats."""
    prompt, spec = CASES[kind]
    counts, stats = {}, []
    for trial in range(trials):
        params = SamplingParams(max_new_tokens=4, temperature=TEMPERATURE, top_k=TOP_K, seed=seed * trials + trial)
        if kind == "tree":
            asked = engine.prepare(prompt, params, spec, {})
            out = collect(engine.one_row().decode(asked, SiblingsDrafter(engine)))
        else:
            out = engine.generate(prompt, params, spec)
        ids = out.token_ids[:3] if len(out.token_ids) >= 3 else [*out.token_ids, min(engine.eos_ids)]
        outcome = ending_at_eos(ids, engine.eos_ids)
        counts[outcome] = counts.get(outcome, 0) + 1
        stats.append(out.stats)
    return counts, stats


@pytest.fixture(scope="module")
def exact(engine):
    """kind -> the exact distribution of the first three tokens (up to an eos) under plain sampling."""
    out = {}
    for kind, (prompt, _) in CASES.items():
        out[kind] = {}
        for tokens, p in exact_distribution(engine, engine._encode(prompt), 3).items():
            outcome = ending_at_eos(tokens, engine.eos_ids)
            out[kind][outcome] = out[kind].get(outcome, 0.0) + p
    return out


@pytest.mark.parametrize("kind", ["draft_model", "ngram", "tree"])
def test_speculative_sampling_matches_plain_sampling_distribution(engine, exact, kind):
    """400 seeded three-token samples against the exact plain-sampling distribution (Pearson
    chi-square over the 27 outcomes, p >= 1e-3), with drafts both accepted and rejected: sampled
    drafts with their distributions (the draft model), deterministic chains (prompt lookup), and
    deterministic siblings that leave the likeliest token to the residual (the tree).

    Measured with seed 0 (p-value, total variation): correct code gives draft_model 0.37 / 0.089,
    ngram 0.93 / 0.073, tree 0.29 / 0.091 (self-gated ngram 0.53 / 0.101). Bugs planted by hand,
    each failing the cases it touches:
    - a rejected deterministic draft not zeroed (``accept_child`` continues from p instead of
      norm(p - onehot)): ngram p = 9e-31 / TV 0.32, tree p = 1e-14 / TV 0.25;
    - siblings not carrying the residual (each tried against the parent's original p): tree
      p = 3e-13 / TV 0.24;
    - the walk given the unshaped target (temperature and top-k forgotten): p = 0 for all three.
    """
    counts, stats = sampled(engine, kind, TRIALS)
    accepted, proposed = sum(s.accepted for s in stats), sum(s.proposed for s in stats)
    assert 0 < accepted < proposed  # the rule both accepted and rejected drafts
    assert chi_square_p_value(counts, exact[kind]) >= MIN_P_VALUE, (tv(counts, exact[kind]), counts, exact[kind])


def test_self_gated_sampling_matches_plain_sampling_distribution(engine, exact):
    """As above, with prompt lookup self-gated: whether the step after the first drafts, and how much,
    depends on what the first accepted, so some requests' third token comes from a plain step and
    others' from a draft."""
    counts, stats = sampled(engine, "gated_ngram", TRIALS)
    assert any(s.plain_steps for s in stats) and any(s.proposed for s in stats)
    assert 0 < sum(s.accepted for s in stats) < sum(s.proposed for s in stats)
    p_value = chi_square_p_value(counts, exact["gated_ngram"])
    assert p_value >= MIN_P_VALUE, (tv(counts, exact["gated_ngram"]), counts)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["draft_model", "ngram", "tree", "gated_ngram"])
def test_speculative_sampling_matches_plain_sampling_distribution_tightly(engine, exact, kind):
    counts, stats = sampled(engine, kind, trials=4000, seed=1)
    assert 0 < sum(s.accepted for s in stats) < sum(s.proposed for s in stats)
    assert chi_square_p_value(counts, exact[kind]) >= MIN_P_VALUE, (tv(counts, exact[kind]), counts, exact[kind])
    assert tv(counts, exact[kind]) < 0.05  # 27 outcomes: sampling noise alone is about 0.03 at 4000 trials
