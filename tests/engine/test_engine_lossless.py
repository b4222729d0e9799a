"""Speculative decoding changes speed, never output: greedy equality with transformers `generate`
and distributional equality with plain sampling, for every algorithm, drafting every step or
self-gated (plain and speculative steps mixed), on the real fixture (fp32 CPU).
"""

import json

import pytest
import torch
from support.engine_costs import ALTERNATING
from support.pairs import TEMPERATURE, TOP_K, exact_pair_distribution, tv
from support.paths import MODELS
from support.stats import chi_square_p_value

from ace_mw.engine import Engine, SpecParams
from ace_mw.engine.drafting.drafters import PLAIN, DraftModelDrafter, DraftTree, NgramDrafter
from ace_mw.engine.drafting.sampling import Sampling
from ace_mw.engine.engine import _Decode
from ace_mw.engine.planning.planner import DraftPlanner, draft_model_menu, lookup_menu

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
    return Engine.from_pretrained(TARGET, draft=DRAFT, eagle=heads, costs=ALTERNATING)


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
# A raw prompt that repeats itself: prompt lookup proposes ", 1," after the root " 3" (the target's
# likeliest next token), and the target, sampled at T = 2 over its top 3, accepts it only sometimes.
NGRAM_PROMPT = "1, 2, 3, 1, 2, 3, 1, 2,"
TRIALS = 400
MIN_P_VALUE = 1e-3  # a correct implementation fails one run in a thousand (per seed and platform)


class FixedTreeDrafter:
    """A deterministic (q None) tree on the first step, nothing afterwards."""

    cheap = False

    def __init__(self, tokens, parents):
        self.tree = DraftTree(torch.tensor(tokens), torch.tensor(parents))
        self.used = False

    def reset(self, input_ids, hidden):
        self.used = False

    def propose(self, plan):
        tree = self.tree if not self.used else DraftTree.chain(torch.tensor([], dtype=torch.long))
        self.used = True
        return tree

    def accept(self, tokens, hidden):
        pass


@torch.inference_mode()
def sampled_pairs(engine, prompt, make_drafter, menu, trials, seed=0, gate=False):
    """Emit two tokens after ``prompt`` ``trials`` times, reusing one prefill (steps never touch it).
    Returns the counts of each pair and the draft tokens (proposed, accepted) over all trials.

    The planner runs ``menu``'s largest plan every step, or (``gate``) only what pays under the
    forced cost table: then whether the second token is drafted depends on how the first step went.
    """
    sampling = Sampling(TEMPERATURE, top_k=TOP_K, generator=torch.Generator().manual_seed(seed))
    counts, proposed, accepted = {}, 0, 0
    root = prompt[-1]
    _, hidden = engine.model(torch.tensor([prompt[:-1]]), torch.arange(len(prompt) - 1))
    for _ in range(trials):
        drafter = make_drafter(sampling)
        decode = _Decode(engine, prompt[:-1], sampling, drafter, 0.0, DraftPlanner(menu, gate=gate))
        drafter.reset(torch.tensor(prompt), hidden[0])
        emitted, cur_len = [], len(prompt) - 1
        while len(emitted) < 2:
            step = decode._step(emitted[-1] if emitted else root, cur_len)
            cur_len += len(step)
            emitted += step
        counts[tuple(emitted[:2])] = counts.get(tuple(emitted[:2]), 0) + 1
        proposed, accepted = proposed + decode.counts.proposed, accepted + decode.counts.accepted
    return counts, proposed, accepted


@pytest.fixture(scope="module")
def sampling_cases(engine):
    """kind -> (prompt ending with its root, exact pair distribution, drafter factory, plan menu).

    Each prompt ends with the token plain sampling would most likely emit first (the root). The
    tree drafts the 2nd and 3rd likeliest first tokens as siblings, and under the 2nd the 2nd and
    3rd likeliest continuations, so the likeliest token at both levels is reachable only through
    the residual left after rejected siblings (see the sampling test)."""

    @torch.inference_mode()
    def with_root(ids):
        logits, _ = engine.model(torch.tensor([ids]), torch.arange(len(ids)), last_logits_only=True)
        return ids + [int(logits[0, -1].argmax())]

    @torch.inference_mode()
    def ranked(ids):
        logits, _ = engine.model(torch.tensor([ids]), torch.arange(len(ids)), last_logits_only=True)
        return logits[0, -1].topk(3).indices.tolist()

    chat = with_root(engine._encode(CONTEXT))
    first = ranked(chat)
    second = ranked(chat + [first[1]])
    tree = [first[1], first[2], second[1], second[2]], [-1, -1, 0, 0]
    ngram = with_root(engine._encode(NGRAM_PROMPT))
    chains = draft_model_menu(2, ALTERNATING)  # the draft model drafts 2, prompt lookup proposes 3
    cases = {
        "draft_model": (chat, lambda s: DraftModelDrafter(engine.drafts_with("draft_model"), s), chains),
        "ngram": (ngram, lambda s: NgramDrafter(), lookup_menu(3, ALTERNATING)),
        "tree": (chat, lambda s: FixedTreeDrafter(*tree), chains),  # its own tree, whatever the plan
    }
    return {
        kind: (prompt, exact_pair_distribution(engine, prompt), make, menu)
        for kind, (prompt, make, menu) in cases.items()
    }


@pytest.mark.parametrize("kind", ["draft_model", "ngram", "tree"])
def test_speculative_sampling_matches_plain_sampling_distribution(engine, sampling_cases, kind):
    """400 seeded two-token samples against the exact plain-sampling distribution (Pearson
    chi-square over the 9 pairs, p >= 1e-3), with drafts both accepted and rejected.

    Measured with seed 0 (p-value, total variation): correct code gives draft_model 0.53 / 0.045,
    ngram 0.14 / 0.057, tree 0.32 / 0.047. Bugs planted by hand, each failing this test:
    - a rejected deterministic draft not zeroed (``accept_child`` continues from p instead of
      norm(p - onehot)): tree p = 9e-37 / TV 0.25 (exact TV 0.23), ngram p = 7e-48 / TV 0.37;
    - siblings not carrying the residual (each sibling tried against the parent's original p):
      tree p = 1e-33 / TV 0.26 (exact TV 0.23);
    - the walk given the unshaped target (temperature and top-k forgotten): p = 0 for all three.
    The tree leaves the likeliest token of each level undrafted, so either tree bug moves about a
    quarter of the mass; the previous tree, which drafted all three first tokens, moved only 0.09
    (TV 0.100 and 0.103 over 400 trials, against noise of 0.04-0.06).
    """
    prompt, exact, make_drafter, menu = sampling_cases[kind]
    counts, proposed, accepted = sampled_pairs(engine, prompt, make_drafter, menu, trials=TRIALS)
    assert 0 < accepted < proposed  # the rule both accepted and rejected drafts
    assert chi_square_p_value(counts, exact) >= MIN_P_VALUE, (tv(counts, exact), counts, exact)


def test_self_gated_sampling_matches_plain_sampling_distribution(engine, sampling_cases):
    """As above, with the draft model self-gated: the first step drafts, and after a rejected
    draft the second token comes from a plain step, so what is drafted depends on what was sampled."""
    prompt, exact, make_drafter, menu = sampling_cases["draft_model"]
    planner = DraftPlanner(menu)
    first = planner.choose()
    planner.observe(DraftTree.chain(torch.tensor([1, 2])), [3])
    planner.record(first, 1)
    assert first != PLAIN and planner.choose() == PLAIN
    counts, proposed, accepted = sampled_pairs(engine, prompt, make_drafter, menu, trials=TRIALS, gate=True)
    assert 0 < accepted < proposed
    assert chi_square_p_value(counts, exact) >= MIN_P_VALUE, (tv(counts, exact), counts, exact)


@pytest.mark.slow
@pytest.mark.parametrize(
    "kind, gate",
    [("draft_model", False), ("ngram", False), ("tree", False), ("draft_model", True), ("ngram", True)],
)
def test_speculative_sampling_matches_plain_sampling_distribution_tightly(engine, sampling_cases, kind, gate):
    prompt, exact, make_drafter, menu = sampling_cases[kind]
    counts, proposed, accepted = sampled_pairs(engine, prompt, make_drafter, menu, trials=4000, seed=1, gate=gate)
    assert 0 < accepted < proposed
    assert chi_square_p_value(counts, exact) >= MIN_P_VALUE, (tv(counts, exact), counts, exact)
    assert tv(counts, exact) < 0.04
