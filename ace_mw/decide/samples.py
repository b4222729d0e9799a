"""What one response shows of its own decode speed: a sample the speed gate learns from
(decide/speed.py), from the engine's reported decode time or else from when its token-bearing
chunks went by; absurd figures are no sample.

A whole-request sample (`gate.speed_counts = "request"`) keeps its prefill apart, with the prompt's
length, and is learnt at the tenant's usual request (`RequestShape`): the prefill takes time in
proportion to the prompt (measured on vLLM on one core: 0.39-0.51 ms a prompt token, 98-99 % of
its variance), so a sample read as it came says as much about the prompt it got as about the
arm: an arm whose first samples drew the tenant's longest prompts would read slow for it.
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
    # A whole-request sample's prefill (its time to the first token) and the prompt it read: the
    # first token is not in `tokens` nor its time in `seconds` (RequestShape.usual adds them).
    prefill_seconds: float | None = None
    prompt_tokens: int | None = None

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds

    @property
    def sums(self) -> tuple[float, float, float, float]:
        """What it adds to an arm's decayed sums (ArmEstimate.sums)."""
        log_rate = math.log(self.tokens / self.seconds)
        return self.tokens, self.seconds, log_rate, log_rate * log_rate


# The usual request's memory, in the arms' (gate.speed_half_life): an arm's samples span many more of
# the tenant's when others serve most of its traffic, and all of them are learnt at about one usual.
SHAPE_MEMORY = 5.0


class RequestShape:
    """A tenant's usual request, and what its prefill costs a prompt token: decayed sums (per
    sample, SHAPE_MEMORY times as slowly as an arm's estimate) of its prompt and output lengths
    and of its prefills, over every arm. A whole-request sample is learnt as the time the usual
    request would have taken on the arm that served it: its prefill moved to the usual prompt along the tenant's
    prefill slope (the least-squares line of its prefills on their prompts' lengths; a wait for
    a busy engine's step stays as it was), its decode (per token) to the usual output. Kept per
    process (a fleet shares the arms' estimates, not this: replicas of one tenant see the same
    traffic)."""

    __slots__ = ("weight", "prompt", "output", "prefill", "prompt_squares", "prompt_prefill")

    def __init__(self) -> None:
        self.weight = 0.0  # decayed sums: samples, prompt tokens, output tokens (the first included),
        self.prompt = 0.0  # prefill seconds, squared prompt tokens, prompt tokens times prefill seconds
        self.output = 0.0
        self.prefill = 0.0
        self.prompt_squares = 0.0
        self.prompt_prefill = 0.0

    @property
    def slope(self) -> float:
        """Prefill seconds a prompt token, from the tenant's samples (0 until their prompts differ)."""
        if self.weight <= 0:
            return 0.0
        spread = self.prompt_squares - self.prompt * self.prompt / self.weight
        if spread <= 1e-9 * max(1.0, self.prompt_squares):
            return 0.0
        return max(0.0, (self.prompt_prefill - self.prompt * self.prefill / self.weight) / spread)

    def usual(self, sample: SpeedSample, arm_decay: float) -> SpeedSample:
        """`sample` as the tenant's usual request so far (the first as it came), then counted into
        the usual (after: a sample would pull the usual towards its own prompt); a sample without
        a prefill as it is."""
        prefill, prompt = sample.prefill_seconds, sample.prompt_tokens
        if prefill is None or prompt is None:
            return sample
        usual_prompt, usual_output = (
            (self.prompt / self.weight, self.output / self.weight) if self.weight else (prompt, sample.tokens + 1)
        )
        moved = max(0.0, prefill + self.slope * (usual_prompt - prompt))
        sums = (1.0, prompt, sample.tokens + 1, prefill, prompt * prompt, prompt * prefill)
        decay = arm_decay ** (1.0 / SHAPE_MEMORY)
        self.weight, self.prompt, self.output, self.prefill, self.prompt_squares, self.prompt_prefill = (
            old * decay + new for old, new in zip(self._sums, sums, strict=True)
        )
        return SpeedSample(usual_output, moved + sample.seconds * (usual_output - 1) / sample.tokens, sample.source)

    @property
    def _sums(self) -> tuple[float, ...]:
        return self.weight, self.prompt, self.output, self.prefill, self.prompt_squares, self.prompt_prefill


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
    its prefill in the sample too: apart, with the prompt's length, where the engine reports that
    (RequestShape learns it), else every token over the whole request's time. Tokens
    come from the reported usage, else one per token-bearing chunk (exact for engines that stream
    one token per chunk)."""
    produced = figures.output_tokens if figures is not None else None
    if produced is None and timing is not None:
        produced = timing.usage_tokens
    garbage = False
    if figures is not None and figures.decode_seconds is not None:
        tokens = figures.decode_tokens if figures.decode_tokens is not None else _after_first(produced)
        elapsed = figures.decode_seconds
        prefill = figures.first_token_seconds if counts == "request" else None
        if prefill is not None and figures.prompt_tokens is None and tokens is not None:
            tokens, elapsed, prefill = tokens + 1, elapsed + prefill, None  # the whole request, lumped
        sample = checked_sample(tokens, elapsed, "engine")
        if sample is not None:
            if prefill is not None and math.isfinite(prefill) and 0 <= prefill <= MAX_DECODE_S:
                sample.prefill_seconds, sample.prompt_tokens = prefill, figures.prompt_tokens
            return sample, False
        garbage = not (tokens is None or tokens < 1)  # a usable count with an unusable time
    if timing is not None and timing.chunks >= 2:
        tokens = _after_first(produced if produced is not None else timing.chunks)
        return checked_sample(tokens, timing.last - timing.first, "stream"), garbage
    return None, garbage


def _after_first(produced: int | None) -> int | None:
    return produced - 1 if produced is not None else None
