"""One step's tokens as its forward runs them (the loop's step 4, ``scheduler.py``): where each
row's tokens start, which cache slots they go to, under which mask, and which logits the step
needs."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from ..drafting.drafters import DraftTree
from ..drafting.tree import VerifyLayout
from ..model.rows import Span
from .sequence import BatchSequence


class StepLayout(NamedTuple):
    """One step's tokens as its forward runs them: decoding rows (each its root and draft, a
    chain causal, a tree under its own mask and positions), then prompt chunks."""

    inputs: list[torch.Tensor]  # each row's tokens, in the step's order
    spans: list[Span]  # where each row's tokens go in its cache
    trees: list[tuple[DraftTree | None, list[list[int]]]]  # each decoding row's draft and its children
    offsets: list[int]  # where each row's tokens start among the step's
    wanted: list[int]  # the tokens whose logits the step needs: every decoding row's, each finished prompt's last

    @classmethod
    def of(
        cls,
        decoding: Sequence[BatchSequence],
        drafts: Sequence[int],
        prefilling: Sequence[tuple[BatchSequence, torch.Tensor]],
    ) -> StepLayout:
        layout = cls([], [], [], [], [])
        t = 0
        for s, k in zip(decoding, drafts, strict=True):
            assert s.root is not None
            tree = s.proposal.prefix(k) if s.proposal is not None and k else None
            root = s.prompt.new_tensor([s.root])
            if tree is None or tree.is_chain:
                layout.spans.append(Span(s.row, s.length, 1 + k))
                layout.trees.append((tree, [[i + 1] for i in range(k)] + [[]]))
            else:
                verifying = VerifyLayout.from_parents(tree.parents)
                layout.spans.append(Span(s.row, s.length, 1 + k, verifying.positions, verifying.mask))
                layout.trees.append((tree, verifying.children))
            layout.inputs.append(root if tree is None else torch.cat([root, tree.tokens.to(root.device)]))
            layout.offsets.append(t)
            layout.wanted.extend(range(t, t + 1 + k))
            t += 1 + k
        for s, chunk in prefilling:
            layout.spans.append(Span(s.row, s.prefilled, chunk.numel()))
            layout.inputs.append(chunk)
            layout.offsets.append(t)
            t += chunk.numel()
            if s.prefilled + chunk.numel() == s.prompt.numel():
                layout.wanted.append(t - 1)
        return layout
