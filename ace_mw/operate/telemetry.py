"""OpenTelemetry output of the control plane, through opentelemetry-api only.

Decisions go on the current span (the app's server span when it is instrumented) or, when no span
is current, on a `chat {model}` span of our own that ends with the response. Attribute dicts are
built only for recording spans. Names follow the OTel GenAI conventions where they exist and the
`ace.spec_decode.*` namespace otherwise; the tenant appears hashed, never as the raw key.
Decisions and errors are also tallied in the process (`counts()`), for the status page: an OTel
API meter cannot be read back.
"""

from __future__ import annotations

import math
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

from opentelemetry import metrics, trace
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.trace import Span, SpanKind
from opentelemetry.util.types import AttributeValue

from ..acceptance import AcceptanceFigures
from ..directive import PLAIN_ARM
from ..version import __version__

if TYPE_CHECKING:
    from ..config import Mode
    from ..decide.samples import SpeedSample
    from ..decision import Decision
    from ..request import RequestView
    from ..state import BreakerView

_SPEED_BUCKETS = (5.0, 10.0, 20.0, 40.0, 60.0, 80.0, 100.0, 150.0, 200.0, 300.0, 500.0, 1000.0)
_ACCEPTANCE_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.55, 0.6, 0.65, 0.7, 0.8, 0.9, 1.0)
# How long a tracer found to be the API's no-op (no SDK installed yet) is believed before it is
# asked again: an SDK installed later gets our spans within this time, and until then a request
# starts no span of ours at all (a no-op span still costs a chain of calls to start and end).
NOOP_TRACER_RECHECK_S = 1.0


def operation_name(path: str) -> str:
    """GenAI operation of an OpenAI-style route."""
    return "chat" if "chat" in path else "text_completion"


# The breaker-state gauge's values: a dashboard's thresholds read 0 as healthy.
BREAKER_LEVEL = {"closed": 0, "half_open": 1, "open": 2}


@dataclass(frozen=True)
class StateReading:
    """What the observable instruments report, read when a metrics reader collects (never per request)."""

    breakers: list[tuple[str, str, str, int]]  # (tenant name or hash, model, breaker state, trips)
    backend: str  # "memory" | "redis"
    store_healthy: bool  # memory: always; redis: connected and not degraded
    config_version: int


class Telemetry:
    def __init__(
        self,
        tracer_provider: trace.TracerProvider | None = None,
        meter_provider: metrics.MeterProvider | None = None,
    ) -> None:
        self._tracer = trace.get_tracer("ace_mw", __version__, tracer_provider)
        meter = metrics.get_meter("ace_mw", __version__, meter_provider)
        self._decisions = meter.create_counter(
            "ace.spec_decode.decisions",
            unit="{request}",
            description="Speculative-decoding decisions by outcome, reason and mode",
        )
        self._acceptance = meter.create_histogram(
            "ace.spec_decode.acceptance_rate",
            unit="1",
            description="Per-response draft acceptance rate (accepted / drafted)",
            explicit_bucket_boundaries_advisory=_ACCEPTANCE_BUCKETS,
        )
        self._speed_samples = meter.create_counter(
            "ace.spec_decode.speed_samples",
            unit="{response}",
            description="Responses measured for the speed policy, by arm kind and source (engine, "
            "stream, none: no usable figure, ignored: a garbage figure from the engine)",
        )
        self._errors = meter.create_counter(
            "ace.spec_decode.errors",
            unit="{error}",
            description="Internal errors by stage; the request proceeded unmodified",
        )
        self._ejections = meter.create_counter(
            "ace.spec_decode.pool_ejections",
            unit="{ejection}",
            description="Pools taken out of the loop's choices after failing, by pool (outlier detection)",
        )
        self._decode_speed = meter.create_histogram(
            "ace.spec_decode.decode_speed",
            unit="{token}/s",
            description="Decode tokens/s of each measured response, by model and arm (the speed policy's samples)",
            explicit_bucket_boundaries_advisory=_SPEED_BUCKETS,
        )
        self._meter = meter
        self._noop_until = -math.inf  # monotonic time until which our tracer is known to be the no-op
        self._tally: Counter[tuple[str, str]] = Counter()  # (outcome or "error", reason or stage) -> count
        self._tally_lock = threading.Lock()

    def observe(self, read: Callable[[], StateReading]) -> None:
        """Report the state at every collection: breaker state and trips per (tenant, model), the
        config version in force and the store's health. ``read`` runs on the reader's thread, once
        per collection: the SDK calls the callbacks in the order they were registered, so the
        first one reads and the others report the same reading."""
        latest: list[StateReading] = []

        def fresh() -> StateReading:
            latest[:] = [read()]
            return latest[0]

        def current() -> StateReading:
            return latest[0] if latest else fresh()

        def per_breaker(reading: StateReading, value: Callable[[str, int], int]) -> Iterable[Observation]:
            for tenant, model, state, trips in reading.breakers:
                yield Observation(value(state, trips), {"ace.tenant": tenant, "gen_ai.request.model": model})

        def breakers(options: CallbackOptions) -> Iterable[Observation]:
            return per_breaker(fresh(), lambda state, _: BREAKER_LEVEL.get(state, 2))

        def trips(options: CallbackOptions) -> Iterable[Observation]:
            return per_breaker(current(), lambda _, count: count)

        def config_version(options: CallbackOptions) -> Iterable[Observation]:
            yield Observation(current().config_version)

        def store_health(options: CallbackOptions) -> Iterable[Observation]:
            reading = current()
            yield Observation(int(reading.store_healthy), {"ace.state.backend": reading.backend})

        meter = self._meter
        meter.create_observable_gauge(
            "ace.spec_decode.breaker_state",
            [breakers],
            unit="1",
            description="Acceptance breaker per (tenant, model): 0 closed, 1 half-open, 2 open",
        )
        meter.create_observable_counter(
            "ace.spec_decode.breaker_trips",
            [trips],
            unit="{trip}",
            description="Times the acceptance breaker tripped, per (tenant, model) while it is tracked",
        )
        meter.create_observable_gauge("ace.config.version", [config_version], description="The config version in force")
        meter.create_observable_gauge(
            "ace.state.healthy", [store_health], description="1 while the state store works (Redis: connected), else 0"
        )

    def counts(self) -> dict[str, dict[str, int]]:
        """Process-wide counts: {outcome: {reason: n}} for decisions ("rejected" for a bad override
        header), and {"error": {stage: n}} for internal errors."""
        with self._tally_lock:
            tally = list(self._tally.items())
        counts: dict[str, dict[str, int]] = {}
        for (kind, reason), n in sorted(tally):
            counts.setdefault(kind, {})[reason] = n
        return counts

    def _count(self, kind: str, reason: str) -> None:
        with self._tally_lock:
            self._tally[kind, reason] += 1

    def start(self, request: RequestView) -> tuple[Span | None, bool]:
        """(span to annotate or None, whether we own it and must end it): the current span when
        there is one, else a span of our own; None when our tracer is the API's no-op."""
        span = trace.get_current_span()
        if span.get_span_context().is_valid:
            return span, False
        now = time.monotonic()
        if now < self._noop_until:
            return None, False
        operation, model = operation_name(request.path), request.model
        span = self._tracer.start_span(f"{operation} {model}" if model else operation, kind=SpanKind.INTERNAL)
        if span is trace.INVALID_SPAN:  # what the no-op tracer returns; an SDK's spans have valid contexts
            self._noop_until = now + NOOP_TRACER_RECHECK_S
            return None, False
        return span, True

    def records(self, decision: Decision) -> bool:
        """Whether the decision's span records anything (a non-recording span ignores what it is
        told, its end included)."""
        span = decision.span
        return span is not None and span.is_recording()

    def decided(self, decision: Decision, annotate: bool = True) -> None:
        """Count the decision; with `annotate`, its attributes on its span now (else `finished`
        sets them)."""
        self._count(decision.outcome, decision.reason)
        self._decisions.add(1, _decision_labels(decision.outcome, decision.reason, decision.mode, decision.tenant_name))
        span = decision.span
        if annotate and span is not None and span.is_recording():
            span.set_attributes(_decision_attributes(decision))

    def rejected(self, span: Span | None, owned: bool, error: Exception) -> None:
        """A request refused with a client error (bad override header)."""
        self._count("rejected", type(error).__name__)
        self._decisions.add(1, {"ace.spec_decode.decision": "rejected", "ace.spec_decode.reason": type(error).__name__})
        if span is None:
            return
        if span.is_recording():
            span.set_attribute("error.type", type(error).__name__)
        if owned:
            span.end()

    def finished(
        self,
        decision: Decision,
        figures: AcceptanceFigures | None,
        breaker: BreakerView | None,
        outcome: str,
        sample: SpeedSample | None = None,
        garbage: bool = False,
        decision_attributes: bool = False,
    ) -> None:
        """The response is over; `outcome` is the observer's ("ok", "no_figures", "aborted"...).
        With `decision_attributes` the span gets the decision's attributes too, in the same call."""
        alpha = figures.alpha if figures is not None else None
        if alpha is not None:
            self._acceptance.record(alpha, _acceptance_labels(decision.outcome, decision.mode))
        elif figures is not None and figures.absurd:
            self._count("ignored", "absurd_figures")
        if decision.learns_speed:
            source = "ignored" if garbage else sample.source if sample is not None else "none"
            kind = "plain" if decision.arm == PLAIN_ARM else "speculative"
            self._speed_samples.add(1, _speed_labels(kind, source, decision.pool))
            if sample is not None and not garbage:
                self._decode_speed.record(sample.rate, _arm_labels(decision.model or "", decision.arm))
        span = decision.span
        if span is None:
            return
        if span.is_recording():
            attributes = _response_attributes(figures, breaker, outcome, sample)
            span.set_attributes({**_decision_attributes(decision), **attributes} if decision_attributes else attributes)
        if decision.owns_span:
            span.end()

    def ejected(self, pool: str) -> None:
        self._count("ejected", pool)
        self._ejections.add(1, {"ace.spec_decode.pool": pool})

    def error(self, stage: str) -> None:
        self._count("error", stage)
        self._errors.add(1, {"ace.stage": stage})


# The metric instruments' attributes: outcomes, reasons, modes and sources are few, so each
# combination is built once (the metrics SDK reads attributes, never writes them). Keyed by the
# Mode itself: its `.value` is a descriptor call, read here once per combination.
@lru_cache(maxsize=1024)
def _decision_labels(outcome: str, reason: str, mode: Mode, name: str | None) -> dict[str, AttributeValue]:
    """A named key's requests carry its name (a bounded set); unnamed ones no tenant label at all."""
    labels: dict[str, AttributeValue] = {
        "ace.spec_decode.decision": outcome,
        "ace.spec_decode.reason": reason,
        "ace.spec_decode.mode": mode.value,
    }
    if name is not None:
        labels["ace.tenant"] = name
    return labels


@lru_cache(maxsize=64)
def _acceptance_labels(outcome: str, mode: Mode) -> dict[str, AttributeValue]:
    return {"ace.spec_decode.decision": outcome, "ace.spec_decode.mode": mode.value}


@lru_cache(maxsize=256)
def _speed_labels(kind: str, source: str, pool: str) -> dict[str, AttributeValue]:
    return {"ace.spec_decode.arm_kind": kind, "ace.spec_decode.speed_source": source, "ace.spec_decode.pool": pool}


@lru_cache(maxsize=1024)
def _arm_labels(model: str, arm: str) -> dict[str, AttributeValue]:
    return {"gen_ai.request.model": model, "ace.spec_decode.arm": arm}


def _decision_attributes(decision: Decision) -> dict[str, AttributeValue]:
    attributes: dict[str, AttributeValue] = {
        "gen_ai.operation.name": operation_name(decision.path),
        "gen_ai.request.stream": decision.stream,
        "ace.spec_decode.mode": decision.mode.value,
        "ace.spec_decode.mode_source": decision.mode_source,
        "ace.spec_decode.decision": decision.outcome,
        "ace.spec_decode.reason": decision.reason,
        "ace.spec_decode.breaker_state": decision.breaker_state,
        "ace.spec_decode.canary": decision.canary,
        "ace.spec_decode.probe": decision.probe,
        "ace.tenant.hash": decision.tenant,
    }
    if decision.tenant_name is not None:
        attributes["ace.tenant.name"] = decision.tenant_name
    if decision.model is not None:
        attributes["gen_ai.request.model"] = decision.model
    if decision.temperature is not None:
        attributes["gen_ai.request.temperature"] = decision.temperature
    if decision.directive.enabled:
        attributes["ace.spec_decode.algorithm"] = decision.directive.algorithm
        attributes["ace.spec_decode.num_speculative_tokens"] = decision.directive.num_speculative_tokens
    if decision.arm:
        attributes["ace.spec_decode.arm"] = decision.arm
        attributes["ace.spec_decode.pool"] = decision.pool
    if decision.speedup is not None:
        attributes["ace.spec_decode.estimated_speedup"] = decision.speedup
    if decision.notes:
        attributes["ace.spec_decode.notes"] = list(decision.notes)
    return attributes


def _response_attributes(
    figures: AcceptanceFigures | None, breaker: BreakerView | None, outcome: str, sample: SpeedSample | None
) -> dict[str, AttributeValue]:
    attributes: dict[str, AttributeValue] = {"ace.spec_decode.response": outcome}
    if sample is not None:
        attributes["ace.spec_decode.decode_tokens_per_s"] = sample.rate
        attributes["ace.spec_decode.speed_source"] = sample.source
    if figures is not None:
        if figures.absurd:
            attributes["ace.spec_decode.figures"] = "absurd"
        for name, value in (
            ("gen_ai.usage.output_tokens", figures.output_tokens),
            ("ace.spec_decode.acceptance_rate", figures.alpha),
            ("ace.spec_decode.accepted_per_step", figures.tau),
        ):
            if value is not None:
                attributes[name] = value
    if breaker is not None and breaker.rolling_alpha is not None:
        attributes["ace.spec_decode.rolling_alpha"] = breaker.rolling_alpha
    return attributes
