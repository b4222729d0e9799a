"""One batched step of rows whose prompts are of very unlike lengths, each decoding its last token:
what the tests of decoding attention (in runs, or native) hold to each row's solo logits."""

from __future__ import annotations

import torch

from ace_mw.engine.model.rows import Rows, Span
from ace_mw.engine.model.step import Step
from ace_mw.engine.model.transformer import Transformer

CPU = torch.device("cpu")
# row: prompt length, in the order the step runs them (not row order)
LENGTHS = {3: 600, 0: 8, 5: 620, 1: 12, 2: 9, 4: 610}


def decoding_step(model: Transformer, native: bool) -> tuple[Rows, torch.Tensor, torch.Tensor]:
    """The step (its rows built ``native`` or not), its logits, and each row's solo logits. Each
    prompt runs in two chunks before it, the second after a cached part."""
    torch.manual_seed(2)
    seqs = {r: torch.randint(0, model.config.vocab_size, (n,)) for r, n in LENGTHS.items()}
    caches = model.batch_caches(len(LENGTHS), 640)
    with torch.inference_mode():
        solo = torch.stack([model(s[None], Step.span(0, s.numel(), CPU))[0][0][-1] for s in seqs.values()])
        for r, s in seqs.items():
            half = s.numel() // 2
            for start, end in ((0, half), (half, s.numel() - 1)):
                chunk = Rows.build([Span(r, start, end - start)], CPU, native)
                model.forward_rows(s[start:end], chunk, caches, torch.zeros(1).long())
        step = Rows.build([Span(r, s.numel() - 1, 1) for r, s in seqs.items()], CPU, native)
        last = torch.stack([s[-1] for s in seqs.values()])
        logits, _ = model.forward_rows(last, step, caches, torch.arange(len(LENGTHS)))
    return step, logits, solo
