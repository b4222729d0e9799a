"""This project's in-process engine: speculation is switched per request by top-level body fields,
exactly as a client's OpenAI `extra_body` would send them; the response reports vLLM-shaped
`metrics.speculative_decoding`, so reading and stripping are vLLM's."""

from __future__ import annotations

from typing import Any

from ..directive import SpecDirective
from .vllm import VLLMAdapter


class AceAdapter(VLLMAdapter):
    name = "ace"
    switches_per_request = True  # every candidate may share one engine: the body says what to run
    counts_every_step = True  # its num_spec_steps counts plain verify steps too

    def spec_fields(self, directive: SpecDirective) -> dict[str, Any]:
        if not directive.enabled:
            return {"use_speculative_decoding": False}
        fields: dict[str, Any] = {
            "use_speculative_decoding": True,
            "num_speculative_tokens": directive.num_speculative_tokens,
            "speculative_algorithm": directive.algorithm,
        }
        if directive.draft_model is not None:
            fields["speculative_draft_model"] = directive.draft_model
        if directive.tree_choices is not None:
            fields["tree_choices"] = [list(path) for path in directive.tree_choices]
        return fields
