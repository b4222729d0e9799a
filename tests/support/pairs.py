"""The exact distribution of the first sampled tokens, which speculative sampling must reproduce."""

from __future__ import annotations

import torch

from ace_mw.engine.drafting.sampling import Sampling

TEMPERATURE, TOP_K = 2.0, 3  # a flat top 3: drafts are accepted only sometimes


@torch.inference_mode()
def exact_distribution(engine, ids, n=2):
    """P(t1, ..., tn | ids) under top-k sampling, by enumeration: the reference plain sampling targets."""
    model, shape = engine.model, Sampling(TEMPERATURE, top_k=TOP_K).probs

    def extend(prefix, cached, p_prefix):
        logits, _ = model(torch.tensor([prefix[cached:]]), torch.arange(cached, len(prefix)), last_logits_only=True)
        p = shape(logits[0, -1])
        out = {}
        for t in p.nonzero().flatten().tolist():
            tokens = (*prefix[len(ids) :], t)
            if len(tokens) == n:
                out[tokens] = p_prefix * float(p[t])
            else:
                out.update(extend([*prefix, t], len(prefix), p_prefix * float(p[t])))
        return out

    return extend(list(ids), 0, 1.0)


def exact_pair_distribution(engine, ids):
    """P(t1, t2 | ids) under top-k sampling."""
    return exact_distribution(engine, ids, 2)


def tv(counts, exact):
    total = sum(counts.values())
    keys = set(counts) | set(exact)
    return 0.5 * sum(abs(counts.get(k, 0) / total - exact.get(k, 0.0)) for k in keys)
