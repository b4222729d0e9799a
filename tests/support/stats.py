"""Pearson's chi-square goodness-of-fit test: the one the sampling tests judge losslessness by."""

from __future__ import annotations

from collections.abc import Hashable, Mapping

import torch


def chi_square_p_value(
    counts: Mapping[Hashable, float], exact: Mapping[Hashable, float], min_expected: float = 5.0
) -> float:
    """The p-value of sampled ``counts`` against the ``exact`` distribution (outcome -> probability).

    Outcomes expected fewer than ``min_expected`` times are pooled into one cell (the chi-square
    approximation needs it); a pool still too rare merges into the least likely kept cell. An
    outcome the exact distribution excludes gives 0: a sampler that emits it is wrong however
    rarely it does."""
    total = sum(counts.values())
    if any(count and exact.get(k, 0.0) == 0.0 for k, count in counts.items()):
        return 0.0
    cells, rare = [], [0.0, 0.0]
    for k, p in sorted(exact.items(), key=lambda item: -item[1]):
        cell = [counts.get(k, 0), total * p]
        if cell[1] >= min_expected:
            cells.append(cell)
        else:
            rare = [rare[0] + cell[0], rare[1] + cell[1]]
    if rare[1] >= min_expected or not cells:
        cells.append(rare)
    else:
        cells[-1] = [cells[-1][0] + rare[0], cells[-1][1] + rare[1]]
    statistic = sum((observed - expected) ** 2 / expected for observed, expected in cells if expected > 0)
    dof = len(cells) - 1
    return float(
        torch.special.gammaincc(
            torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(statistic / 2, dtype=torch.float64)
        )
    )


def tensor_cells(counts: torch.Tensor, probs: torch.Tensor) -> tuple[dict[int, float], dict[int, float]]:
    """Counts and probabilities over the same cells, as flat index -> value, for ``chi_square_p_value``."""
    flat_counts, flat_probs = counts.flatten().tolist(), probs.flatten().tolist()
    return dict(enumerate(flat_counts)), dict(enumerate(flat_probs))
