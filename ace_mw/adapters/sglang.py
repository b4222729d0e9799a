"""SGLang: speculation is per server, so it is switched by pool.

Figures live in `meta_info` (`spec_verify_ct`, `spec_accept_length`, `spec_accept_rate`,
`spec_num_correct_drafts` / `spec_num_proposed_drafts`; older `spec_accept_token_num` /
`spec_draft_token_num`). The OpenAI API returns it as `choices[i].meta_info` only when asked with
`return_meta_info: true`, and only for non-streaming requests (a stream with it fails), so it is
forced there alone, and only where the request bounds the answer to fit the observer's hold
(`answer_fits_hold`: a larger answer could not be stripped), and removed again if the client had
not asked. A measured OpenAI stream gets
`stream_options.include_usage` instead (its token count), removed again likewise. Native
`/generate` always returns a top-level `meta_info`, streamed too (cumulative per chunk).
"""

from __future__ import annotations

from typing import Any

from ..acceptance import AcceptanceFigures
from ..directive import SpecDirective
from .base import (
    FORCED_META_INFO,
    FORCED_USAGE,
    Injection,
    answer_fits_hold,
    choices,
    count,
    figures,
    first,
    force_usage,
    ratio,
    strip_choice_field,
    strip_usage,
    unusable,
    wants_stream,
    with_output_tokens,
)

SPEC_COUNTS = (
    "spec_num_proposed_drafts",
    "spec_draft_token_num",
    "spec_num_correct_drafts",
    "spec_accept_token_num",
    "spec_verify_ct",
    "completion_tokens",
)


class SGLangAdapter:
    name = "sglang"
    switches_per_request = False  # --speculative-algorithm is per server
    figure_markers = ('"spec_',)
    strip_markers = ('"meta_info"', '"usage"')

    def inject(self, body: dict[str, Any], directive: SpecDirective) -> tuple[dict[str, Any], Injection]:
        openai_shaped = "messages" in body or "prompt" in body
        injection = Injection(directive.pool)
        if not openai_shaped or not directive.measure:
            return body, injection
        if wants_stream(body):  # the usage chunk gives a measured stream its token count
            return force_usage(body, body, injection)
        if directive.enabled and body.get("return_meta_info") is not True and answer_fits_hold(body):
            new = {**body, "return_meta_info": True}
            return new, Injection(directive.pool, ("return_meta_info",), frozenset({FORCED_META_INFO}))
        return body, injection

    def extract(self, payload: dict[str, Any]) -> AcceptanceFigures | None:
        infos = [c["meta_info"] for c in choices(payload) if isinstance(c.get("meta_info"), dict)]
        if isinstance(payload.get("meta_info"), dict):
            infos.append(payload["meta_info"])
        return with_output_tokens([_from_meta_info(i) for i in infos], payload)

    def strip(self, payload: dict[str, Any], injection: Injection) -> dict[str, Any] | None:
        if FORCED_META_INFO in injection.forced:
            return strip_choice_field(payload, "meta_info")
        if FORCED_USAGE in injection.forced:
            return strip_usage(payload)
        return payload


def _from_meta_info(info: dict[str, Any]) -> AcceptanceFigures | None:
    if not any(isinstance(k, str) and k.startswith("spec_") for k in info):
        return None  # no speculation on this server: completion_tokens alone is not a figure
    return figures(
        drafted=first(info, ("spec_num_proposed_drafts", "spec_draft_token_num")),
        accepted=first(info, ("spec_num_correct_drafts", "spec_accept_token_num")),
        steps=count(info.get("spec_verify_ct")),
        output_tokens=count(info.get("completion_tokens")),
        reported_alpha=ratio(info.get("spec_accept_rate")),
        reported_tau=ratio(info.get("spec_accept_length")),
        invalid=unusable(info, SPEC_COUNTS) or unusable(info, ("spec_accept_rate", "spec_accept_length"), ratio),
    )
