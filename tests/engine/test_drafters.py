"""The chain drafters: prompt lookup in isolation, and the loop's draft-model rows reusing their cache."""

import pytest
import torch
from support.engine_costs import ALTERNATING
from support.paths import MODELS

from ace_mw.engine import Engine, SpecParams
from ace_mw.engine.batching import BatchEngine
from ace_mw.engine.batching.sequence import BatchSequence
from ace_mw.engine.drafting.drafters import DraftTree, NgramDrafter, Plan
from ace_mw.engine.generation import Asked

DRAFT = MODELS / "ace-tiny-chat-draft"
NO_HIDDEN = torch.empty(0)


def ngram(history, **kwargs) -> NgramDrafter:
    drafter = NgramDrafter(**kwargs)
    drafter.reset(torch.tensor(history), NO_HIDDEN)
    return drafter


def chain(k: int) -> Plan:
    return Plan(k, k)


def test_ngram_proposes_what_followed_the_latest_match_of_the_last_three_tokens():
    tree = ngram([1, 2, 3, 9, 5, 1, 2, 3, 7, 8, 4, 1, 2, 3]).propose(chain(10))
    assert tree.tokens.tolist() == [7, 8, 4, 1, 2, 3]
    assert tree.parents.tolist() == [-1, 0, 1, 2, 3, 4] and tree.q is None


def test_ngram_falls_back_to_shorter_ngrams():
    assert ngram([5, 6, 7, 1, 4, 7]).propose(chain(10)).tokens.tolist() == [1, 4, 7]


def test_ngram_caps_the_proposal_at_the_plan():
    assert ngram([1, 2, 3, 4, 5, 6, 1]).propose(chain(3)).tokens.tolist() == [2, 3, 4]


def test_ngram_without_a_match_proposes_nothing():
    assert ngram([1, 2, 3, 4]).propose(chain(10)).tokens.numel() == 0


def test_ngram_learns_what_each_step_emitted():
    drafter = ngram([1, 2, 3])
    drafter.accept(torch.tensor([9, 1, 2]), NO_HIDDEN)
    assert drafter.propose(chain(10)).tokens.tolist() == [3, 9, 1, 2]


def brute_force_lookup(history: list[int], k: int, max_ngram: int = 3) -> list[int]:
    """What followed the latest earlier occurrence of the last n tokens (n = 3..1), by scanning."""
    for n in range(min(max_ngram, len(history) - 1), 0, -1):
        for start in range(len(history) - n - 1, -1, -1):
            if history[start : start + n] == history[-n:]:
                return history[start + n : start + n + k]
    return []


def test_the_ngram_index_proposes_what_a_scan_of_the_history_finds():
    generator = torch.Generator().manual_seed(0)
    for trial in range(200):
        history = torch.randint(
            0, 4 + trial % 8, (int(torch.randint(1, 60, (1,), generator=generator)),), generator=generator
        ).tolist()
        cut = len(history) // 2 + 1
        drafter = ngram(history[:cut])
        drafter.accept(torch.tensor(history[cut:], dtype=torch.long), NO_HIDDEN)
        assert drafter.propose(chain(5)).tokens.tolist() == brute_force_lookup(history, 5), history


def test_chain_tree_has_consecutive_parents():
    tree = DraftTree.chain(torch.tensor([4, 5, 6]))
    assert tree.parents.tolist() == [-1, 0, 1] and tree.is_chain
    assert not DraftTree(torch.tensor([4, 5]), torch.tensor([-1, -1])).is_chain
    assert tree.prefix(2).tokens.tolist() == [4, 5] and tree.prefix(2).is_chain


@pytest.fixture(scope="module")
def loop(one_torch_thread):
    engine = Engine.from_pretrained(MODELS / "ace-tiny-chat", draft=DRAFT, costs=ALTERNATING, compile_decode=False)
    return BatchEngine(engine, max_num_seqs=1)


@torch.inference_mode()
def greedy_continuation(model, ids, n):
    out = list(ids)
    for _ in range(n):
        logits, _ = model(torch.tensor([out]), torch.arange(len(out)), last_logits_only=True)
        out.append(int(logits[0, -1].argmax()))
    return out[len(ids) :]


@torch.inference_mode()
@pytest.mark.parametrize("plain", [[], [17, 42, 99]], ids=["drafting again", "after three plain steps"])
def test_a_draft_model_row_reuses_accepted_drafts_and_catches_up_on_the_rest(loop, plain):
    """The loop drafts a row's chain with the draft model in its row of the draft cache: after two
    accepted drafts (and plain steps) its next chain is still the model's own greedy continuation,
    having run only what its cache did not hold."""
    prompt = [1, 203, 6450, 4, 203, 2, 203]
    asked = loop.engine.prepare(loop.engine.tokenizer.decode(prompt), None, SpecParams("draft_model"), {})
    s = BatchSequence(
        Asked(prompt, asked.params, asked.sampler, asked.speculative, 64),
        drafter=None,
        by_model=True,
        max_draft=4,
        fixed=True,
        eos_ids=frozenset(),
        start=0.0,
    )
    s.row = 0
    loop.drafting.by_model([(s, 4)])
    first = s.proposal.tokens.tolist()
    assert first == greedy_continuation(loop.drafting.model, prompt, 4)
    s.begin(first[0])  # as if the prompt ran, its first token the first draft: the KV is the same
    loop.drafting.by_model([(s, 4)])
    drafts = s.proposal.tokens.tolist()
    emitted = drafts[:2] + [(drafts[2] + 1) % 8192]  # two accepted, then a different bonus token
    s.advance(emitted[:2], emitted[2], 4, True, 1.0)
    assert s.draft_cached == len(prompt) + 1 + 2  # what the draft model has really seen
    for token in plain:  # plain steps: nothing drafted, one token each
        s.advance([], token, 0, False, 1.0)
    loop.drafting.by_model([(s, 4)])
    expected = greedy_continuation(loop.drafting.model, prompt + [first[0]] + emitted + plain, 4)
    assert s.proposal.tokens.tolist() == expected
