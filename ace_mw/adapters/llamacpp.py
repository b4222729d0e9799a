"""llama.cpp's llama-server (its OpenAI API; checked against the real server built from
llama-cpp-python 0.3.36, llama.cpp 0c1e570, and 0.3.16, 4227c9b: docs/adapters.md).

Speculation is set per server: `-md draft.gguf --spec-type draft-simple` (a draft model) or
`--spec-type ngram-simple` (prompt lookup); older builds had `-md` with `--draft-max`. Builds up to
about Aug 2025 also honour a per-request `speculative.n_max` (0 disables drafting); current ones
ignore it (their `/props` no longer lists it), so the adapter still writes it and names the pool,
and every candidate runs on a pool of its own (`switches_per_request = False`).

Figures come from `timings` (non-streaming: top level; streams: on the `finish_reason` chunk, or
every chunk with `timings_per_token`, as running totals): `draft_n` / `draft_n_accepted` appear
only when drafting happened. `predicted_n` counts the output tokens (the first, sampled from the
prefill's logits, included) and `predicted_ms` times the decoding after that first token, so
the decode speed is (predicted_n - 1) / predicted_ms, as the server's own
`predicted_per_second`. Each decode step emits its accepted drafts plus one target token, so
steps = predicted_n - 1 - draft_n_accepted (exact but for a stop string cutting the last step).
"""

from __future__ import annotations

from typing import Any

from ..acceptance import AcceptanceFigures
from ..directive import SpecDirective
from .base import Injection, count, figures, seconds, unusable

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
        decoded = produced - 1 if produced is not None and produced >= 2 else None  # after the first token
        elapsed = seconds(timings.get("predicted_ms"))
        decode = (
            None
            if elapsed is None or decoded is None
            else figures(decode_seconds=elapsed / 1000.0, decode_tokens=decoded)
        )
        if unusable(timings, ("predicted_n", "draft_n", "draft_n_accepted")):
            return figures(invalid=True)
        drafted = count(timings.get("draft_n"))
        if drafted is None:
            return decode  # no drafting happened: only the speed
        accepted = count(timings.get("draft_n_accepted"))
        steps = decoded - accepted if decoded is not None and accepted is not None and decoded > accepted else None
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

    probe_path = "/props"

    def read_probe(self, payload: Any) -> dict[str, Any]:
        """What `/props` says of a server (pools.py): whether it honours a per-request
        `speculative.n_max` (builds up to Aug 2025 list it among the request parameters; current
        ones do not, and ignore it), its build and model. ValueError for anything else."""
        settings = payload.get("default_generation_settings") if isinstance(payload, dict) else None
        params = settings.get("params") if isinstance(settings, dict) else None
        if not isinstance(params, dict):
            raise ValueError("not llama-server's /props (no default_generation_settings.params)")
        build, model = payload.get("build_info"), payload.get("model_alias")
        return {
            "honours_n_max": N_MAX in params,
            "build": build if isinstance(build, str) else None,
            "model": model if isinstance(model, str) else None,
        }
