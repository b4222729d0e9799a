"""One request's decision, in the order the gates run: route, mode, body, canary, temperature,
then the tenant's admission (breaker and speed plan, decide/tenant.py) at its pools' load now
(decide/load.py), and where the chosen pool is ejected, another one.

Each step that ends the decision returns it; the last one admits. Everything it reads is the
config snapshot, the request and what the state store, the in-flight counts and the pools' health
hold; what it returns is a `Decision`, which the controller carries forward (injection, response,
learning) and never decides again.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any, NamedTuple, Protocol

from ..config import AceConfig, GateConfig, Mode
from ..decision import Decision, disabled
from ..directive import BASELINE_POOL, SpecDirective
from ..request import RequestView
from ..vocabulary import Outcome, Reason
from .gate import UNCHECKED, effective_temperature, state_model
from .load import InFlight, Joining
from .policy import Resolution, in_canary, resolve, sticky_bucket
from .tenant import Admission


class Admitting(Protocol):
    """What the decision needs of the state store (state/memory.py, `StateStore`)."""

    def admit(
        self,
        key: tuple[str, str],
        arms: tuple[str, ...],
        gate: GateConfig,
        now: float,
        bucket: float,
        joinable: Joining | None = None,
    ) -> Admission: ...

    def release(self, key: tuple[str, str]) -> None: ...


class Decider:
    """The decision of one request from what the state stores (thread-safe: it holds only shared,
    thread-safe things). `ejected(pool)` says whether a pool is out of the loop's choices
    (operate/outliers.py)."""

    def __init__(
        self, store: Admitting, in_flight: InFlight, ejected: Callable[[str], bool], clock: Callable[[], float]
    ) -> None:
        self._store = store
        self._in_flight = in_flight
        self._ejected = ejected
        self._clock = clock

    def decide(self, config: AceConfig, request: RequestView, span: Any = None, owned: bool = False) -> Decision:
        """Raises InvalidOverrideHeader (a bad override header); any other fault is the caller's
        to fail open. A routed decision is counted in flight on its pool from here."""
        resolution = resolve(config, request)
        decision = self._gated(config, request, resolution, span, owned)
        if config.pools:
            if self._ejected(decision.pool):
                decision = self.around_ejected(decision)
            # an exploration or a probe tries an arm on the side: other requests do not join it;
            # the temperature gate's request cannot leave plain decoding: others join it
            leads = decision.reason not in (Reason.EXPLORE, Reason.PROBE)
            pinned = decision.reason == Reason.TEMPERATURE and decision.outcome == Outcome.GATED
            self._in_flight.start(decision.pool, decision, leads, pinned)
        return decision

    def _gated(
        self, config: AceConfig, request: RequestView, resolution: Resolution, span: Any, owned: bool
    ) -> Decision:
        resolved = _Resolved(config, request, resolution, span, owned)
        settings, mode, gate = resolution.settings, resolution.mode, config.gate
        if mode is Mode.OFF:
            return resolved.decision(Outcome.OFF, Reason.MODE_OFF)
        if request.body is None:
            return resolved.decision(Outcome.OFF, f"{Reason.BODY_UNREADABLE}:{request.body_error or 'missing'}")
        bucket = sticky_bucket(resolution.tenant, request.sticky_id)
        canary = mode is Mode.PROD and resolution.mode_source != "header" and settings.canary_percent < 100
        temperature = effective_temperature(request.temperature, gate.default_temperature)
        if canary and not in_canary(bucket, settings.canary_percent):
            return resolved.decision(Outcome.OFF, Reason.CANARY_EXCLUDED, temperature=temperature)
        if temperature is None:
            return resolved.decision(Outcome.OFF, Reason.BAD_TEMPERATURE, canary=canary)
        shadow = mode is Mode.SHADOW
        if temperature > gate.temperature_threshold:
            outcome = Outcome.SHADOW if shadow else Outcome.GATED
            return resolved.decision(outcome, Reason.TEMPERATURE, canary=canary, temperature=temperature)
        key = (resolution.tenant, state_model(request.model or "", temperature, gate.temperature_bands))
        arms, admission = self._admitted(config, resolution, key, bucket)
        directive = None
        if admission.arm and not shadow:
            directive = settings.directives[admission.arm, admission.reason, admission.measured]
        outcome = Outcome.SHADOW if shadow else Outcome.APPLIED if directive is not None else Outcome.GATED
        return resolved.decision(
            outcome,
            admission.reason,
            canary=canary,
            temperature=temperature,
            directive=directive,
            admitted=(arms, admission),
            key=key,
        )

    def _admitted(
        self, config: AceConfig, resolution: Resolution, key: tuple[str, str], bucket: float
    ) -> tuple[tuple[str, ...], Admission]:
        """The admission of the tenant's state `key`, with its arms at their pools' load now where
        load counts."""
        settings, gate = resolution.settings, config.gate
        arms, arm_gate, joinable = settings.arms, gate, None
        if config.pools and config.upstream.load_aware:
            arms, arm_gate, joinable = self._in_flight.arms_now(
                arms, settings.arm_pools, gate, config.upstream.load_scope
            )
        now = self._clock()
        if joinable is None:  # only then: a store of the app's own may predate the argument
            return arms, self._store.admit(key, arms, arm_gate, now, bucket)
        return arms, self._store.admit(key, arms, arm_gate, now, bucket, joinable=joinable)

    def around_ejected(self, decision: Decision) -> Decision:
        """`decision` sent to another pool than its ejected one: the baseline pool, else the
        first other pool of the config that is in (they serve the same model; speculation is
        lossless), without speculating there or learning from it; as it was when every pool is out
        (the request fails as it would without the middleware)."""
        pools = decision.config.pools
        healthy = [p for p in (BASELINE_POOL, *pools) if p in pools and not self._ejected(p)]
        if not healthy:
            return decision
        if decision.probe:
            self._store.release(decision.key)
        directive = SpecDirective(enabled=False, pool=healthy[0], reason=Reason.POOL_EJECTED)
        outcome = Outcome.GATED if decision.outcome == Outcome.APPLIED else decision.outcome
        notes = (*decision.notes, f"{Reason.POOL_EJECTED}:{decision.pool}")
        return replace(
            decision,
            outcome=outcome,
            reason=Reason.POOL_EJECTED,
            directive=directive,
            probe=False,
            arm="",
            arm_at_load="",
            notes=notes,
        )


def stepped_aside(decision: Decision) -> Decision:
    """`decision` once its injection failed: nothing of it reaches the engine, so it is "off" and
    runs no arm (the caller releases the probe slot it held)."""
    return replace(
        decision,
        outcome=Outcome.OFF,
        reason=Reason.INTERNAL_ERROR,
        directive=disabled(Reason.INTERNAL_ERROR),
        probe=False,
        arm="",
        speedup=None,
    )


def untracked(config: AceConfig, request: RequestView, reason: str, span: Any = None, owned: bool = False) -> Decision:
    """An "off" decision built from nothing that can fail (no body or key parsing)."""
    return Decision(
        mode=config.mode,
        mode_source="org",
        outcome=Outcome.OFF,
        reason=reason,
        directive=disabled(reason),
        tenant="unknown",
        model=None,
        key=("unknown", ""),
        temperature=None,
        stream=False,
        canary=False,
        breaker_state=UNCHECKED,
        probe=False,
        config=config,
        path=request.path,
        span=span,
        owns_span=owned,
    )


class _Resolved(NamedTuple):
    """What every decision of one resolved request carries, whichever gate ends it."""

    config: AceConfig
    request: RequestView
    resolution: Resolution
    span: Any
    owned: bool

    def decision(
        self,
        outcome: str,
        reason: str,
        *,
        canary: bool = False,
        temperature: float | None = None,
        directive: SpecDirective | None = None,
        admitted: tuple[tuple[str, ...], Admission] | None = None,
        key: tuple[str, str] | None = None,
    ) -> Decision:
        """The decision, from the parts the gates produced (`admitted`: the arms at load and the
        admission of the tenant's state `key`, where it was admitted)."""
        resolution, request = self.resolution, self.request
        state, probe, arm, arm_at_load, speedup, measured = UNCHECKED, False, "", "", None, True
        if admitted is not None:
            arms, admission = admitted
            state, probe, speedup, measured = admission.state, admission.probe, admission.speedup, admission.measured
            arm, arm_at_load = resolution.settings.arms[admission.arm], arms[admission.arm]
        return Decision(
            mode=resolution.mode,
            mode_source=resolution.mode_source,
            outcome=outcome,
            reason=reason,
            directive=directive or disabled(reason, measured),
            tenant=resolution.tenant,
            model=request.model,
            key=key or (resolution.tenant, request.model or ""),
            temperature=temperature,
            stream=request.stream,
            canary=canary,
            breaker_state=state,
            probe=probe,
            config=self.config,
            path=request.path,
            notes=resolution.notes,
            span=self.span,
            owns_span=self.owned,
            arm=arm,
            speedup=speedup,
            measured=measured,
            tenant_name=resolution.settings.name,
            arm_at_load=arm_at_load,
        )
