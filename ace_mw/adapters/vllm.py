"""vLLM (v1 OpenAI server): speculation is per server, so it is switched by pool.

Per-request figures exist only when the server runs with `--per-request-spec-decode-metrics`;
they sit in top-level `metrics.speculative_decoding` (older builds: `choices[i].
speculative_decoding_stats`). In a stream they ride only the final usage chunk, so a speculative
stream gets `stream_options.include_usage` forced on, and the usage chunk is removed again if the
client had not asked for it.
"""

from __future__ import annotations

from typing import Any

from ..acceptance import AcceptanceFigures
from ..directive import SpecDirective
from .base import (
    FORCED_USAGE,
    Injection,
    choices,
    strip_usage,
    vllm_named,
    wants_stream,
    with_output_tokens,
)


class VLLMAdapter:
    name = "vllm"
    figure_markers = ('"speculative_decoding',)
    strip_markers = ('"usage"',)

    def inject(self, body: dict[str, Any], directive: SpecDirective) -> tuple[dict[str, Any], Injection]:
        fields = self.spec_fields(directive)
        new = {**body, **fields} if fields else body
        names = tuple(fields)
        forced: frozenset[str] = frozenset()
        if directive.enabled and wants_stream(body) and _usage_not_requested(body):
            options = body.get("stream_options") or {}
            new = {**new, "stream_options": {**options, "include_usage": True}}
            names += ("stream_options.include_usage",)
            forced = frozenset({FORCED_USAGE})
        return new, Injection(directive.pool, names, forced)

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
        return with_output_tokens(parts, payload)

    def strip(self, payload: dict[str, Any], injection: Injection) -> dict[str, Any] | None:
        if FORCED_USAGE in injection.forced:
            return strip_usage(payload)
        return payload


def _usage_not_requested(body: dict[str, Any]) -> bool:
    """True when forcing include_usage is both needed and safe (stream_options absent or an object)."""
    options = body.get("stream_options")
    if options is None:
        return True
    return isinstance(options, dict) and options.get("include_usage") is not True
