"""What the control plane tells an engine to do for one request.

A `SpecDirective` is the output of a decision and the input of an engine adapter: adapters
translate it into body fields or an upstream pool, never the other way round.
"""

from __future__ import annotations

from dataclasses import dataclass

from .vocabulary import SPECULATIVE, Algorithm

ALGORITHMS = SPECULATIVE
# K, draft tokens per step (chain length or tree depth): the in-process engine's limit, shared with
# the configuration so that a valid config never asks the engine for a K it answers with a 400.
MAX_SPECULATIVE_TOKENS = 32

# The arm that does not speculate, in the speed policy's estimates (ace_mw/decide/speed.py).
PLAIN_ARM = "plain"

# Pool names a gateway maps to real upstreams (see AceConfig.pools).
SPECULATIVE_POOL = "speculative"
BASELINE_POOL = "baseline"


@dataclass(frozen=True)
class SpecDirective:
    """Speculation on or off for one request, and with which parameters."""

    enabled: bool
    algorithm: str = Algorithm.EAGLE_2
    num_speculative_tokens: int = 5
    draft_model: str | None = None
    tree_choices: tuple[tuple[int, ...], ...] | None = None
    pool: str | None = None
    reason: str = ""
    # Ask the engine for what measures this response (e.g. a stream's usage chunk), stripped again
    # if the client did not ask: speculative responses and the plain arm's alike, when the
    # controller reads the response (not past gate.max_measured_per_s).
    measure: bool = False
