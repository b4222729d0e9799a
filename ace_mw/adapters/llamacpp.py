"""llama.cpp server: speculation is set per server (`--spec-draft-model`, `--spec-draft-n-max`),
and builds that parse the flat body key `speculative.n_max` honour it per request (0 disables), so
the adapter writes it and also names the pool for gateways that route. `timings.draft_n` and
`timings.draft_n_accepted` appear only when drafting happened (streams: on the last chunk).
llama.cpp does not report steps; each step emits its accepted drafts plus one target token, so
steps = predicted_n - draft_n_accepted (exact but for a stop string cutting the last step).
Every response's `timings` (drafting or not) give its decode speed: `predicted_n` tokens in
`predicted_ms` after the prompt."""

from __future__ import annotations

from typing import Any

from ..acceptance import AcceptanceFigures
from ..directive import SpecDirective
from .base import Injection, count, figures, seconds

N_MAX = "speculative.n_max"


class LlamaCppAdapter:
    name = "llamacpp"
    # Builds since about Sep 2025 (0c1e570, llama-cpp-python 0.3.36) ignore the per-request
    # `speculative.n_max`: speculation is per server (`--spec-type`), so each candidate needs its
    # own pool. `/props` says which kind a server is (`honours_n_max`); pools.py asks it.
    switches_per_request = False
    figure_markers = ('"timings"',)
    strip_markers: tuple[str, ...] = ()

    def inject(self, body: dict[str, Any], directive: SpecDirective) -> tuple[dict[str, Any], Injection]:
        n_max = directive.num_speculative_tokens if directive.enabled else 0
        return {**body, N_MAX: n_max}, Injection(directive.pool, (N_MAX,))

    def extract(self, payload: dict[str, Any]) -> AcceptanceFigures | None:
        timings = payload.get("timings")
        if not isinstance(timings, dict):
            return None
        produced = count(timings.get("predicted_n"))
        elapsed = seconds(timings.get("predicted_ms"))
        decode = None if elapsed is None else figures(decode_seconds=elapsed / 1000.0, decode_tokens=produced)
        drafted = count(timings.get("draft_n"))
        if drafted is None:
            return decode  # no drafting happened: only the speed
        accepted = count(timings.get("draft_n_accepted"))
        steps = produced - accepted if produced is not None and accepted is not None and produced > accepted else None
        return figures(
            drafted=drafted,
            accepted=accepted,
            steps=steps,
            output_tokens=produced,
            decode_seconds=decode.decode_seconds if decode is not None else None,
            decode_tokens=decode.decode_tokens if decode is not None else None,
        )

    def strip(self, payload: dict[str, Any], injection: Injection) -> dict[str, Any] | None:
        return payload
