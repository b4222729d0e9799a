"""Acceptance figures of one response, normalised across engines.

drafted D, accepted A, steps S, output tokens N:
alpha = A / D (acceptance rate), tau = N / S (tokens per target step, bonus token included).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional, Sequence


@dataclass(frozen=True)
class AcceptanceFigures:
    drafted: Optional[int] = None
    accepted: Optional[int] = None
    steps: Optional[int] = None
    output_tokens: Optional[int] = None
    # Engines that report only a ratio (SGLang's spec_accept_rate, TensorRT-LLM's
    # avg_decoded_tokens_per_iter) fill these directly.
    reported_alpha: Optional[float] = None
    reported_tau: Optional[float] = None

    @property
    def alpha(self) -> Optional[float]:
        """Acceptance rate accepted/drafted, or the engine's own figure, or None."""
        if self.drafted and self.accepted is not None:
            return min(1.0, max(0.0, self.accepted / self.drafted))
        return self.reported_alpha

    @property
    def tau(self) -> Optional[float]:
        """Accepted tokens per target step (bonus included), or None."""
        if self.steps and self.output_tokens is not None:
            return self.output_tokens / self.steps
        if self.steps and self.accepted is not None:
            return 1.0 + self.accepted / self.steps
        return self.reported_tau


def combine(parts: Sequence[AcceptanceFigures]) -> Optional[AcceptanceFigures]:
    """Figures of several parts of one response (e.g. its choices): counts add, ratios average."""
    if len(parts) <= 1:
        return parts[0] if parts else None
    return AcceptanceFigures(
        drafted=_total(p.drafted for p in parts),
        accepted=_total(p.accepted for p in parts),
        steps=_total(p.steps for p in parts),
        output_tokens=_total(p.output_tokens for p in parts),
        reported_alpha=_mean(p.reported_alpha for p in parts),
        reported_tau=_mean(p.reported_tau for p in parts),
    )


def _total(values: Iterable[Optional[int]]) -> Optional[int]:
    known = [v for v in values if v is not None]
    return sum(known) if known else None


def _mean(values: Iterable[Optional[float]]) -> Optional[float]:
    known = [v for v in values if v is not None]
    return sum(known) / len(known) if known else None
