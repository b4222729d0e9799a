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

MAX_TRACKED = 10_000  # (tenant, model, arm) entries, least recently used dropped first


class ArmAcceptance:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._rates: OrderedDict[tuple[str, str, str], tuple[float, int]] = OrderedDict()

    def record(self, tenant: str, model: str, arm: str, alpha: float, decay: float) -> None:
        """One response of `arm` accepted `alpha` of its drafts; `decay` is the breaker's
        per-response factor (gate.decay)."""
        key = (tenant, model, arm)
        with self._lock:
            found = self._rates.pop(key, None)
            if found is None:
                self._rates[key] = (alpha, 1)
                if len(self._rates) > MAX_TRACKED:
                    self._rates.popitem(last=False)
            else:
                rate, count = found
                self._rates[key] = (rate * decay + alpha * (1.0 - decay), count + 1)

    def of(self, tenant: str, model: str) -> dict[str, tuple[float, int]]:
        """arm -> (rolling acceptance, responses) for one (tenant, model)."""
        with self._lock:
            return {arm: value for (t, m, arm), value in self._rates.items() if t == tenant and m == model}

    def annotate(self, tenants: Iterable[dict[str, Any]]) -> None:
        """Add each arm's `acceptance` and `acceptance_responses` to the status page's tenant rows."""
        for row in tenants:
            accepted = self.of(row["tenant"], row["model"])
            for arm in row["arms"]:
                arm["acceptance"], arm["acceptance_responses"] = accepted.get(arm["arm"], (None, 0))
