"""The config's sections below the tree's root (config.py): speculative parameters, the gates,
the state store, the upstream pools, the admin endpoints; and the field checks every section runs
on construction (each returns the normalised value or raises ConfigError naming the field path)."""

from __future__ import annotations

import difflib
import hashlib
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, TypeVar

from .directive import ALGORITHMS, MAX_SPECULATIVE_TOKENS, SPECULATIVE_POOL
from .errors import ConfigError

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

POLICIES = ("speed", "acceptance")
BACKENDS = ("memory", "redis")
REDIS_SCHEMES = ("redis://", "rediss://", "unix://")
KEY_HASH_PREFIX = "sha256:"
POOL_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
# The admin token is checked online with no lockout, so it must be a secret nobody can guess:
# 32 characters of `secrets.token_urlsafe` carry about 190 bits.
MIN_ADMIN_TOKEN_LENGTH = 32
MAX_TEMPERATURE_BANDS = 8  # bounds of gate.temperature_bands: each band is a state per tenant

Section = TypeVar("Section", bound="DataclassInstance")


# -- field checks: each returns the normalised value or raises ConfigError(path, ...) --------------


def number(path: str, value: Any, lo: float, hi: float = math.inf, *, integer: bool = False) -> Any:
    wanted = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, wanted):
        raise ConfigError(path, f"must be {'an integer' if integer else 'a number'}, got {value!r}")
    if not (lo <= value <= hi):  # also rejects NaN
        bounds = f"in [{lo:g}, {hi:g}]" if hi != math.inf else f">= {lo:g}"
        raise ConfigError(path, f"must be {bounds}, got {value!r}")
    return value if integer else float(value)


def bounds(path: str, value: Any) -> tuple[float, ...]:
    """Temperatures that part the state (`gate.temperature_bands`): rising, each above 0, at most
    MAX_TEMPERATURE_BANDS. One at or above the temperature threshold parts nothing (no request
    hotter than the threshold is admitted), so it is allowed: a threshold moved down keeps a valid config."""
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise ConfigError(path, f"must be a list of temperatures, got {value!r}")
    found = tuple(number(path, bound, 0) for bound in value)
    if len(found) > MAX_TEMPERATURE_BANDS:
        raise ConfigError(path, f"at most {MAX_TEMPERATURE_BANDS} bounds, got {len(found)}")
    if any(b <= a for a, b in zip((0.0, *found), found, strict=False)):
        raise ConfigError(path, f"must rise strictly from above 0, got {list(found)}")
    return found


def optional_bool(path: str, value: Any) -> bool | None:
    if value is not None and not isinstance(value, bool):
        raise ConfigError(path, f"must be true or false, got {value!r}")
    return value


def tree_choices(path: str, value: Any) -> tuple[tuple[int, ...], ...] | None:
    if value is None:
        return None
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise ConfigError(path, f"must be a list of paths (lists of integers), got {value!r}")
    tree = []
    for node in value:
        if isinstance(node, (str, bytes)) or not hasattr(node, "__iter__") or not node:
            raise ConfigError(path, f"every path must be a non-empty list of integers, got {node!r}")
        tree.append(tuple(number(path, choice, 0, integer=True) for choice in node))
    if not tree:
        raise ConfigError(path, "must not be empty (omit it for the engine's default tree)")
    return tuple(tree)


def join_path(prefix: str, path: str) -> str:
    return f"{prefix}.{path}" if prefix and path else prefix or path


def section(cls: type[Section], value: Any, path: str) -> Section:
    """Build a nested dataclass from a mapping, rejecting unknown fields (typos fail loudly)."""
    if isinstance(value, cls):
        return value
    if not isinstance(value, Mapping):
        raise ConfigError(path, f"must be a table/object, got {type(value).__name__}")
    known = {f.name for f in fields(cls) if f.init}
    for name in value:
        if name not in known:
            raise ConfigError(join_path(path, str(name)), unknown_field(str(name), known))
    return cls(**value)


def unknown_field(name: str, known: Iterable[str]) -> str:
    """The problem text for a field nobody defines: the closest known one, or the few there are."""
    known = sorted(known)
    close = difflib.get_close_matches(name.lower(), known, n=1, cutoff=0.6)
    if close:
        return f"unknown field; did you mean {close[0]!r}?"
    listed = ", ".join(known) if len(known) <= 8 else ", ".join(known[:8]) + f", ... ({len(known)} in all)"
    return f"unknown field (known: {listed})"


# -- sections --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SpeculativeParams:
    """What to ask the engine for when speculation is applied."""

    algorithm: str = "eagle_2"
    num_speculative_tokens: int = 5
    draft_model: str | None = None
    tree_choices: tuple[tuple[int, ...], ...] | None = None
    pool: str | None = None  # the upstream pool this candidate runs on (a name in `pools`); None: "speculative"

    def __post_init__(self) -> None:
        if self.algorithm not in ALGORITHMS:
            raise ConfigError(
                "speculative.algorithm", f"must be one of {', '.join(ALGORITHMS)}, got {self.algorithm!r}"
            )
        number(
            "speculative.num_speculative_tokens", self.num_speculative_tokens, 1, MAX_SPECULATIVE_TOKENS, integer=True
        )
        if self.draft_model is not None and (not isinstance(self.draft_model, str) or not self.draft_model):
            raise ConfigError("speculative.draft_model", f"must be a non-empty string, got {self.draft_model!r}")
        object.__setattr__(self, "tree_choices", tree_choices("speculative.tree_choices", self.tree_choices))
        if self.pool is not None and (not isinstance(self.pool, str) or not self.pool):
            raise ConfigError("speculative.pool", f"must be a non-empty pool name, got {self.pool!r}")

    @property
    def label(self) -> str:
        """A short stable name of this candidate: its arm's key in the speed estimates (with
        `@pool` when it names one: the same algorithm on two servers is two arms)."""
        label = f"{self.algorithm}/k{self.num_speculative_tokens}"
        if self.draft_model is not None:
            label += f"/{self.draft_model}"
        if self.tree_choices is not None:
            label += f"/tree{len(self.tree_choices)}"
        if self.pool is not None:
            label += f"@{self.pool}"
        return label

    @property
    def route(self) -> str:
        """The pool its requests go to."""
        return self.pool or SPECULATIVE_POOL


@dataclass(frozen=True)
class GateConfig:
    """Temperature gate, acceptance circuit breaker and speed policy (org level only)."""

    policy: str = "speed"  # "speed": the measured-fastest arm; "acceptance": always the first candidate
    temperature_threshold: float = 0.70  # T > threshold suppresses speculation
    default_temperature: float = 1.0  # assumed when the body has no temperature (OpenAI's default)
    # Temperatures that part a tenant's state: drafts are accepted less the hotter a request samples,
    # so the breaker, the speed estimates and the read budget are kept per band: T <= 0.5 and
    # 0.5 < T <= threshold by default (decide/gate.py, `state_model`). Empty: one for every temperature.
    temperature_bands: tuple[float, ...] = (0.5,)
    alpha_floor: float = 0.55  # CLOSED -> OPEN when the rolling alpha falls below it
    reenable_threshold: float = 0.65  # HALF_OPEN -> CLOSED only at or above it (hysteresis)
    ema_half_life: float = 20.0  # in responses: a sample's weight halves after this many more
    min_samples: int = 10  # no trip before this many responses since the last reset
    min_probe_samples: int = 5  # probe responses needed before HALF_OPEN may re-close or re-open
    cooldown_s: float = 30.0  # first OPEN period
    cooldown_growth: float = 2.0  # each consecutive trip multiplies the cooldown by this
    max_cooldown_s: float = 600.0
    probe_fraction: float = 0.02  # sticky share of traffic that still speculates while OPEN
    max_concurrent_probes: int = 2  # probes in flight per (tenant, model), OPEN and HALF_OPEN alike
    probe_timeout_s: float = 300.0  # a probe slot not released after this long is presumed lost
    max_tracked_tenants: int = 100_000  # LRU cap on (tenant, model) entries (breaker and speed estimates)
    explore_fraction: float = 0.05  # sticky share of traffic sent to other arms once every arm is measured
    explore_fraction_unmeasured: float = 0.5  # the same while some arm lacks fresh evidence
    speed_min_samples: float = 3.0  # (decayed) samples before an arm's speed counts as measured
    speed_half_life: float = 20.0  # in responses of the arm: a sample's weight halves after this many more
    speed_half_life_s: float = 600.0  # and after this many seconds: idle estimates go stale
    speed_margin: float = 0.02  # speculation must beat plain decoding by this fraction to be chosen
    speed_max_misses: int = 8  # responses in a row without a speed figure before an arm stops claiming exploration
    # What a speed sample covers: "decode" (tokens after the first over the time after it: prefill
    # and queueing never count) or "request" (every token over the whole request's time, where the
    # engine reports its time to the first token: vLLM, learnt at the tenant's usual prompt length:
    # decide/samples.RequestShape): for arms whose prefill costs differ.
    speed_counts: str = "decode"
    # The most samples one tenant weighs in its model's pooled prior of an arm (0: no pooled prior,
    # every tenant learns alone).
    prior_tenant_weight: float = 5.0
    # Responses per second (per (tenant, model), per process) the loop reads, breaker probes aside;
    # the rest pass unread (no forced usage, no per-chunk work; no exploration). inf: all of them.
    max_measured_per_s: float = 20.0
    decay: float = field(init=False, repr=False, compare=False)  # per-sample EMA factor of the breaker
    speed_decay: float = field(init=False, repr=False, compare=False)  # per-sample factor of speed estimates

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ConfigError("gate.policy", f"unknown policy {self.policy!r}: expected 'speed' or 'acceptance'")
        number("gate.temperature_threshold", self.temperature_threshold, 0)
        number("gate.default_temperature", self.default_temperature, 0)
        object.__setattr__(self, "temperature_bands", bounds("gate.temperature_bands", self.temperature_bands))
        number("gate.alpha_floor", self.alpha_floor, 0, 1)
        number("gate.reenable_threshold", self.reenable_threshold, 0, 1)
        if self.reenable_threshold < self.alpha_floor:
            raise ConfigError(
                "gate.reenable_threshold",
                f"must be >= gate.alpha_floor ({self.alpha_floor}), got {self.reenable_threshold}",
            )
        number("gate.ema_half_life", self.ema_half_life, 1e-9)
        number("gate.min_samples", self.min_samples, 1, integer=True)
        number("gate.min_probe_samples", self.min_probe_samples, 1, integer=True)
        number("gate.cooldown_s", self.cooldown_s, 0)
        number("gate.cooldown_growth", self.cooldown_growth, 1)
        number("gate.max_cooldown_s", self.max_cooldown_s, self.cooldown_s)
        number("gate.probe_fraction", self.probe_fraction, 0, 1)
        number("gate.max_concurrent_probes", self.max_concurrent_probes, 1, integer=True)
        number("gate.probe_timeout_s", self.probe_timeout_s, 1e-9)
        number("gate.max_tracked_tenants", self.max_tracked_tenants, 1, integer=True)
        number("gate.explore_fraction", self.explore_fraction, 0, 1)
        number("gate.explore_fraction_unmeasured", self.explore_fraction_unmeasured, 0, 1)
        number("gate.speed_min_samples", self.speed_min_samples, 1e-9)
        number("gate.speed_half_life", self.speed_half_life, 1e-9)
        number("gate.speed_half_life_s", self.speed_half_life_s, 1e-9)
        number("gate.speed_margin", self.speed_margin, 0)
        number("gate.speed_max_misses", self.speed_max_misses, 1, integer=True)
        if self.speed_counts not in ("decode", "request"):
            raise ConfigError("gate.speed_counts", f"must be 'decode' or 'request', got {self.speed_counts!r}")
        number("gate.prior_tenant_weight", self.prior_tenant_weight, 0)
        number("gate.max_measured_per_s", self.max_measured_per_s, 0.01)
        object.__setattr__(self, "decay", 0.5 ** (1.0 / self.ema_half_life))
        object.__setattr__(self, "speed_decay", 0.5 ** (1.0 / self.speed_half_life))


@dataclass(frozen=True)
class StateConfig:
    """Where the control loop's state lives (org level; read once, when the controller is built).

    `memory`: in this process. `redis`: every replica keeps deciding from its own memory and a
    background task pools the evidence of all replicas through one Redis every `sync_interval_s`
    (docs/operations.md)."""

    backend: str = "memory"  # "memory" | "redis"
    url: str | None = field(default=None, repr=False)  # redis://[user:password@]host:port/db; may hold a secret
    sync_interval_s: float = 1.0  # how often each replica pushes its samples and reads the fleet's
    timeout_s: float = 0.25  # connect and socket timeout of one sync's Redis calls
    ttl_s: float = 3600.0  # a (tenant, model) nobody has synced for this long expires from Redis
    prefix: str = "ace"  # Redis key prefix: fleets sharing one Redis keep apart by prefix
    # Refuse to start when Redis cannot be reached at start-up (False: start degraded, deciding
    # from this replica's own state, and keep retrying).
    required: bool = False
    # A replica's first decisions wait for its first sync this long at most (0: never), then go
    # ahead on this replica's own state: a fresh replica reads the fleet before it decides.
    first_sync_wait_s: float = 1.0

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ConfigError("state.backend", f"unknown backend {self.backend!r}: expected 'memory' or 'redis'")
        if self.backend == "redis":
            if self.url is None:
                raise ConfigError("state.url", "required with backend = 'redis' (redis://host:6379/0)")
            if not isinstance(self.url, str) or not self.url.startswith(REDIS_SCHEMES):
                shown = self.url.split("://", 1)[0] + "://..." if isinstance(self.url, str) else repr(self.url)
                raise ConfigError("state.url", f"must be a redis://, rediss:// or unix:// URL, got {shown}")
        elif self.url is not None:
            raise ConfigError("state.url", "is only used with backend = 'redis'")
        number("state.sync_interval_s", self.sync_interval_s, 0.01, 60)
        number("state.timeout_s", self.timeout_s, 0.001, 10)
        number("state.ttl_s", self.ttl_s, 10 * self.sync_interval_s)
        number("state.first_sync_wait_s", self.first_sync_wait_s, 0, 30)
        if not isinstance(self.prefix, str) or not 0 < len(self.prefix) <= 64 or not self.prefix.isprintable():
            raise ConfigError("state.prefix", f"must be 1 to 64 printable characters, got {self.prefix!r}")
        if not isinstance(self.required, bool):
            raise ConfigError("state.required", f"must be true or false, got {self.required!r}")
        if self.required and self.backend != "redis":
            raise ConfigError("state.required", "is only used with backend = 'redis'")


@dataclass(frozen=True)
class UpstreamConfig:
    """How pools are called and when one is taken out of the loop's choices (outlier detection, as
    Envoy's): after `eject_after_failures` failures in a row (refused connections, 5xx answers,
    timeouts) a pool is ejected for `ejection_s`, doubled at each ejection in a row up to
    `max_ejection_s`; requests go to another arm that serves the same model meanwhile. The gateway
    waits `connect_timeout_s` for a connection and `first_byte_timeout_s` for the answer to start
    (and between two chunks of it), then answers 502 or 504 itself."""

    connect_timeout_s: float = 5.0
    first_byte_timeout_s: float = 120.0  # a non-streaming answer starts only when it is generated
    eject_after_failures: int = 3
    ejection_s: float = 10.0
    max_ejection_s: float = 300.0
    # The speed policy's estimates per arm and load band of its pool (decide/load.py): where an
    # arm's speed depends on how busy its pool is, a request goes where it is fastest now.
    load_aware: bool = True
    # Whose requests make an arm's load: "pool" (its own pool's: pools on hardware of their own, the
    # usual deployment) or "shared" (every pool's: pools that share one machine's cores, where a
    # request on one pool slows the others).
    load_scope: str = "pool"

    def __post_init__(self) -> None:
        number("upstream.connect_timeout_s", self.connect_timeout_s, 0.01, 600)
        number("upstream.first_byte_timeout_s", self.first_byte_timeout_s, 0.01, 24 * 3600)
        number("upstream.eject_after_failures", self.eject_after_failures, 1, 1000, integer=True)
        number("upstream.ejection_s", self.ejection_s, 0.01, 24 * 3600)
        number("upstream.max_ejection_s", self.max_ejection_s, self.ejection_s, 24 * 3600)
        if not isinstance(self.load_aware, bool):
            raise ConfigError("upstream.load_aware", f"must be true or false, got {self.load_aware!r}")
        if self.load_scope not in ("pool", "shared"):
            raise ConfigError("upstream.load_scope", f"must be 'pool' or 'shared', got {self.load_scope!r}")


@dataclass(frozen=True)
class AdminConfig:
    """The admin endpoints (`/ace/status`, `/ace/config`); without this table they do not exist.

    Clients send ``Authorization: Bearer <token>``. Only the token's SHA-256 is compared (in
    constant time), and neither the repr nor any error message shows the token. The config may
    hold the hash alone, ``sha256:<64 hex>`` (``ace-mw hash-key`` prints it)."""

    token: str = field(default="", repr=False)
    digest: bytes = field(init=False, repr=False, compare=False)  # SHA-256 of the token

    def __post_init__(self) -> None:
        token = self.token
        if not isinstance(token, str):
            raise ConfigError("admin.token", f"must be a string, got {type(token).__name__}")
        if token[: len(KEY_HASH_PREFIX)].lower() == KEY_HASH_PREFIX:
            digest = token[len(KEY_HASH_PREFIX) :].lower()
            if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
                raise ConfigError("admin.token", "a hashed token must be 'sha256:' + 64 hex digits")
            object.__setattr__(self, "digest", bytes.fromhex(digest))
            return
        if len(token) < MIN_ADMIN_TOKEN_LENGTH:
            raise ConfigError(
                "admin.token",
                f"must be at least {MIN_ADMIN_TOKEN_LENGTH} characters of a random secret (for example "
                f"`python -c 'import secrets; print(secrets.token_urlsafe(32))'`), got {len(token)}",
            )
        if not (token.isascii() and token.isprintable()) or " " in token:
            raise ConfigError("admin.token", "must be printable ASCII without spaces (it travels in an HTTP header)")
        object.__setattr__(self, "digest", hashlib.sha256(token.encode()).digest())
