"""What one generation is: the request as the engine accepted it, the tokens its decoding emits
turned into text chunks, and the counts and result it ends with. The engine's loop
(``batching/``) produces them; ``Engine`` and the server hand them out."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

from .drafting.sampling import Sampling
from .params import SamplingParams, SpecParams
from .text import StreamText


@dataclass(frozen=True)
class GenerationStats:
    """Counts of one generation.

    `drafted` counts the draft positions the verifier tried: every accepted token plus, per step,
    the one rejected where the walk stopped (none when it reached the end of its branch). So
    `acceptance_rate` is the per-position acceptance probability of the EAGLE papers, comparable
    between a 4-token chain and a 60-node tree (tau = 1 + alpha + alpha^2 + ...), and it is what
    the middleware's breaker thresholds mean. `proposed` counts every draft token sent to the target
    (all tree nodes), the compute spent on drafts.
    """

    steps: int  # target verify forwards after the prefill
    drafted: int
    accepted: int
    output_tokens: int
    prompt_tokens: int
    ttft_s: float
    decode_time_s: float  # first output token to the last (the prefill never counts)
    proposed: int = 0
    plain_steps: int = 0  # verify steps that drafted nothing
    cached_prompt_tokens: int = 0  # prompt tokens whose KV a cache held already (not computed again)
    expected_speedup: float = 1.0  # the engine's estimate of tokens/s over plain decoding's

    @property
    def tpot_s(self) -> float:
        """Decode time per output token after the first."""
        return self.decode_time_s / (self.output_tokens - 1) if self.output_tokens > 1 else 0.0

    @property
    def plain_step_fraction(self) -> float:
        return self.plain_steps / self.steps if self.steps else 1.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def accepted_per_step(self) -> float:
        """Mean tokens emitted per verify step (accepted drafts + the bonus token)."""
        return (self.accepted + self.steps) / self.steps if self.steps else 0.0


class StepCounts:
    """What one request's verify steps did and when it emitted, counted as it decodes."""

    def __init__(self, start: float) -> None:
        self.start, self.first_at, self.last_at = start, 0.0, 0.0
        self.steps = self.plain_steps = self.drafted = self.accepted = self.proposed = 0

    def count(self, proposed: int, accepted: int, rejected_one: bool) -> None:
        """A step verified ``proposed`` drafts and accepted ``accepted``; ``rejected_one``: the walk
        stopped at a draft it tried (not at the end of its branch)."""
        self.steps += 1
        self.plain_steps += proposed == 0
        self.proposed += proposed
        self.drafted += accepted + rejected_one
        self.accepted += accepted

    def stats(self, output_tokens: int, prompt_tokens: int, expected_speedup: float) -> GenerationStats:
        return GenerationStats(
            steps=self.steps,
            drafted=self.drafted,
            accepted=self.accepted,
            output_tokens=output_tokens,
            prompt_tokens=prompt_tokens,
            ttft_s=self.first_at - self.start,
            decode_time_s=self.last_at - self.first_at,
            proposed=self.proposed,
            plain_steps=self.plain_steps,
            expected_speedup=expected_speedup,
        )


@dataclass(frozen=True)
class GenerationResult:
    text: str
    token_ids: list[int]  # generated ids, without the eos token
    prompt_tokens: int
    finish_reason: str  # "stop" (eos or a stop string) | "length"
    stats: GenerationStats


@dataclass(frozen=True)
class Asked:
    """One request as the engine accepted it (``Engine.prepare``)."""

    prompt: list[int]
    params: SamplingParams
    sampler: Sampling
    speculative: SpecParams
    budget: int  # output tokens it may emit: max_new_tokens within the context


class Decoding(Protocol):
    """What ``chunks`` reads: the tokens each step emits, and the counts at the end."""

    def steps(self) -> Iterator[list[int]]: ...

    def stats(self, output_tokens: int) -> GenerationStats: ...


@dataclass(frozen=True)
class StreamChunk:
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stats: GenerationStats | None = None  # on the last chunk


class Chunker:
    """A decoding's emitted tokens as text chunks, one step at a time: eos, stop strings and the
    budget end it. A step gives at most one chunk (none only for a step that emits nothing), so
    a reader that is handed each step as it comes never waits inside `push`."""

    def __init__(self, decode: Decoding, text: StreamText, budget: int, eos_ids: frozenset[int]) -> None:
        self._decode, self._text, self._budget, self._eos_ids = decode, text, budget, eos_ids
        self._ids: list[int] = []
        self.finished = False

    def push(self, step: list[int]) -> StreamChunk | None:
        """The chunk of one step's tokens; the last one (`finished` after it) has the counts."""
        new, finish = [], "length"
        for token in step:
            if token in self._eos_ids:
                finish = "stop"
                break
            new.append(token)
            if len(self._ids) + len(new) == self._budget:
                break
        delta, new, stopped = self._text.push(new)
        self._ids.extend(new)
        if stopped or finish == "stop" or len(self._ids) >= self._budget:
            self.finished = True
            stats = self._decode.stats(len(self._ids))
            return StreamChunk(delta + self._text.flush(), new, "stop" if stopped else finish, stats)
        return StreamChunk(delta, new) if delta or new else None


def chunks(decode: Decoding, text: StreamText, budget: int, eos_ids: frozenset[int]) -> Iterator[StreamChunk]:
    """A decoding's emitted tokens as text chunks (`Chunker`), read from its steps as they come."""
    chunker = Chunker(decode, text, budget, eos_ids)
    for step in decode.steps():
        chunk = chunker.push(step)
        if chunk is not None:
            yield chunk
        if chunker.finished:
            return


def collect(stream: Iterator[StreamChunk]) -> GenerationResult:
    """A stream's chunks as one result."""
    return result_of(list(stream))


def result_of(chunks: Sequence[StreamChunk]) -> GenerationResult:
    """A whole stream's chunks as one result (its last chunk has the finish reason and counts)."""
    last = chunks[-1]
    assert last.finish_reason is not None and last.stats is not None
    text, ids = "".join(chunk.text for chunk in chunks), [token for chunk in chunks for token in chunk.token_ids]
    return GenerationResult(text, ids, last.stats.prompt_tokens, last.finish_reason, last.stats)
