"""Where the control loop's state lives: a store keyed by (tenant, model), in this process
(memory.py) or shared by a fleet of replicas through Redis (redis_store.py, merging by fleet.py's
rules). `open_store` builds the one a config's `state` section names; the redis extra is needed only
for the shared one."""

from __future__ import annotations

from collections.abc import Callable

from ..config import StateConfig
from ..decide.tenant import BREAKER_OPEN, PROBE, SAMPLED, Admission, ArmView, TenantState
from ..errors import ConfigError
from .memory import BreakerKey, BreakerView, InMemoryStateStore, StateStore, TenantView, breaker_view

__all__ = [
    "BREAKER_OPEN",
    "PROBE",
    "SAMPLED",
    "Admission",
    "ArmView",
    "BreakerKey",
    "BreakerView",
    "InMemoryStateStore",
    "StateStore",
    "TenantState",
    "TenantView",
    "breaker_view",
    "open_store",
]


def open_store(config: StateConfig, clock: Callable[[], float]) -> StateStore:
    """The store `config` names; `clock` is the controller's (a shared store converts its times)."""
    if config.backend == "redis":
        try:
            from .redis_store import RedisStateStore
        except ImportError as exc:
            problem = f"'redis' needs the redis extra: pip install 'ace-mw[redis]' ({exc})"
            raise ConfigError("state.backend", problem) from exc
        return RedisStateStore(config, clock=clock)
    return InMemoryStateStore()
