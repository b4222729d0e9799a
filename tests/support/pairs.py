"""The exact distribution of two sampled tokens, which speculative sampling must reproduce."""

from __future__ import annotations

import torch

from ace_mw.engine.drafting.sampling import Sampling

TEMPERATURE, TOP_K = 2.0, 3  # a flat top 3: drafts are accepted only sometimes


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


def tv(counts, exact):
    total = sum(counts.values())
    keys = set(counts) | set(exact)
    return 0.5 * sum(abs(counts.get(k, 0) / total - exact.get(k, 0.0)) for k in keys)
