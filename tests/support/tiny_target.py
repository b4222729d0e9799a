"""A tiny target (6-token vocabulary) with EAGLE and EAGLE-3 heads, and the exact distribution of its
plain sampling: drafts hit often at every depth, so speculative sampling rules are really exercised."""

from __future__ import annotations

import copy
import dataclasses
from types import SimpleNamespace

import torch

from ace_mw.engine import Engine
from ace_mw.engine.drafting.eagle3_head import Eagle3Head
from ace_mw.engine.drafting.eagle_head import EagleHead
from ace_mw.engine.drafting.sampling import logits_to_probs
from ace_mw.engine.model.transformer import ModelConfig, Transformer
from ace_mw.engine.planning.cost import CostCurve

from .engine_costs import ALTERNATING
from .stats import chi_square_p_value, tensor_cells

VOCAB = 6
PROMPT = [1, 4, 2, 2, 5]
CONFIG = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": VOCAB,
    "max_position_embeddings": 256,
}


class DigitTokenizer:
    """Test double: prompt strings are digit strings, one token per digit."""

    eos_token_id = None

    def __call__(self, text, add_special_tokens=False):
        return SimpleNamespace(input_ids=[int(c) for c in text])

    def decode(self, ids, skip_special_tokens=True):
        return "".join(str(i) for i in ids)


# ALTERNATING with head passes a hundredth of a step: a fresh EAGLE row drafts, as a fresh lookup row
# does, and one rejected draft makes its next step plain.
CHEAP_HEADS = dataclasses.replace(
    ALTERNATING, head_level=CostCurve({1: 0.1, 16: 0.15, 64: 0.4}), head_commit=CostCurve({1: 0.05, 64: 0.2})
)


def tiny_engine(dtype=torch.float32, device="cpu") -> Engine:
    """The same seeded target and heads whatever the dtype and device; what a self-gated request
    drafts follows the forced cost table, not the machine."""
    config = ModelConfig.from_hf(CONFIG)
    torch.manual_seed(1)
    target = Transformer(config).eval()
    with torch.no_grad():  # a peakier target than the random init, so several tokens matter
        target.lm_head.weight.mul_(3.0)
    head = EagleHead.for_target(config).eval()
    # An EAGLE-3 head that can draft 5 of the 6 tokens: token 4 must still come out at its probability.
    head3 = Eagle3Head.for_target(CONFIG, torch.tensor([0, 1, 2, 3, 5]), taps=(0, 1, 1)).eval()
    target, head, head3 = (copy.deepcopy(m).to(device=device, dtype=dtype) for m in (target, head, head3))
    return Engine(
        target,
        DigitTokenizer(),
        eagle=head,
        eagle3=head3,
        max_context=64,
        costs=CHEAP_HEADS,
    )


def exact_joint(engine: Engine, temperature: float, top_p: float) -> torch.Tensor:
    """p(t1, t2, t3) of plain sampling, by enumerating every prefix with full forwards."""
    model = engine.model
    device = engine.device

    def probs(ids):
        logits, _ = model(torch.tensor([ids], device=device), torch.arange(len(ids), device=device))
        return logits_to_probs(logits[0, -1], temperature, top_p).cpu()

    joint = torch.zeros(VOCAB, VOCAB, VOCAB)
    with torch.inference_mode():
        p1 = probs(PROMPT)
        for a in range(VOCAB):
            p2 = probs(PROMPT + [a])
            for b in range(VOCAB):
                joint[a, b] = p1[a] * p2[b] * probs(PROMPT + [a, b])
    return joint


def sampled_counts(
    engine: Engine, spec, temperature: float, top_p: float, trials: int
) -> tuple[torch.Tensor, int, int, int]:
    """Counts of the first three sampled tokens over seeded trials of six (so the step after the
    first may verify a tree of four, drafts for the second and the third among them), accepted
    drafts, trials accepting two or more, and trials that mixed plain and speculative steps (the
    budget's last step included)."""
    counts = torch.zeros(VOCAB, VOCAB, VOCAB)
    accepted = deep = mixed = 0
    prompt = "".join(map(str, PROMPT))
    for seed in range(trials):
        out = engine.generate(
            prompt, max_new_tokens=6, temperature=temperature, top_p=top_p, seed=seed, speculative=spec
        )
        counts[tuple(out.token_ids[:3])] += 1
        accepted += out.stats.accepted
        deep += out.stats.accepted >= 2
        mixed += 0 < out.stats.plain_steps < out.stats.steps
    return counts, accepted, deep, mixed


def assert_distributed_as(counts: torch.Tensor, joint: torch.Tensor) -> None:
    """The joint and each position's marginal (where a biased rule shows first) pass chi-square."""
    assert chi_square_p_value(*tensor_cells(counts, joint)) > 1e-3
    for dim in (0, 1, 2):
        others = tuple(d for d in range(3) if d != dim)
        assert chi_square_p_value(*tensor_cells(counts.sum(others), joint.sum(others))) > 1e-3
