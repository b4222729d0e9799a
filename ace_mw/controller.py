"""The control plane's one entry point: decide, inject, observe.

One request, `begin(view)`, the one path every integration and the public API take: `decide`
resolves the mode and runs the gates (decide/decider.py: temperature, acceptance breaker, speed
policy), `inject` lets the engine adapter rewrite the body (and carries the decision out: "off"
where that fails), `observe` returns the response observer whose figures and timing feed the state
store (breaker and speed estimates) and telemetry. The controller holds only shared, thread-safe
things (the config reference, the state store, telemetry); everything about one request lives in
its `Decision` and its observer. It fails open: apart from a `ClientError` (a bad override header, an
ambiguous identity), an internal fault
yields an "off" decision (reason "internal_error") or an untouched body, logged and counted.

The config is swapped at run time by `update` (or `reload`, which records a config that fails
validation); `from_file` builds a controller that follows its file (reload.py). `status()` is
everything a status page shows, for HTTP and gRPC-only servers alike.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

from .acceptance import AcceptanceFigures
from .adapters import get_adapter
from .adapters.base import NO_INJECTION, EngineAdapter, Injection
from .config import AceConfig, tenant_of
from .decide.decider import Decider, stepped_aside, untracked
from .decide.gate import breaker_judges
from .decide.load import InFlight
from .decide.samples import StreamTiming, response_sample
from .decision import Decision
from .directive import PLAIN_ARM
from .errors import AmbiguousIdentity, ClientError, ConfigError
from .observe.observer import ABORTED, NO_FIGURES, SERVER_ERROR, ResponseObserver
from .observe.observer import OK as OBSERVED_OK
from .operate.arm_acceptance import ArmAcceptance
from .operate.outliers import PoolHealth
from .operate.pools import PoolProbe
from .operate.reload import DEFAULT_RELOAD_INTERVAL_S, ConfigFile, ConfigRecord, Rejection
from .operate.status import status_report
from .operate.telemetry import StateReading, Telemetry
from .request import RequestView
from .state import StateStore, open_store
from .vocabulary import REWRITTEN, Reason

logger = logging.getLogger("ace_mw")

# Observer outcomes of a response that completed; one that broke off teaches no speed.
_COMPLETE = (OBSERVED_OK, NO_FIGURES)
# (tenant, model) pairs whose breaker the metrics report, most recently used first: a bound on series.
METRIC_TENANTS = 1000


class Injected(NamedTuple):
    """A request's body after `AceController.inject`, and the decision as carried out."""

    decision: Decision
    body: dict[str, Any]
    injection: Injection


class Begun(NamedTuple):
    """One request after `AceController.begin`: the decision as carried out, and the observer of
    its response (None when nothing reads it)."""

    decision: Decision
    observer: ResponseObserver | None


class AceController:
    def __init__(
        self,
        config: AceConfig,
        *,
        store: StateStore | None = None,
        tracer_provider: Any = None,
        meter_provider: Any = None,
        clock: Callable[[], float] = time.monotonic,
        source: str = "code",
    ) -> None:
        self._config = _checked(config)
        self._record = ConfigRecord(1, time.time(), source)
        self._rejection: Rejection | None = None
        self._rejections = 0
        self._swap_lock = threading.Lock()  # writers only (file watcher, admin endpoint, code)
        self._files: list[ConfigFile] = []
        self._clock = clock
        # A store passed in wins; else the config's `state` section names one (memory or redis).
        self._store: StateStore = store if store is not None else open_store(self._config.state, clock)
        self._telemetry = Telemetry(tracer_provider, meter_provider)
        self._telemetry.observe(self._state_reading)
        self._health = PoolHealth(lambda: self._config.upstream, clock)
        self._arm_acceptance = ArmAcceptance()
        self._in_flight = InFlight(clock)
        self._decider = Decider(self._store, self._in_flight, self._health.ejected, clock)
        health = self._health
        self._pools = PoolProbe(lambda: self._config, clock, ejected=health.ejected, on_answer=health.reinstate)
        # A shared store syncs from now on, whatever the app does with its lifespan: a replica's
        # first request must find the fleet's state already read (or wait for it, wait_synced).
        self._store.start()

    @classmethod
    def from_file(
        cls, path: str | os.PathLike[str], *, reload_interval_s: float | None = DEFAULT_RELOAD_INTERVAL_S, **kwargs: Any
    ) -> AceController:
        """A controller running the config in `path` (TOML or JSON; a ConfigError if it is bad) and,
        unless `reload_interval_s` is None, following every saved change of the file: polled every
        `reload_interval_s` seconds from a daemon thread, applied once it has settled (within two
        intervals), refused and recorded when invalid. `close()` stops the polling."""
        file = ConfigFile(path)
        controller = cls(file.load(), source=file.source, **kwargs)
        if reload_interval_s is not None:
            file.start(controller, reload_interval_s)
            controller._files.append(file)
        return controller

    @property
    def config(self) -> AceConfig:
        return self._config

    @property
    def config_record(self) -> ConfigRecord:
        """Which config is in force: version, when it was swapped in, where it came from."""
        return self._record

    def _state_reading(self) -> StateReading:
        """The state the metrics report, read at collection: breakers of the most recently used
        (tenant, model) pairs, named where the key has a name."""
        config = self._config
        names = {tenant_of(digest): settings.name for digest, settings in config.key_table.items() if settings.name}
        views = self._store.snapshot(config.gate, self._clock(), METRIC_TENANTS)
        breakers = [(names.get(v.key[0], v.key[0]), v.key[1], v.breaker.state, v.breaker.trips) for v in views]
        health = self._store.health()
        healthy = health.get("connected", True) and not health.get("degraded", False)
        return StateReading(breakers, str(health.get("backend", "custom")), bool(healthy), self._record.version)

    @property
    def last_rejection(self) -> Rejection | None:
        """The last config that failed validation (the one before it stayed in force), if any."""
        return self._rejection

    @property
    def store(self) -> StateStore:
        return self._store

    def update(self, config: AceConfig, source: str = "code") -> ConfigRecord:
        """Swap the config atomically (one reference assignment); in-flight requests keep theirs.
        Returns the new record (the version goes up by one). The store stays the one built at
        start: a changed `state` section applies at restart."""
        checked = _checked(config)
        if checked.state != self._config.state:
            logger.warning("ace-mw: the `state` section changed; the state store changes at restart only")
        with self._swap_lock:
            self._config = checked
            self._record = record = ConfigRecord(self._record.version + 1, time.time(), source)
        logger.warning("ace-mw config version %d in force (from %s)", record.version, source)
        return record

    def reload(self, load: Callable[[], AceConfig], source: str) -> ConfigRecord:
        """Build a config with `load` and swap it in. A ConfigError from `load` is recorded as the
        last rejection (status page, log) and raised; the config in force stays."""
        try:
            config = load()
        except ConfigError as exc:
            self.reject(source, str(exc))
            raise
        return self.update(config, source)

    def reject(self, source: str, error: str) -> Rejection:
        """Record a config from `source` that could not be loaded (`error`: the ConfigError message)."""
        rejection = Rejection(time.time(), source, error)
        with self._swap_lock:
            self._rejection = rejection
            self._rejections += 1
        logger.warning(
            "ace-mw refused the configuration from %s, version %d stays: %s", source, self._record.version, error
        )
        return rejection

    def status(self, limit: int = 100) -> dict[str, Any]:
        """Everything the status page shows, as JSON-ready data: the config in force and the last
        rejection, the store's health, process-wide decision counts, and the `limit` most recently
        used (tenant, model) entries (hashed tenants; breaker, arm estimates, chosen arm, verdicts)."""
        report = status_report(
            self._config,
            self._record,
            self._rejection,
            self._rejections,
            self._store,
            self._telemetry.counts(),
            self._clock(),
            limit,
            [file.health() for file in self._files],
            self._pools.report(self._health.report()),
        )
        self._arm_acceptance.annotate(report["tenants"])
        report["load"] = self._in_flight.report()
        return report

    def pool_health(self) -> dict[str, dict[str, Any]]:
        """Per pool that has failed: whether it is ejected now, and its failures (outliers.py)."""
        return self._health.report()

    def start(self) -> None:
        """Start asking the config's pools what they are (an adapter with a probe: llama.cpp's
        /props), and the store's background work if it is not running (the controller starts it
        when built). AceSpecDec calls this on lifespan startup. With `state.required`, raises
        StoreUnavailable when the shared store cannot be reached."""
        check = getattr(self._store, "check", None)
        if self._config.state.required and check is not None:
            check()
        self._store.start()
        self._pools.start()

    @property
    def synced(self) -> bool:
        """Whether this replica has read the fleet's state (always, for a store that shares
        nothing); until then an integration calls `wait_synced` before its first decisions."""
        return self._store.synced

    def wait_synced(self) -> None:
        """Until the store's first sync is over, `state.first_sync_wait_s` at most (blocks: ASGI
        and gRPC aio run it in a worker thread, at a replica's start only). After the bound,
        requests are decided on this replica's own state (fail open) and nothing waits again."""
        wait = self._config.state.first_sync_wait_s
        if not self._store.wait_synced(wait):
            logger.warning(
                "ace-mw: the first sync of the shared state did not finish within %.2f s "
                "(state.first_sync_wait_s); deciding on this replica's own state meanwhile",
                wait,
            )

    def close(self) -> None:
        """Stop following config files and stop the store's background work, flushing what it has
        not shared (blocks briefly); the config in force stays. AceSpecDec calls this on lifespan
        shutdown; gRPC servers call it after `server.stop()`."""
        files, self._files = self._files, []
        for file in files:
            file.stop()
        self._pools.close()
        self._store.close()

    # -- decide ------------------------------------------------------------------------------------

    def begin(self, request: RequestView, write: Callable[[dict[str, Any]], object] | None = None) -> Begun:
        """One request up to its response: decide, inject, and the observer of the response, each
        failing open here, once, for every integration. `write(new_body)` puts an injected body on
        the request (re-encodes it, sets message fields); it is called only when the adapter
        changed the body. When injecting or writing fails, the request goes out as the client sent
        it, and the decision says so (`inject`). Raises a ClientError (a bad override header, an
        ambiguous identity) and nothing else."""
        decision, injection = self._decision(request), NO_INJECTION
        if request.body is not None:
            decision, _, injection = self.inject(decision, request.body, write)
        try:
            observer = self._observer(decision, injection, annotates=True)
        except Exception:
            self.fail_open("observe")
            observer = None
        # A recording span always has an observer: the decision's attributes go on it with the
        # response's, in one call when the response ends, off the request's path (an SDK's
        # set_attributes of the decision's sixteen costs about as much as the decision itself).
        self._told(decision, annotate=observer is None)
        return Begun(decision, observer)

    def decide(self, request: RequestView) -> Decision:
        """The decision alone, told to telemetry (`begin` is decide, inject and observe together,
        telling the decision as carried out). Raises a ClientError (a bad override header, an
        ambiguous identity) and nothing else."""
        decision = self._decision(request)
        self._told(decision)
        return decision

    def _decision(self, request: RequestView) -> Decision:
        config = self._config
        if not config.handles(request.method, request.path):
            return untracked(config, request, Reason.ROUTE_NOT_HANDLED)
        if not self._store.synced:  # a replica's first requests (the integrations wait off-loop)
            self.wait_synced()
        span, owned = None, False
        try:
            span, owned = self._telemetry.start(request)
            if request.conflicts:
                raise AmbiguousIdentity(sorted(request.conflicts))
            return self._decider.decide(config, request, span, owned)
        except ClientError as exc:
            self._telemetry.rejected(span, owned, exc)
            raise
        except Exception:
            self.fail_open("decide")
            return untracked(config, request, Reason.INTERNAL_ERROR, span, owned)

    def _told(self, decision: Decision, annotate: bool = True) -> None:
        try:
            self._telemetry.decided(decision, annotate)
        except Exception:
            self.fail_open("telemetry")

    # -- inject ------------------------------------------------------------------------------------

    def inject(
        self, decision: Decision, body: dict[str, Any], write: Callable[[dict[str, Any]], object] | None = None
    ) -> Injected:
        """The body to forward (a new dict; `body` is never mutated), what the adapter forced, and
        the decision as carried out; `write(new_body)` as for `begin`. Shadow and off decisions
        leave the body untouched. When the adapter or `write` fails, the body goes out as the
        client sent it and the decision says so: outcome "off", reason "internal_error" (headers,
        telemetry and learning alike; a probe slot it held is released)."""
        if decision.outcome not in REWRITTEN:
            return Injected(decision, body, NO_INJECTION)
        try:
            new, injection = get_adapter(decision.config.adapter).inject(body, decision.directive)
            if write is not None and new is not body and new != body:
                write(new)
            return Injected(decision, new, injection)
        except Exception:
            self.fail_open("inject")
        if decision.probe:
            try:
                self._store.release(decision.key)
            except Exception:
                self.fail_open("release")
        return Injected(stepped_aside(decision), body, NO_INJECTION)

    def adapter(self, config: AceConfig | None = None) -> EngineAdapter:
        """The engine adapter of `config` (default: the current one)."""
        return get_adapter((config or self._config).adapter)

    # -- observe -----------------------------------------------------------------------------------

    def observe(self, decision: Decision, injection: Injection | None = None) -> ResponseObserver | None:
        """A per-response observer; its `finish` feeds the breaker, the speed estimates and telemetry,
        and ends our span. Call it for every decided request (also shadow and off) so probes and
        spans are released. None when the response has nothing to tell: not read (past
        `gate.max_measured_per_s`; never a probe), nothing forced into it, and no recording span
        to annotate or end; the bulk of a busy key's traffic then skips the observer altogether."""
        return self._observer(decision, injection, annotates=False)

    def _observer(self, decision: Decision, injection: Injection | None, annotates: bool) -> ResponseObserver | None:
        """`observe`; with `annotates` its finish also sets the decision's span attributes (`begin`
        leaves them to the response's end)."""
        if (
            not decision.measured
            and not (injection and injection.forced)
            and not self._telemetry.records(decision)
            and not decision.config.pools  # a routed response says whether its pool served it
        ):
            return None

        def on_finish(figures: AcceptanceFigures | None, outcome: str, timing: StreamTiming | None) -> None:
            self._finished(decision, figures, outcome, timing, annotates)

        clock = self._clock if decision.learns_speed else None
        return ResponseObserver(
            self.adapter(decision.config), injection or NO_INJECTION, on_finish, clock=clock, reads=decision.measured
        )

    def _finished(
        self,
        decision: Decision,
        figures: AcceptanceFigures | None,
        outcome: str,
        timing: StreamTiming | None,
        annotates: bool = False,
    ) -> None:
        """The observer's verdict: learn acceptance (if the response describes speculation, done or
        would-be) and speed (if it ran on an arm of the speed policy), free a probe slot, annotate
        and end the span (with the decision's attributes too, where `begin` left them here)."""
        breaker, sample, garbage = None, None, False
        try:
            alpha = figures.alpha if figures is not None else None
            key = decision.key
            gate, now = decision.config.gate, self._clock()
            # The breaker judges the arm the tenant runs; a candidate explored on the side is the
            # speed policy's evidence alone (a slow drafter's low acceptance must not shut the
            # tenant's fast one off).
            # Under the speed policy, prompt lookup is judged by its speed alone (gate.breaker_judges).
            candidate = decision.arm not in ("", PLAIN_ARM)
            if (
                alpha is not None
                and candidate
                and decision.reason != Reason.EXPLORE
                and breaker_judges(decision.arm, gate.policy)
            ):
                breaker = self._store.record(key, alpha, probe=decision.probe, gate=gate, now=now)
            elif decision.probe:
                self._store.release(key)
            if alpha is not None and candidate:
                self._arm_acceptance.record(key[0], key[1], decision.arm, alpha, gate.decay)
            label = decision.arm_at_load or decision.arm
            if decision.config.pools:
                upstream = decision.config.upstream
                if upstream.load_aware and label:
                    label = self._in_flight.finished(decision.pool, decision, label, upstream.load_scope)
                else:
                    self._in_flight.end(decision.pool, decision)
                if decision.outcome in REWRITTEN:
                    self._pools.note(decision.pool, outcome)
                if outcome != ABORTED and self._health.record(decision.pool, outcome == SERVER_ERROR):
                    logger.warning("ace-mw: pool %s ejected after failing", decision.pool)
                    self._telemetry.ejected(decision.pool)
            if decision.learns_speed and outcome in _COMPLETE:
                # absurd figures teach nothing, the engine's decode time beside them included
                absurd = figures is not None and figures.absurd
                sample, garbage = (None, True) if absurd else response_sample(figures, timing, gate.speed_counts)
                self._store.record_speed(key, label, sample, gate, now)
        except Exception:
            self.fail_open("observe")
        try:
            self._telemetry.finished(decision, figures, breaker, outcome, sample, garbage, annotates)
        except Exception:
            self.fail_open("telemetry")

    def fail_open(self, stage: str, what: str | None = None) -> None:
        """One fault of ours that the request survives, in the controller or in an integration:
        logged (with the exception being handled, or `what` as a warning) and counted once, in
        `ace.spec_decode.errors` and the status page's error counts (`fail_opens`)."""
        if what is None:
            logger.exception("ace-mw internal error in %s; the request proceeds unmodified", stage)
        else:
            logger.warning("ace-mw %s (%s); the response went on unmodified", what, stage)
        try:
            self._telemetry.error(stage)
        except Exception:  # a broken meter must not turn a fail-open into a failure
            pass

    def fail_opens(self) -> dict[str, int]:
        """This process's fail-opens by stage, of the controller and every integration on it."""
        return self._telemetry.counts().get("error", {})


def _checked(config: Any) -> AceConfig:
    if not isinstance(config, AceConfig):
        raise TypeError(f"config must be an AceConfig, got {type(config).__name__}")
    return config
