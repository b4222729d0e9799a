"""What a status page shows, as JSON-ready data (`AceController.status()`).

Per (tenant, model), most recently used first: the breaker, the speed estimate of every arm, the
arm that traffic outside exploration goes to now, and the gates' verdicts by reason. Around them:
the config in force (version, when, from where) and the last config that was refused, the state
store's own health (whatever its `health()` reports), and process-wide decision counts. Tenants
appear as the hashed ids the controller uses; a raw key is never part of this state.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..config import AceConfig, Settings, tenant_of
from ..decide.load import base_arm
from ..directive import BASELINE_POOL, PLAIN_ARM
from ..version import __version__
from .pools import warnings as pool_warnings

if TYPE_CHECKING:
    from ..decide.prior import PriorView
    from ..state import ArmView, BreakerView, StateStore, TenantView
    from .reload import ConfigRecord, Rejection

CLOSED = "closed"


def status_report(
    config: AceConfig,
    record: ConfigRecord,
    rejection: Rejection | None,
    rejections: int,
    store: StateStore,
    counts: Mapping[str, Mapping[str, int]],
    now: float,
    limit: int,
    watchers: Sequence[Mapping[str, Any]] = (),
    pools: Mapping[str, Mapping[str, Any]] | None = None,
) -> dict[str, Any]:
    """The status document; `now` is the controller's clock (the store's time base); `watchers`
    the health of the config files followed (reload.ConfigFile.health)."""
    by_tenant = {tenant_of(digest): settings for digest, settings in config.key_table.items()}
    tenants = store.snapshot(config.gate, now, limit)
    return {
        "ace_mw": __version__,
        "generated_at": time.time(),
        "config": {
            "version": record.version,
            "loaded_at": record.loaded_at,
            "source": record.source,
            "mode": config.mode.value,
            "policy": config.gate.policy,
            "adapter": config.adapter,
            "rejections": rejections,
            "last_rejection": None
            if rejection is None
            else {
                "at": rejection.at,
                "source": rejection.source,
                "error": rejection.error,
                "after_current": rejection.at >= record.loaded_at,  # the latest attempt did not apply
            },
            "watchers": [dict(watcher) for watcher in watchers],
        },
        "store": dict(store.health()),
        "pools": {name: dict(row) for name, row in (pools or {}).items()},
        "warnings": pool_warnings(pools or {}),
        "decisions": {outcome: dict(reasons) for outcome, reasons in counts.items()},
        "priors": [_prior(prior) for prior in store.priors(config.gate, now)] if hasattr(store, "priors") else [],
        "tenants": [_tenant(view, by_tenant.get(view.key[0], config.org), config, now) for view in tenants],
    }


def _tenant(view: TenantView, settings: Settings, config: AceConfig, now: float) -> dict[str, Any]:
    tenant, model = view.key
    arms = _arms(view.arms, settings, config)
    chosen, speedup, why = _chosen(view, settings.arms, config)
    return {
        "tenant": tenant,
        "name": settings.name,
        "model": model,
        "breaker": _breaker(view.breaker, now),
        "arms": arms,
        "chosen_arm": chosen,
        "speedup": speedup,
        "chosen_reason": why,
        "decisions": dict(view.decisions),
        "unread": view.unread,
    }


def _prior(prior: PriorView) -> dict[str, Any]:
    return {
        "model": prior.model,
        "arm": prior.arm,
        "speedup": prior.speedup,
        "spread": prior.spread,
        "tenants": prior.tenants,
        "samples": prior.samples,
    }


def _breaker(breaker: BreakerView, now: float) -> dict[str, Any]:
    return {
        "state": breaker.state,
        "rolling_alpha": breaker.rolling_alpha,
        "samples": breaker.samples,
        "trips": breaker.trips,
        "probes_in_flight": breaker.probes,
        "reopens_in_s": max(0.0, breaker.open_until - now) if breaker.state != CLOSED else None,
    }


def _arms(views: Mapping[str, ArmView], settings: Settings, config: AceConfig) -> list[dict[str, Any]]:
    """Every arm of the tenant's settings in order (measured or not), with the pool it runs on,
    then any other arm the store still holds estimates for (from an earlier config)."""
    labels = settings.arms
    pools = {PLAIN_ARM: BASELINE_POOL, **{c.label: c.route for c in settings.candidates}}
    rows = []
    for label in (*labels, *(label for label in views if label not in labels)):
        view = views.get(label)
        measured = view is not None and view.tokens_per_s is not None and view.samples >= config.gate.speed_min_samples
        arm, load = base_arm(label)
        rows.append(
            {
                "arm": label,
                "load": load,  # the pool's requests in flight this estimate is for (decide/load.py)
                "pool": pools.get(arm),
                "tokens_per_s": view.tokens_per_s if view is not None else None,
                "samples": view.samples if view is not None else 0.0,
                "age_s": view.age_s if view is not None else None,
                "misses": view.misses if view is not None else 0,
                "measured": measured,
                "current": arm in labels,
            }
        )
    return rows


def _chosen(view: TenantView, labels: tuple[str, ...], config: AceConfig) -> tuple[str, float | None, str | None]:
    """(the arm a request outside exploration and probing runs now, its estimated speed over
    plain decoding where one is known, why). A breaker that is not closed keeps it on plain."""
    if view.breaker.state != CLOSED:
        return labels[0], None, "breaker_open"
    if config.gate.policy == "acceptance" and len(labels) > 1:
        return labels[1], None, "ok"
    if view.chosen is None or view.chosen[0] not in labels:  # not admitted since the config changed
        return (labels[1] if len(labels) > 1 else labels[0]), None, None
    return view.chosen[0], view.chosen[2], view.chosen[1]
