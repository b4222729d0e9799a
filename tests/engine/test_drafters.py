"""The chain drafters in isolation: prompt lookup and the draft model's cache reuse."""

import pytest
import torch
from support.paths import MODELS

from ace_mw.engine.drafting.drafters import DraftModelDrafter, DraftTree, NgramDrafter, Plan
from ace_mw.engine.drafting.sampling import Sampling
from ace_mw.engine.model.transformer import Transformer

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


def test_ngram_history_grows_past_its_initial_capacity():
    drafter = ngram([1, 2, 3], capacity=4)
    drafter.accept(torch.tensor([9, 1, 2]), NO_HIDDEN)
    assert drafter.propose(chain(10)).tokens.tolist() == [3, 9, 1, 2]


def test_chain_tree_has_consecutive_parents():
    tree = DraftTree.chain(torch.tensor([4, 5, 6]))
    assert tree.parents.tolist() == [-1, 0, 1] and tree.is_chain
    assert not DraftTree(torch.tensor([4, 5]), torch.tensor([-1, -1])).is_chain
    assert tree.prefix(2).tokens.tolist() == [4, 5] and tree.prefix(2).is_chain


@pytest.fixture(scope="module")
def draft_model():
    model = Transformer.from_pretrained(DRAFT)
    model.setup_cache(128)
    return model


@torch.inference_mode()
def greedy_continuation(model, ids, n):
    out = list(ids)
    for _ in range(n):
        logits, _ = model(torch.tensor([out]), torch.arange(len(out)), last_logits_only=True)
        out.append(int(logits[0, -1].argmax()))
    return out[len(ids) :]


@torch.inference_mode()
def test_draft_model_greedy_chain_is_its_own_greedy_continuation(draft_model):
    drafter = DraftModelDrafter(draft_model, Sampling())
    prompt = [1, 203, 6450, 4, 203, 2, 203]
    drafter.reset(torch.tensor(prompt), NO_HIDDEN)
    assert drafter.propose(chain(4)).tokens.tolist() == greedy_continuation(draft_model, prompt, 4)


@torch.inference_mode()
@pytest.mark.parametrize("plain", [[], [17, 42, 99]], ids=["drafting again", "after three plain steps"])
def test_draft_model_reuses_accepted_drafts_and_catches_up_on_the_rest(draft_model, plain):
    drafter = DraftModelDrafter(draft_model, Sampling())
    prompt = [1, 203, 6450, 4, 203, 2, 203]
    drafter.reset(torch.tensor(prompt), NO_HIDDEN)
    first = drafter.propose(chain(4)).tokens.tolist()
    emitted = first[:2] + [(first[2] + 1) % 8192]  # two accepted, then a different bonus token
    drafter.accept(torch.tensor(emitted), NO_HIDDEN)
    for token in plain:  # plain steps: nothing proposed, one token each
        drafter.accept(torch.tensor([token]), NO_HIDDEN)
    assert drafter.cached == len(prompt) + 2  # what the draft model has really seen
    expected = greedy_continuation(draft_model, prompt + emitted + plain, 4)
    assert drafter.propose(chain(4)).tokens.tolist() == expected


@torch.inference_mode()
def test_draft_model_sampling_returns_the_distributions_it_drew_from(draft_model):
    sampling = Sampling(1.0, top_k=5, generator=torch.Generator().manual_seed(0))
    drafter = DraftModelDrafter(draft_model, sampling)
    drafter.reset(torch.tensor([1, 203, 6450, 4, 203, 2, 203]), NO_HIDDEN)
    tree = drafter.propose(chain(3))
    assert tree.q.shape == (3, 8192)
    assert all(int((row > 0).sum()) == 5 for row in tree.q)
    assert all(float(tree.q[i, t]) > 0 for i, t in enumerate(tree.tokens.tolist()))
