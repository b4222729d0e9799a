"""vLLM (v1 OpenAI server): speculation is per server, so it is switched by pool.

Per-request figures exist only when the server runs with `--per-request-spec-decode-metrics`;
they sit in top-level `metrics.speculative_decoding` (older builds: `choices[i].
speculative_decoding_stats`). In a stream they ride only the final usage chunk, so a measured
stream (speculative, or the plain arm of the speed policy) gets `stream_options.include_usage`
forced on, and the usage chunk is removed again if the client had not asked for it.
"""

from __future__ import annotations

from typing import Any

from ..acceptance import AcceptanceFigures
from ..directive import SpecDirective
from .base import (
    FORCED_USAGE,
    Injection,
    choices,
    force_usage,
    strip_usage,
    vllm_named,
    with_output_tokens,
)


class VLLMAdapter:
    name = "vllm"
    switches_per_request = False  # speculation is set per server: each candidate needs its own pool
    figure_markers = ('"speculative_decoding',)
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
        return with_output_tokens(parts, payload)

    def strip(self, payload: dict[str, Any], injection: Injection) -> dict[str, Any] | None:
        if FORCED_USAGE in injection.forced:
            return strip_usage(payload)
        return payload
