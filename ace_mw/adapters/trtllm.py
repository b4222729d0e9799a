"""TensorRT-LLM `trtllm-serve`: speculation is per server (YAML `speculative_config`), so it is
switched by pool. Each choice reports `avg_decoded_tokens_per_iter` (tokens per target step, i.e.
tau; streamed too, as a running average); a proposed per-choice `speculative_decoding` object uses
vLLM's names and gives the counts. A measured stream gets `stream_options.include_usage` forced
(its token count for the speed policy), and the usage chunk is stripped again if the client had not
asked for it."""

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
    ratio,
    strip_usage,
    vllm_named,
    with_output_tokens,
)


class TensorRTLLMAdapter:
    name = "trtllm"
    switches_per_request = False  # the speculative config is per engine build / server
    figure_markers = ('"avg_decoded_tokens_per_iter"', '"speculative_decoding"')
    strip_markers = ('"usage"',)

    def inject(self, body: dict[str, Any], directive: SpecDirective) -> tuple[dict[str, Any], Injection]:
        injection = Injection(directive.pool)
        if directive.measure:
            return force_usage(body, body, injection)
        return body, injection

    def extract(self, payload: dict[str, Any]) -> AcceptanceFigures | None:
        return with_output_tokens([_from_choice(c) for c in choices(payload)], payload)

    def strip(self, payload: dict[str, Any], injection: Injection) -> dict[str, Any] | None:
        if FORCED_USAGE in injection.forced:
            return strip_usage(payload)
        return payload


def _from_choice(choice: dict[str, Any]) -> AcceptanceFigures | None:
    tau = ratio(choice.get("avg_decoded_tokens_per_iter"))
    stats = choice.get("speculative_decoding")
    named = vllm_named(stats) if isinstance(stats, dict) else None
    if named is None:
        return figures(reported_tau=tau)
    if named.reported_tau is None and tau is not None:
        return replace(named, reported_tau=tau)
    return named
