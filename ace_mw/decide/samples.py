"""What one response shows of its own decode speed: a sample the speed gate learns from
(decide/speed.py), from the engine's reported decode time or else from when its token-bearing
chunks went by; absurd figures are no sample.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..acceptance import AcceptanceFigures

# A decode speed outside these bounds is a broken figure, not a measurement.
MAX_TOKENS_PER_S = 1e6
MAX_DECODE_S = 24 * 3600.0


@dataclass(slots=True)
class SpeedSample:
    """One response's decode: `tokens` produced in `seconds` after the first token. Read-only by
    contract (a plain slots dataclass: one is built per measured response)."""

    tokens: float
    seconds: float
    source: str  # "engine" (reported by the engine) | "stream" (timed from the stream's chunks)

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds

    @property
    def sums(self) -> tuple[float, float, float, float]:
        """What it adds to an arm's decayed sums (ArmEstimate.sums)."""
        log_rate = math.log(self.tokens / self.seconds)
        return self.tokens, self.seconds, log_rate, log_rate * log_rate


def checked_sample(tokens: float | None, seconds: float | None, source: str) -> SpeedSample | None:
    """A sample, or None when the figures are missing, non-finite, negative or absurd."""
    if tokens is None or seconds is None:
        return None
    if not (math.isfinite(tokens) and math.isfinite(seconds)) or tokens < 1 or not 0 < seconds <= MAX_DECODE_S:
        return None
    if tokens / seconds > MAX_TOKENS_PER_S:
        return None
    return SpeedSample(float(tokens), float(seconds), source)


class StreamTiming:
    """What one response showed of its own speed as it passed: when its token-bearing chunks went
    by (the first and the last) and the output token count its usage reported."""

    __slots__ = ("first", "last", "chunks", "usage_tokens")

    def __init__(self) -> None:
        self.first = 0.0
        self.last = 0.0
        self.chunks = 0
        self.usage_tokens: int | None = None

    def tick(self, now: float) -> None:
        if not self.chunks:
            self.first = now
        self.last = now
        self.chunks += 1


def response_sample(
    figures: AcceptanceFigures | None, timing: StreamTiming | None, counts: str = "decode"
) -> tuple[SpeedSample | None, bool]:
    """(the response's decode-speed sample or None, whether an engine figure was garbage).

    The engine's own decode time wins; else the stream's timing: tokens after the first over the
    time from the first to the last token-bearing chunk (the prefill is before the first). With
    `counts` "request" (gate.speed_counts) an engine that reports its time to the first token has
    every token over the whole request's time instead. Tokens
    come from the reported usage, else one per token-bearing chunk (exact for engines that stream
    one token per chunk)."""
    produced = figures.output_tokens if figures is not None else None
    if produced is None and timing is not None:
        produced = timing.usage_tokens
    garbage = False
    if figures is not None and figures.decode_seconds is not None:
        tokens = figures.decode_tokens if figures.decode_tokens is not None else _after_first(produced)
        elapsed = figures.decode_seconds
        if counts == "request" and figures.first_token_seconds is not None and tokens is not None:
            tokens, elapsed = tokens + 1, elapsed + figures.first_token_seconds  # the whole request
        sample = checked_sample(tokens, elapsed, "engine")
        if sample is not None:
            return sample, False
        garbage = not (tokens is None or tokens < 1)  # a usable count with an unusable time
    if timing is not None and timing.chunks >= 2:
        tokens = _after_first(produced if produced is not None else timing.chunks)
        return checked_sample(tokens, timing.last - timing.first, "stream"), garbage
    return None, garbage


def _after_first(produced: int | None) -> int | None:
    return produced - 1 if produced is not None else None
