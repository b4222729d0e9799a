"""Acceptance figures of one response, normalised across engines.

drafted D, accepted A, steps S, output tokens N:
alpha = A / D (acceptance rate), tau = 1 + A / S (tokens per target decode step, bonus token
included; N / S where only N is known).

A response that drafted nothing (D = 0: prompt lookup found no match, a drafter that stepped
aside) says nothing about acceptance, whatever rate the engine reports beside it (vLLM sends 0.0):
its alpha is None, so no breaker or estimate learns from it. Figures that contradict themselves
(A > D, or a field present with a negative, fractional or non-finite count) are `absurd`: they are
counted and never learned.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(slots=True)
class AcceptanceFigures:
    """Read-only by contract (not frozen: built for every observed response, and a frozen
    dataclass's constructor costs several times a plain one's)."""

    drafted: int | None = None
    accepted: int | None = None
    steps: int | None = None
    output_tokens: int | None = None
    # Engines that report only a ratio (SGLang's spec_accept_rate, TensorRT-LLM's
    # avg_decoded_tokens_per_iter) fill these directly.
    reported_alpha: float | None = None
    reported_tau: float | None = None
    # The engine's own decode time (after the first token; NaN when it sent an unusable value) and,
    # where the engine says, how many tokens it covers (else output_tokens - 1).
    decode_seconds: float | None = None
    decode_tokens: int | None = None
    # The engine's time to the first token (prefill and queueing; vLLM's time_to_first_token_ms):
    # with `gate.speed_counts = "request"` the speed sample covers it too, the prefill's share
    # scaled to the tenant's usual prompt by `prompt_tokens` (samples.RequestShape).
    first_token_seconds: float | None = None
    prompt_tokens: int | None = None
    # Some field was present but unusable (negative, NaN, not a number) or the counts contradict
    # each other (A > D): nothing of these figures is learned, and the response is counted.
    invalid: bool = False

    def with_output_tokens(self, output_tokens: int) -> AcceptanceFigures:
        """These figures with the response's output token count (dataclasses.replace, at a fraction
        of its cost: this runs once per observed response)."""
        return AcceptanceFigures(
            self.drafted,
            self.accepted,
            self.steps,
            output_tokens,
            self.reported_alpha,
            self.reported_tau,
            self.decode_seconds,
            self.decode_tokens,
            self.first_token_seconds,
            self.prompt_tokens,
            self.invalid,
        )

    @property
    def absurd(self) -> bool:
        """Figures no engine could mean: an unusable field, or more accepted than drafted."""
        return self.invalid or (self.accepted is not None and self.drafted is not None and self.accepted > self.drafted)

    @property
    def drafted_nothing(self) -> bool:
        """The engine says it drafted no token: no evidence about acceptance either way."""
        return self.drafted == 0

    @property
    def alpha(self) -> float | None:
        """Acceptance rate accepted/drafted, or the engine's own figure; None when nothing was
        drafted or the figures are absurd."""
        if self.drafted == 0 or self.absurd:
            return None
        if self.drafted and self.accepted is not None:
            return self.accepted / self.drafted
        return self.reported_alpha

    @property
    def tau(self) -> float | None:
        """Accepted tokens per target step (bonus included), or None."""
        if self.absurd:
            return None
        if self.steps and self.accepted is not None:  # each step emits its accepted drafts and one token
            return 1.0 + self.accepted / self.steps
        if self.steps and self.output_tokens is not None:
            return self.output_tokens / self.steps
        return self.reported_tau


def combine(parts: Sequence[AcceptanceFigures]) -> AcceptanceFigures | None:
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
        decode_seconds=_longest(p.decode_seconds for p in parts),
        decode_tokens=_total(p.decode_tokens for p in parts),
        first_token_seconds=_longest(p.first_token_seconds for p in parts),
        prompt_tokens=next((p.prompt_tokens for p in parts if p.prompt_tokens is not None), None),  # one prompt
        invalid=any(p.absurd for p in parts),
    )


def _total(values: Iterable[int | None]) -> int | None:
    known = [v for v in values if v is not None]
    return sum(known) if known else None


def _longest(values: Iterable[float | None]) -> float | None:
    """Parts decode side by side: the response took as long as its longest part."""
    known = [v for v in values if v is not None]
    if not known:
        return None
    return math.nan if any(math.isnan(v) for v in known) else max(known)


def _mean(values: Iterable[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return sum(known) / len(known) if known else None
