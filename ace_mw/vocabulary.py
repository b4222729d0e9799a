"""The words the control plane says what it decided in: outcomes and reasons.

Terms (one place for all of them):

- **outcome**: what was done. `applied`: speculation requested from the engine. `gated`: prod, but a
  gate (temperature, breaker, speed) kept speculation off. `shadow`: decided and recorded only, the
  request untouched. `off`: nothing decided (mode off, an unreadable body, outside the canary, a bad
  temperature, a route not handled, a fault of ours).
- **reason**: why. The gates' verdicts `ok` (the arm measured fastest, or the first candidate),
  `probe` (a breaker probe), `explore` (exploration traffic), `slower` (plain measured at least as
  fast as every candidate), `breaker_open`, `temperature`; and `mode_off`, `canary_excluded`,
  `bad_temperature`, `route_not_handled`, `body_unreadable:<why>`, `internal_error`.
- **arm**: the speed policy's unit: `plain`, or a candidate's label; it runs on a **pool**.
- **algorithm**: how a request drafts: `eagle` (EAGLE-1's static tree), `eagle_2` (its dynamic
  tree), `eagle_3`, `draft_model`, `ngram` (prompt lookup); the engine's `baseline` drafts nothing.

`Outcome`, `Reason` and `Algorithm` are str enums: each member is equal to its word, hashes like it and prints
as it, so headers, JSON and counters read the words themselves. (Python 3.10 has no StrEnum.)
"""

from __future__ import annotations

from enum import Enum


class Word(str, Enum):
    """A member that is its word everywhere: compared, hashed, formatted, serialised."""

    def __str__(self) -> str:
        return str.__str__(self)

    def __format__(self, spec: str) -> str:
        return str.__format__(str.__str__(self), spec)

    def __repr__(self) -> str:
        return str.__repr__(str.__str__(self))


class Outcome(Word):
    APPLIED = "applied"
    GATED = "gated"
    SHADOW = "shadow"
    OFF = "off"


class Reason(Word):
    OK = "ok"
    PROBE = "probe"
    EXPLORE = "explore"
    SLOWER = "slower"
    PRIOR = "prior"  # the pooled prior of the tenant's model decided (speed policy, little own evidence)
    JOINED = "joined"  # the best arm whose pool is busy: pools that share cores run one batch (decide/load.py)
    BREAKER_OPEN = "breaker_open"
    TEMPERATURE = "temperature"
    MODE_OFF = "mode_off"
    CANARY_EXCLUDED = "canary_excluded"
    BAD_TEMPERATURE = "bad_temperature"
    ROUTE_NOT_HANDLED = "route_not_handled"
    BODY_UNREADABLE = "body_unreadable"  # written "body_unreadable:<why>"
    INTERNAL_ERROR = "internal_error"
    POOL_EJECTED = "pool_ejected"  # the decision's pool failed and is ejected: another pool serves it


class Algorithm(Word):
    """SGLang's SpeculativeAlgorithm, in the names vLLM's and our engine's requests use."""

    BASELINE = "baseline"
    EAGLE = "eagle"
    EAGLE_2 = "eagle_2"
    EAGLE_3 = "eagle_3"
    DRAFT_MODEL = "draft_model"
    NGRAM = "ngram"

    @property
    def drafts(self) -> bool:
        return self is not Algorithm.BASELINE

    @property
    def drafts_for_free(self) -> bool:
        """Prompt lookup drafts from the context, with no forward pass: a draft it makes costs the
        verification of a few more tokens, so a low acceptance costs little (decide/gate.py,
        `breaker_judges`)."""
        return self is Algorithm.NGRAM

    @property
    def grows_tree(self) -> bool:
        """EAGLE-2 and EAGLE-3 grow a dynamic tree per step, within a token budget."""
        return self in (Algorithm.EAGLE_2, Algorithm.EAGLE_3)


# The algorithms that speculate, which a configuration may name.
SPECULATIVE = tuple(a for a in Algorithm if a.drafts)

REWRITTEN = (Outcome.APPLIED, Outcome.GATED)  # outcomes whose body the adapter rewrites
# Reasons whose request ran on an arm of the speed policy (temperature-gated traffic is another
# workload, so it does not count as a sample of the plain arm).
ARMED = (
    Reason.OK,
    Reason.PROBE,
    Reason.EXPLORE,
    Reason.SLOWER,
    Reason.PRIOR,
    Reason.JOINED,
    Reason.BREAKER_OPEN,
)
# Reasons whose response is a speed sample of its arm: all of them, breaker probes included. While
# the breaker holds an arm back, its probes are the only requests that run it; under the speed
# policy they run where the plan would run that arm (decide/tenant.py), so an estimate that says
# the arm is the fastest when it is not (one from before the traffic changed) is corrected by the
# probes it sends, instead of sending probes at the wrong speed for as long as the breaker is open.
TIMED = ARMED
