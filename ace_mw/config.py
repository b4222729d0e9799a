"""Configuration: what the operator decides, validated once, precomputed for the hot path.

`AceConfig` is a tree of frozen dataclasses. It is built from a dict, a TOML or JSON file, or code,
and every value is checked on construction: a bad value raises `ConfigError` naming its field path.
Everything the per-request path needs (the hashed key table, the merged per-key settings, the
directives to hand out) is computed here, at load, so `decide` only looks things up.
"""

from __future__ import annotations

import difflib
import hashlib
import math
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields, replace
from enum import Enum
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, TypeVar

from .adapters import get_adapter
from .config_file import file_format, parse_document, read_config_file, resolve_references
from .directive import ALGORITHMS, BASELINE_POOL, MAX_SPECULATIVE_TOKENS, PLAIN_ARM, SPECULATIVE_POOL, SpecDirective
from .errors import ConfigError
from .vocabulary import Reason

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

DEFAULT_PATHS = ("/v1/chat/completions", "/v1/completions")
MAX_CANDIDATES = 8  # arms are compared on every request: keep them few
POLICIES = ("speed", "acceptance")
BACKENDS = ("memory", "redis")
REDIS_SCHEMES = ("redis://", "rediss://", "unix://")
KEY_HASH_PREFIX = "sha256:"
_POOL_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_TENANT_NAME = _POOL_NAME
# "sha" + "256" in any spelling at the start, or 64 hex digits alone or after a short "prefix:" / "prefix=".
_HASHED_KEY_NEAR_MISS = re.compile(r"(?i:sha[-_ ]?256)|(?:[A-Za-z0-9_ -]{1,10}[:=])?[0-9a-fA-F]{64}$")
# The admin token is checked online with no lockout, so it must be a secret nobody can guess:
# 32 characters of `secrets.token_urlsafe` carry about 190 bits.
MIN_ADMIN_TOKEN_LENGTH = 32

Section = TypeVar("Section", bound="DataclassInstance")


class Mode(str, Enum):
    OFF = "off"
    SHADOW = "shadow"
    PROD = "prod"


def key_digest(raw_key: str) -> str:
    """SHA-256 hex of a developer key: how keys are matched and tenants named."""
    return hashlib.sha256(raw_key.encode("utf-8", "surrogatepass")).hexdigest()


def tenant_of(digest: str) -> str:
    """The tenant a key digest names: its first 16 hex digits, in state keys, status and spans."""
    return digest[:16]


def hash_key(raw_key: str) -> str:
    """The ``sha256:<hex>`` form of a developer key, for config files that must not hold raw keys."""
    return KEY_HASH_PREFIX + key_digest(raw_key)


# -- field checks: each returns the normalised value or raises ConfigError(path, ...) --------------


def _number(path: str, value: Any, lo: float, hi: float = math.inf, *, integer: bool = False) -> Any:
    wanted = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, wanted):
        raise ConfigError(path, f"must be {'an integer' if integer else 'a number'}, got {value!r}")
    if not (lo <= value <= hi):  # also rejects NaN
        bounds = f"in [{lo:g}, {hi:g}]" if hi != math.inf else f">= {lo:g}"
        raise ConfigError(path, f"must be {bounds}, got {value!r}")
    return value if integer else float(value)


def _optional_bool(path: str, value: Any) -> bool | None:
    if value is not None and not isinstance(value, bool):
        raise ConfigError(path, f"must be true or false, got {value!r}")
    return value


def _mode(path: str, value: Any) -> Mode:
    """A mode in any case, as the request header takes it ("PROD" is prod)."""
    try:
        return Mode(value.lower() if isinstance(value, str) else value)
    except ValueError:
        raise ConfigError(path, f"unknown mode {value!r}: expected 'off', 'shadow' or 'prod'") from None


def _tree_choices(path: str, value: Any) -> tuple[tuple[int, ...], ...] | None:
    if value is None:
        return None
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise ConfigError(path, f"must be a list of paths (lists of integers), got {value!r}")
    tree = []
    for node in value:
        if isinstance(node, (str, bytes)) or not hasattr(node, "__iter__") or not node:
            raise ConfigError(path, f"every path must be a non-empty list of integers, got {node!r}")
        tree.append(tuple(_number(path, choice, 0, integer=True) for choice in node))
    if not tree:
        raise ConfigError(path, "must not be empty (omit it for the engine's default tree)")
    return tuple(tree)


def _join(prefix: str, path: str) -> str:
    return f"{prefix}.{path}" if prefix and path else prefix or path


def _section(cls: type[Section], value: Any, path: str) -> Section:
    """Build a nested dataclass from a mapping, rejecting unknown fields (typos fail loudly)."""
    if isinstance(value, cls):
        return value
    if not isinstance(value, Mapping):
        raise ConfigError(path, f"must be a table/object, got {type(value).__name__}")
    known = {f.name for f in fields(cls) if f.init}
    for name in value:
        if name not in known:
            raise ConfigError(_join(path, str(name)), unknown_field(str(name), known))
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
        _number(
            "speculative.num_speculative_tokens", self.num_speculative_tokens, 1, MAX_SPECULATIVE_TOKENS, integer=True
        )
        if self.draft_model is not None and (not isinstance(self.draft_model, str) or not self.draft_model):
            raise ConfigError("speculative.draft_model", f"must be a non-empty string, got {self.draft_model!r}")
        object.__setattr__(self, "tree_choices", _tree_choices("speculative.tree_choices", self.tree_choices))
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
    # engine reports its time to the first token: vLLM): for arms whose prefill costs differ.
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
        _number("gate.temperature_threshold", self.temperature_threshold, 0)
        _number("gate.default_temperature", self.default_temperature, 0)
        _number("gate.alpha_floor", self.alpha_floor, 0, 1)
        _number("gate.reenable_threshold", self.reenable_threshold, 0, 1)
        if self.reenable_threshold < self.alpha_floor:
            raise ConfigError(
                "gate.reenable_threshold",
                f"must be >= gate.alpha_floor ({self.alpha_floor}), got {self.reenable_threshold}",
            )
        _number("gate.ema_half_life", self.ema_half_life, 1e-9)
        _number("gate.min_samples", self.min_samples, 1, integer=True)
        _number("gate.min_probe_samples", self.min_probe_samples, 1, integer=True)
        _number("gate.cooldown_s", self.cooldown_s, 0)
        _number("gate.cooldown_growth", self.cooldown_growth, 1)
        _number("gate.max_cooldown_s", self.max_cooldown_s, self.cooldown_s)
        _number("gate.probe_fraction", self.probe_fraction, 0, 1)
        _number("gate.max_concurrent_probes", self.max_concurrent_probes, 1, integer=True)
        _number("gate.probe_timeout_s", self.probe_timeout_s, 1e-9)
        _number("gate.max_tracked_tenants", self.max_tracked_tenants, 1, integer=True)
        _number("gate.explore_fraction", self.explore_fraction, 0, 1)
        _number("gate.explore_fraction_unmeasured", self.explore_fraction_unmeasured, 0, 1)
        _number("gate.speed_min_samples", self.speed_min_samples, 1e-9)
        _number("gate.speed_half_life", self.speed_half_life, 1e-9)
        _number("gate.speed_half_life_s", self.speed_half_life_s, 1e-9)
        _number("gate.speed_margin", self.speed_margin, 0)
        _number("gate.speed_max_misses", self.speed_max_misses, 1, integer=True)
        if self.speed_counts not in ("decode", "request"):
            raise ConfigError("gate.speed_counts", f"must be 'decode' or 'request', got {self.speed_counts!r}")
        _number("gate.prior_tenant_weight", self.prior_tenant_weight, 0)
        _number("gate.max_measured_per_s", self.max_measured_per_s, 0.01)
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
        _number("state.sync_interval_s", self.sync_interval_s, 0.01, 60)
        _number("state.timeout_s", self.timeout_s, 0.001, 10)
        _number("state.ttl_s", self.ttl_s, 10 * self.sync_interval_s)
        _number("state.first_sync_wait_s", self.first_sync_wait_s, 0, 30)
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
        _number("upstream.connect_timeout_s", self.connect_timeout_s, 0.01, 600)
        _number("upstream.first_byte_timeout_s", self.first_byte_timeout_s, 0.01, 24 * 3600)
        _number("upstream.eject_after_failures", self.eject_after_failures, 1, 1000, integer=True)
        _number("upstream.ejection_s", self.ejection_s, 0.01, 24 * 3600)
        _number("upstream.max_ejection_s", self.max_ejection_s, self.ejection_s, 24 * 3600)
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


@dataclass(frozen=True)
class KeySettings:
    """One developer key's overrides; None (or an absent field) inherits the org value."""

    mode: Mode | None = None
    speculative: Mapping[str, Any] = field(default_factory=dict)  # per-field overrides of AceConfig.speculative
    candidates: Any = None  # a list of speculative tables: replaces the org's candidates
    canary_percent: float | None = None
    allow_header_override: bool | None = None
    # What operators call the tenant (LiteLLM's key alias): shown on the status page, in spans and as
    # a metric label in place of the hash. Names only: a bounded set, never a raw key.
    name: str | None = None

    def __post_init__(self) -> None:
        if self.name is not None and (not isinstance(self.name, str) or not _TENANT_NAME.fullmatch(self.name)):
            raise ConfigError("name", f"must be 1 to 64 letters, digits, '_', '.' or '-', got {self.name!r}")
        if self.mode is not None:
            object.__setattr__(self, "mode", _mode("mode", self.mode))
        object.__setattr__(self, "speculative", MappingProxyType(dict(_speculative_overrides(self.speculative))))
        if self.canary_percent is not None:
            object.__setattr__(self, "canary_percent", _number("canary_percent", self.canary_percent, 0, 100))
        _optional_bool("allow_header_override", self.allow_header_override)


@dataclass(frozen=True)
class Settings:
    """The effective settings of one key (or of the org): merged at load, read per request."""

    mode: Mode
    mode_source: str  # "key" | "org": which level set the mode
    candidates: tuple[SpeculativeParams, ...]  # the speculative arms, in preference order
    canary_percent: float
    allow_header_override: bool
    name: str | None = None  # the key's name (KeySettings.name); None for the org and unnamed keys
    arms: tuple[str, ...] = field(init=False)  # arm labels: PLAIN_ARM, then each candidate's label
    arm_pools: tuple[str, ...] = field(init=False)  # the pool each arm runs on, in the same order
    # (candidate index, reason, measured) -> the directive handed out; reasons "ok", "prior", "probe", "explore"
    directives: Mapping[tuple[int, str, bool], SpecDirective] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "arms", (PLAIN_ARM, *(c.label for c in self.candidates)))
        object.__setattr__(self, "arm_pools", (BASELINE_POOL, *(c.route for c in self.candidates)))
        directives = {}
        for arm, candidate in enumerate(self.candidates, start=1):
            applied = SpecDirective(
                enabled=True,
                algorithm=candidate.algorithm,
                num_speculative_tokens=candidate.num_speculative_tokens,
                draft_model=candidate.draft_model,
                tree_choices=candidate.tree_choices,
                pool=candidate.route,
            )
            for reason in (Reason.OK, Reason.PRIOR, Reason.PROBE, Reason.EXPLORE):
                for measured in (True, False):
                    directives[arm, reason, measured] = replace(applied, reason=reason, measure=measured)
        object.__setattr__(self, "directives", MappingProxyType(directives))

    @property
    def speculative(self) -> SpeculativeParams:
        """The first candidate: what the acceptance policy always runs."""
        return self.candidates[0]


def _candidates(path: str, value: Any, base: SpeculativeParams) -> tuple[SpeculativeParams, ...]:
    """A `candidates` list: each table's fields over `base` (the level's `speculative` table)."""
    if value is None:
        return (base,)
    if isinstance(value, (str, bytes, Mapping)) or not hasattr(value, "__iter__"):
        raise ConfigError(path, f"must be a list of speculative tables, got {type(value).__name__}")
    items = list(value)
    if not items:
        raise ConfigError(path, "must not be empty (omit it to speculate with the `speculative` table alone)")
    if len(items) > MAX_CANDIDATES:
        raise ConfigError(path, f"at most {MAX_CANDIDATES} candidates, got {len(items)}")
    found: list[SpeculativeParams] = []
    for i, item in enumerate(items):
        where = f"{path}[{i}]"
        if isinstance(item, SpeculativeParams):
            candidate = item
        else:
            try:
                overrides = _speculative_overrides(item)
                candidate = replace(base, **overrides)
            except ConfigError as exc:
                raise ConfigError(where + exc.path.removeprefix("speculative"), exc.problem) from None
        if candidate in found:
            raise ConfigError(where, f"duplicates {path}[{found.index(candidate)}] ({candidate.label})")
        found.append(candidate)
    return tuple(found)


def _speculative_overrides(value: Any) -> Mapping[str, Any]:
    """A table of SpeculativeParams fields, unknown names rejected."""
    if not isinstance(value, Mapping):
        raise ConfigError("speculative", f"must be a table/object, got {type(value).__name__}")
    known = {f.name for f in fields(SpeculativeParams)}
    for name in value:
        if name not in known:
            raise ConfigError(f"speculative.{name}", f"unknown field (known: {', '.join(sorted(known))})")
    return value


@dataclass(frozen=True)
class AceConfig:
    """The whole control-plane configuration. Immutable: swap it with `AceController.update`."""

    mode: Mode = Mode.SHADOW
    speculative: SpeculativeParams = field(default_factory=SpeculativeParams)
    # a list of speculative tables (each over `speculative`), the arms of the speed policy; None = [speculative]
    candidates: Any = None
    gate: GateConfig = field(default_factory=GateConfig)
    canary_percent: float = 100.0  # share of prod traffic that speculates (sticky per conversation)
    allow_header_override: bool = True  # may clients set the mode with X-ACE-Skill-Speculative-Decoding
    response_headers: bool = True  # the decision on each response: x-ace-* headers, gRPC trailing metadata
    # raw key or "sha256:<hex>" -> settings; stored hashed ("sha256:<hex>"), so no raw key outlives loading
    keys: Mapping[str, KeySettings] = field(default_factory=dict)
    adapter: str = "ace"
    pools: Mapping[str, str] = field(default_factory=dict)  # pool -> URL, for the app or gateway that routes
    paths: tuple[str, ...] = DEFAULT_PATHS  # POST routes the controller decides on
    state: StateConfig = field(default_factory=StateConfig)  # memory, or shared by a fleet on Redis
    upstream: UpstreamConfig = field(default_factory=UpstreamConfig)  # pools' timeouts and ejection
    admin: AdminConfig | None = None  # the /ace/* endpoints; None: they do not exist
    org: Settings = field(init=False, repr=False, compare=False)
    key_table: Mapping[str, Settings] = field(init=False, repr=False, compare=False)  # sha256 hex -> settings
    route_set: frozenset[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        def set_(name: str, value: object) -> None:  # a frozen dataclass normalising its own fields
            object.__setattr__(self, name, value)

        set_("mode", _mode("mode", self.mode))
        set_("speculative", _section(SpeculativeParams, self.speculative, "speculative"))
        set_("gate", _section(GateConfig, self.gate, "gate"))
        set_("state", _section(StateConfig, self.state, "state"))
        set_("upstream", _section(UpstreamConfig, self.upstream, "upstream"))
        set_("canary_percent", _number("canary_percent", self.canary_percent, 0, 100))
        for name in ("allow_header_override", "response_headers"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(name, f"must be true or false, got {getattr(self, name)!r}")
        get_adapter(self.adapter)  # ConfigError("adapter", ...) if no such adapter is registered
        set_("pools", MappingProxyType(self._check_pools(self.pools)))
        set_("paths", self._check_paths(self.paths))
        set_("route_set", frozenset(self.paths))
        if self.admin is not None:
            set_("admin", _section(AdminConfig, self.admin, "admin"))
        if self.candidates is not None:
            set_("candidates", _candidates("candidates", self.candidates, self.speculative))
        candidates = self.candidates or (self.speculative,)
        set_("org", Settings(self.mode, "org", candidates, self.canary_percent, self.allow_header_override))
        hashed, table = self._build_key_table()
        set_("keys", MappingProxyType(hashed))
        set_("key_table", MappingProxyType(table))
        self._check_routes("candidates" if self.candidates is not None else "speculative", self.org.candidates)
        for digest, settings in table.items():
            key = self.keys[KEY_HASH_PREFIX + digest]
            where = f"keys.{KEY_HASH_PREFIX}{digest[:12]}." + (
                "candidates" if key.candidates is not None else "speculative"
            )
            if settings.candidates != self.org.candidates:
                self._check_routes(where, settings.candidates)

    # -- loading -----------------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> AceConfig:
        """Build from a table; ``{env = ...}`` / ``{file = ...}`` references are resolved first (config_file.py)."""
        if not isinstance(data, Mapping):
            raise ConfigError("config", f"must be a table/object, got {type(data).__name__}")
        return _section(cls, resolve_references(data), "")

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> AceConfig:
        """Load a ``.toml`` or ``.json`` file (the format follows the extension)."""
        path = Path(path)
        format = file_format(path)
        data = read_config_file(path)
        return cls.from_bytes(data, format, str(path))

    @classmethod
    def from_bytes(cls, data: bytes, format: str, source: str = "config") -> AceConfig:
        """Load a TOML or JSON document (`format` "toml" or "json"); a document that cannot be read
        is a ConfigError whose path is `source`."""
        return cls.from_dict(parse_document(data, format, source))

    def handles(self, method: str, path: str) -> bool:
        """Whether this request is one the controller decides on (a POST to a configured path)."""
        return method == "POST" and path in self.route_set

    # -- validation helpers ------------------------------------------------------------------------

    @staticmethod
    def _check_pools(pools: Any) -> dict[str, str]:
        if not isinstance(pools, Mapping):
            raise ConfigError("pools", f"must be a table/object of name -> URL, got {type(pools).__name__}")
        for name, url in pools.items():
            if not isinstance(name, str) or not _POOL_NAME.fullmatch(name):
                raise ConfigError(f"pools.{name}", "a pool name is letters, digits, '_', '-' or '.' (at most 64)")
            if not isinstance(url, str) or not url:
                raise ConfigError(f"pools.{name}", f"must be a non-empty URL string, got {url!r}")
        if pools and BASELINE_POOL not in pools:
            raise ConfigError("pools", f"needs a '{BASELINE_POOL}' pool: where plain decoding (the plain arm) runs")
        return dict(pools)

    def _check_routes(self, where: str, candidates: tuple[SpeculativeParams, ...]) -> None:
        """Every candidate runs where the decision can send it, and arms can be told apart: an
        engine that switches speculation per server (vLLM, SGLang, TensorRT-LLM, current llama.cpp)
        needs a pool of its own for each candidate."""
        adapter = get_adapter(self.adapter)
        per_request = getattr(adapter, "switches_per_request", False)
        seen: dict[str, str] = {}
        for i, candidate in enumerate(candidates):
            field_path = f"{where}[{i}].pool" if where.endswith("candidates") else f"{where}.pool"
            pool = candidate.route
            if candidate.pool is not None and candidate.pool not in self.pools:
                known = ", ".join(self.pools) if self.pools else "there is no [pools] table"
                raise ConfigError(field_path, f"unknown pool {candidate.pool!r} ({known})")
            if pool == BASELINE_POOL:
                raise ConfigError(
                    field_path, f"'{BASELINE_POOL}' is the plain arm's pool: a candidate needs one that speculates"
                )
            if pool in seen and not per_request:
                raise ConfigError(
                    field_path,
                    f"runs on the same pool as {seen[pool]} ({pool!r}), and the {adapter.name} adapter cannot switch "
                    "speculation per request, so the two arms would be one server: give each candidate its own pool",
                )
            seen.setdefault(pool, field_path.removesuffix(".pool"))

    @staticmethod
    def _check_paths(paths: Any) -> tuple[str, ...]:
        if isinstance(paths, str) or not hasattr(paths, "__iter__"):
            raise ConfigError("paths", f"must be a list of paths, got {paths!r}")
        checked = tuple(paths)
        for path in checked:
            if not isinstance(path, str) or not path.startswith("/"):
                raise ConfigError("paths", f"every path must be a string starting with '/', got {path!r}")
        return checked

    def _build_key_table(self) -> tuple[dict[str, KeySettings], dict[str, Settings]]:
        """({"sha256:<hex>": KeySettings}, {hex: merged Settings})."""
        if not isinstance(self.keys, Mapping):
            raise ConfigError("keys", f"must be a table/object of key -> settings, got {type(self.keys).__name__}")
        hashed: dict[str, KeySettings] = {}
        table: dict[str, Settings] = {}
        for given, raw_settings in self.keys.items():
            digest, label = _key_digest(given)
            try:
                key = _section(KeySettings, raw_settings, "")
                if key.candidates is not None:
                    base = replace(self.speculative, **key.speculative)
                    candidates = _candidates("candidates", key.candidates, base)
                else:  # the org's candidates, each with the key's speculative fields on top
                    inherited = [replace(c, **key.speculative) for c in self.org.candidates]
                    candidates = _candidates("candidates", inherited, self.speculative)
            except ConfigError as exc:
                raise ConfigError(_join(f"keys.{label}", exc.path), exc.problem) from None
            if digest in table:
                raise ConfigError(f"keys.{label}", "the same key is listed twice (raw and hashed?)")
            hashed[KEY_HASH_PREFIX + digest] = key
            table[digest] = Settings(
                key.mode or self.mode,
                "org" if key.mode is None else "key",
                candidates,
                self.canary_percent if key.canary_percent is None else key.canary_percent,
                self.allow_header_override if key.allow_header_override is None else key.allow_header_override,
                key.name,
            )
        return hashed, table


def _key_digest(given: Any) -> tuple[str, str]:
    """(sha256 hex, label safe to print) of a configured key; raw keys never appear in errors.

    ``sha256:`` is matched in any case. A key that looks like a mistyped hashed one (``sha-256:``,
    ``SHA256=``, ``sha265:<64 hex>``, a bare 64-hex digest) is rejected rather than silently taken
    as a raw key that no client will ever send."""
    if not isinstance(given, str) or not given:
        raise ConfigError("keys", f"every key must be a non-empty string, got {type(given).__name__}")
    if given[: len(KEY_HASH_PREFIX)].lower() == KEY_HASH_PREFIX:
        digest = given[len(KEY_HASH_PREFIX) :].lower()
        if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
            raise ConfigError(f"keys.{given[:20]}...", "a hashed key must be 'sha256:' + 64 hex digits")
        return digest, KEY_HASH_PREFIX + digest[:12]
    digest = key_digest(given)
    label = KEY_HASH_PREFIX + digest[:12]
    if _HASHED_KEY_NEAR_MISS.match(given):
        raise ConfigError(
            f"keys.{label}",
            "looks like a hashed key but is not 'sha256:' + 64 hex digits (hash_key() writes a raw key that way)",
        )
    return digest, label
