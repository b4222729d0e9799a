"""The acceptance of each arm a tenant ran, for the status page.

The breaker keeps one rolling acceptance per (tenant, model): that of the arm the tenant runs, which
is what it judges. An operator comparing candidates wants each one's own, explored ones included:
this keeps a rolling rate per (tenant, model, arm), with the breaker's half-life (`gate.
ema_half_life` responses), from this replica's responses only (it is a view, shared with nobody and
deciding nothing).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

MAX_TRACKED = 10_000  # (tenant, model) entries, least recently used dropped first


class ArmAcceptance:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        # (tenant, model) -> arm -> (rolling acceptance, responses); least recently used first
        self._rates: OrderedDict[tuple[str, str], dict[str, tuple[float, int]]] = OrderedDict()

    def record(self, tenant: str, model: str, arm: str, alpha: float, decay: float) -> None:
        """One response of `arm` accepted `alpha` of its drafts; `decay` is the breaker's
        per-response factor (gate.decay)."""
        key = (tenant, model)
        with self._lock:
            arms = self._rates.pop(key, None)
            if arms is None:
                arms = {}
                if len(self._rates) >= MAX_TRACKED:
                    self._rates.popitem(last=False)
            self._rates[key] = arms
            found = arms.get(arm)
            arms[arm] = (alpha, 1) if found is None else (found[0] * decay + alpha * (1.0 - decay), found[1] + 1)

    def of(self, tenant: str, model: str) -> dict[str, tuple[float, int]]:
        """arm -> (rolling acceptance, responses) for one (tenant, model)."""
        with self._lock:
            return dict(self._rates.get((tenant, model), {}))

    def annotate(self, tenants: Iterable[dict[str, Any]]) -> None:
        """Add each arm's `acceptance` and `acceptance_responses` to the status page's tenant rows."""
        for row in tenants:
            accepted = self.of(row["tenant"], row["model"])
            for arm in row["arms"]:
                arm["acceptance"], arm["acceptance_responses"] = accepted.get(arm["arm"], (None, 0))
