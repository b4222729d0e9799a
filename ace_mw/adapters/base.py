"""What every engine adapter does, and the small readers they share.

An adapter is stateless: `inject` turns a directive into body fields and a pool, `extract` reads
acceptance figures from one response JSON (a whole body or one SSE event), `strip` takes out of a
response what `inject` forced the engine to add. Engine responses are untrusted input: every reader
here accepts only well-typed, non-negative, finite numbers and ignores anything else.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple, Protocol, TypeVar, overload

from ..acceptance import AcceptanceFigures, combine
from ..directive import SpecDirective

# Names in Injection.forced: what strip() must take out again.
FORCED_USAGE = "usage"  # stream_options.include_usage forced on a stream
FORCED_META_INFO = "meta_info"  # SGLang return_meta_info forced on a non-streaming request

# A JSON answer the observer must strip is held whole until its end, up to this size; past it the
# answer would go out unstripped, so an adapter forces an extra into a non-streaming request only
# when the request bounds its answer below it (`answer_fits_hold`).
MAX_HELD_BODY = 4 << 20
# Bytes of a JSON answer per generated token, generously (a long token, escaped; per choice).
ANSWER_BYTES_PER_TOKEN = 256
ANSWER_OVERHEAD_BYTES = 16 << 10

T = TypeVar("T")


class Injection(NamedTuple):
    """What an adapter did to one request: the pool to route to, the body fields it wrote and the
    response extras it forced (which the observer must remove before the client sees them). A
    named tuple: one is built for every injected request, at half a frozen dataclass's cost."""

    pool: str | None = None
    fields: tuple[str, ...] = ()
    forced: frozenset[str] = frozenset()


NO_INJECTION = Injection()
_USAGE = frozenset((FORCED_USAGE,))


class EngineAdapter(Protocol):
    """What the controller and the observer need of an engine adapter.

    Its three attributes are read-only properties here, so that a plain class attribute (how every
    adapter sets them) satisfies them. An adapter may also set `switches_per_request = True` when
    its engine takes the speculation settings from each request's body (then several candidates
    may share one pool); without it, speculation is per server and each candidate needs a pool of
    its own (`AceConfig` checks this)."""

    @property
    def name(self) -> str:
        """The name configurations select the adapter by (`adapter = "vllm"`)."""

    @property
    def figure_markers(self) -> tuple[str, ...]:
        """Substrings of an SSE event's data without which it cannot hold figures: the observer
        JSON-parses only events containing one (most chunks never do)."""

    @property
    def strip_markers(self) -> tuple[str, ...]:
        """The same for the extras `inject` forced, which `strip` removes."""

    def inject(self, body: dict[str, Any], directive: SpecDirective) -> tuple[dict[str, Any], Injection]:
        """New body (`body` itself when nothing changes; never mutated) + what was forced."""

    def extract(self, payload: dict[str, Any]) -> AcceptanceFigures | None:
        """Figures from a JSON body or one SSE event's JSON, or None if it reports none."""

    def strip(self, payload: dict[str, Any], injection: Injection) -> dict[str, Any] | None:
        """`payload` itself if nothing forced is in it, a copy without it, or None to drop it."""


def count(value: Any) -> int | None:
    """A token/step count from untrusted JSON: a non-negative integer (integral floats too)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value if value >= 0 else None
    if isinstance(value, float) and value.is_integer() and value >= 0:
        return int(value)
    return None


def ratio(value: Any) -> float | None:
    """A reported rate or mean from untrusted JSON: a finite, non-negative number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) and value >= 0 else None


def seconds(value: Any) -> float | None:
    """A reported duration from untrusted JSON: None when absent, NaN when present but unusable
    (not a number, negative, infinite), so the speed policy can count it as garbage."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return math.nan
    try:
        value = float(value)
    except OverflowError:
        return math.nan
    return value if math.isfinite(value) and value >= 0 else math.nan


@overload
def first(mapping: dict[str, Any], names: Iterable[str]) -> int | None: ...


@overload
def first(mapping: dict[str, Any], names: Iterable[str], read: Callable[[Any], T | None]) -> T | None: ...


def first(mapping: dict[str, Any], names: Iterable[str], read: Callable[[Any], Any] = count) -> Any:
    """The first of `names` (current name, then older aliases) that holds a valid value."""
    for name in names:
        value = read(mapping.get(name))
        if value is not None:
            return value
    return None


def figures(**values: Any) -> AcceptanceFigures | None:
    """AcceptanceFigures, or None when an engine reported nothing usable."""
    for name, value in values.items():
        if value is not None and name != "invalid":
            return AcceptanceFigures(**values)
    return AcceptanceFigures(invalid=True) if values.get("invalid") else None


def unusable(mapping: dict[str, Any], names: Iterable[str], read: Callable[[Any], Any] = count) -> bool:
    """Whether one of `names` is present, not null, and not what `read` accepts (a negative or
    fractional count, NaN, a string): an absurd figure to count, never to learn."""
    return any(mapping.get(name) is not None and read(mapping[name]) is None for name in names)


def choices(payload: dict[str, Any]) -> list[dict[str, Any]]:
    """The well-formed entries of an OpenAI `choices` list."""
    items = payload.get("choices")
    if not isinstance(items, list):
        return []
    return [c for c in items if isinstance(c, dict)]


def output_tokens(payload: dict[str, Any]) -> int | None:
    """`usage.completion_tokens` of an OpenAI response."""
    return _usage(payload, "completion_tokens")


def prompt_tokens(payload: dict[str, Any]) -> int | None:
    """`usage.prompt_tokens` of an OpenAI response."""
    return _usage(payload, "prompt_tokens")


def _usage(payload: dict[str, Any], name: str) -> int | None:
    usage = payload.get("usage")
    return count(usage.get(name)) if isinstance(usage, dict) else None


VLLM_COUNTS = ("num_draft_tokens", "num_accepted_draft_tokens", "num_accepted_tokens", "num_spec_steps", "num_drafts")
VLLM_RATIOS = ("draft_acceptance_rate", "acceptance_rate", "mean_acceptance_length")


def vllm_named(stats: dict[str, Any]) -> AcceptanceFigures | None:
    """Figures in vLLM's names (`metrics.speculative_decoding`, older `speculative_decoding_stats`,
    TensorRT-LLM's proposed per-choice object); older aliases accepted after the current names."""
    return figures(
        drafted=first(stats, ("num_draft_tokens",)),
        accepted=first(stats, ("num_accepted_draft_tokens", "num_accepted_tokens")),
        steps=first(stats, ("num_spec_steps", "num_drafts")),
        reported_alpha=first(stats, ("draft_acceptance_rate", "acceptance_rate"), ratio),
        reported_tau=first(stats, ("mean_acceptance_length",), ratio),
        # ace-mw's engine adds its decode time (first to last output token) to vLLM's names.
        decode_seconds=seconds(stats.get("decode_time_s")),
        invalid=unusable(stats, VLLM_COUNTS) or unusable(stats, VLLM_RATIOS, ratio),
    )


def with_output_tokens(parts: Iterable[AcceptanceFigures | None], payload: dict[str, Any]) -> AcceptanceFigures | None:
    """Combine per-part figures and fill in the response's output tokens if none were reported."""
    found = combine([p for p in parts if p is not None])
    if found is None or found.output_tokens is not None:
        return found
    produced = output_tokens(payload)
    return found if produced is None else found.with_output_tokens(produced)


def force_usage(body: dict[str, Any], new: dict[str, Any], injection: Injection) -> tuple[dict[str, Any], Injection]:
    """Ask a stream for its usage chunk (`stream_options.include_usage`) when the client did not and
    safely can (stream_options absent or an object); `strip_usage` removes it again."""
    options = body.get("stream_options")
    if not wants_stream(body) or not (options is None or isinstance(options, dict)):
        return new, injection
    if options is not None and options.get("include_usage") is True:
        return new, injection
    new = {**new, "stream_options": {**(options or {}), "include_usage": True}}
    fields, forced = (*injection.fields, "stream_options.include_usage"), injection.forced | _USAGE
    return new, Injection(injection.pool, fields, forced)


def strip_usage(payload: dict[str, Any]) -> dict[str, Any] | None:
    """Undo a forced `include_usage`: drop the usage-only chunk, remove `usage` from any other."""
    if "usage" not in payload:
        return payload
    if payload.get("choices") == []:  # OpenAI's usage chunk; anything else (an error...) stays
        return None
    return {k: v for k, v in payload.items() if k != "usage"}


def strip_choice_field(payload: dict[str, Any], name: str) -> dict[str, Any]:
    """`payload` without `choices[i][name]` (a copy only if some choice has it)."""
    items = payload.get("choices")
    if not isinstance(items, list) or not any(isinstance(c, dict) and name in c for c in items):
        return payload
    kept = [{k: v for k, v in c.items() if k != name} if isinstance(c, dict) else c for c in items]
    return {**payload, "choices": kept}


def answer_fits_hold(body: dict[str, Any]) -> bool:
    """Whether a non-streaming answer to `body` is sure to fit MAX_HELD_BODY: it sets
    `max_completion_tokens` or `max_tokens`, and n x tokens x ANSWER_BYTES_PER_TOKEN (times 2 plus
    `top_logprobs` with logprobs) stays under it. Without a token limit an engine may generate up
    to the model's context, so nothing can be promised."""
    tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    n = body.get("n", 1)
    if type(tokens) is not int or tokens < 1 or type(n) is not int or n < 1:
        return False
    per_token = ANSWER_BYTES_PER_TOKEN
    if body.get("logprobs"):
        top = body.get("top_logprobs")
        per_token *= 2 + (top if type(top) is int and top > 0 else 0)
    return ANSWER_OVERHEAD_BYTES + n * tokens * per_token <= MAX_HELD_BODY


def wants_stream(body: dict[str, Any]) -> bool:
    return body.get("stream") is True
