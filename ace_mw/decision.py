"""`Decision`: what the control plane decided for one request, with the config it was decided
under (the words it is said in: vocabulary.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from .config import AceConfig, Mode
from .directive import BASELINE_POOL, SPECULATIVE_POOL, SpecDirective
from .vocabulary import ARMED, REWRITTEN, TIMED, Outcome


@lru_cache(maxsize=256)
def disabled(reason: str, measured: bool = True) -> SpecDirective:
    """The off directive for one reason; reasons are few, so each is built once. A request that
    runs the plain arm is measured like a speculative one (when its response is read at all)."""
    return SpecDirective(enabled=False, pool=BASELINE_POOL, reason=reason, measure=measured and reason in ARMED)


@dataclass(slots=True, eq=False, kw_only=True)  # built by name: twenty-odd fields
class Decision:
    """What the controller decided for one request, and with which config snapshot. Read-only by
    contract (not frozen: a frozen dataclass of this size costs microseconds to build, a tenth of
    the decision).

    `directive` is what is actually done: disabled (baseline pool) unless the outcome is
    "applied". In shadow mode `reason` says what prod would have done ("ok", "probe", "explore",
    "slower", "temperature", "breaker_open"). `arm` names the arm of the speed policy the request
    runs (or would run, in shadow): "plain" or a candidate's label; "" when no arm applies.
    """

    mode: Mode
    mode_source: str  # "header" | "key" | "org"
    outcome: str  # an Outcome
    reason: str  # a Reason (or "body_unreadable:<why>")
    directive: SpecDirective
    tenant: str  # hashed tenant id, never the raw key
    model: str | None
    # The state the decision was made from and its response teaches: (tenant, model at the
    # request's temperature band: decide/gate.py, `state_model`).
    key: tuple[str, str]
    temperature: float | None  # effective temperature (absent = gate.default_temperature)
    stream: bool
    canary: bool  # selected by a canary percentage below 100
    breaker_state: str  # "closed" | "open" | "half_open" | "unchecked"
    probe: bool  # admitted as a breaker probe: its response must be recorded or released
    config: AceConfig = field(repr=False)
    path: str = ""
    notes: tuple[str, ...] = ()  # e.g. ("override_not_permitted",)
    span: Any = field(default=None, repr=False, compare=False)
    owns_span: bool = field(default=False, repr=False, compare=False)
    arm: str = ""
    speedup: float | None = None  # estimated speed of `arm` over plain decoding, when both are measured
    # Whether the response is read at all (figures, speed). False past `gate.max_measured_per_s`:
    # nothing is forced into the request and the response passes unread.
    measured: bool = True
    tenant_name: str | None = None  # the key's configured name, where it has one
    # The arm's label at the load of its pool when decided (decide/load.py): what its speed sample
    # is recorded under; `arm` itself where the pool was idle or load does not count.
    arm_at_load: str = ""

    @property
    def pool(self) -> str:
        """The upstream pool a gateway should route to: the directive's own, else by whether
        speculation is on (shadow and gated requests go to the baseline pool)."""
        directive = self.directive
        if directive.pool:
            return directive.pool
        return SPECULATIVE_POOL if directive.enabled else BASELINE_POOL

    @property
    def learns_speed(self) -> bool:
        """Whether the response is a speed sample of `arm`: prod traffic the speed policy placed,
        or a breaker probe of it (vocabulary.TIMED)."""
        return self.measured and self.outcome in REWRITTEN and self.reason in TIMED

    def response_headers(self) -> list[tuple[bytes, bytes]]:
        """Headers that tell the client what happened (list of (bytes, bytes), ASGI style); the arm
        header only where the speed policy placed the request; none with `response_headers = false`."""
        if not self.config.response_headers:
            return []
        return list(_response_headers(self.outcome, self.reason, self.arm if self.outcome != Outcome.SHADOW else ""))


@lru_cache(maxsize=1024)
def _response_headers(outcome: str, reason: str, arm: str) -> tuple[tuple[bytes, bytes], ...]:
    """Outcomes, reasons and arm labels are few: each combination is encoded once."""
    headers = (
        (b"x-ace-speculative-decoding", outcome.encode()),
        (b"x-ace-speculative-decoding-reason", reason.encode()),
    )
    return (*headers, (b"x-ace-speculative-decoding-arm", arm.encode())) if arm else headers
