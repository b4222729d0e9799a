"""Configuration: what the operator decides, validated once, precomputed for the hot path.

`AceConfig` is a tree of frozen dataclasses. It is built from a dict, a TOML or JSON file, or code,
and every value is checked on construction: a bad value raises `ConfigError` naming its field path.
Everything the per-request path needs (the hashed key table, the merged per-key settings, the
directives to hand out) is computed here, at load, so `decide` only looks things up.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from enum import Enum
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from .adapters import get_adapter
from .config_file import file_format, parse_document, read_config_file, resolve_references
from .config_sections import KEY_HASH_PREFIX as KEY_HASH_PREFIX
from .config_sections import POOL_NAME, join_path, number, optional_bool, section
from .config_sections import AdminConfig as AdminConfig
from .config_sections import GateConfig as GateConfig
from .config_sections import SpeculativeParams as SpeculativeParams
from .config_sections import StateConfig as StateConfig
from .config_sections import UpstreamConfig as UpstreamConfig
from .directive import BASELINE_POOL, PLAIN_ARM, SpecDirective
from .errors import ConfigError
from .vocabulary import Reason

if TYPE_CHECKING:
    pass

DEFAULT_PATHS = ("/v1/chat/completions", "/v1/completions")
MAX_CANDIDATES = 8  # arms are compared on every request: keep them few
_TENANT_NAME = POOL_NAME
# "sha" + "256" in any spelling at the start, or 64 hex digits alone or after a short "prefix:" / "prefix=".
_HASHED_KEY_NEAR_MISS = re.compile(r"(?i:sha[-_ ]?256)|(?:[A-Za-z0-9_ -]{1,10}[:=])?[0-9a-fA-F]{64}$")


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


def _mode(path: str, value: Any) -> Mode:
    """A mode in any case, as the request header takes it ("PROD" is prod)."""
    try:
        return Mode(value.lower() if isinstance(value, str) else value)
    except ValueError:
        raise ConfigError(path, f"unknown mode {value!r}: expected 'off', 'shadow' or 'prod'") from None


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
            object.__setattr__(self, "canary_percent", number("canary_percent", self.canary_percent, 0, 100))
        optional_bool("allow_header_override", self.allow_header_override)


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
    # (candidate index, reason, measured) -> the directive handed out; reasons "ok", "prior", "probe",
    # "explore", "joined"
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
            for reason in (Reason.OK, Reason.PRIOR, Reason.PROBE, Reason.EXPLORE, Reason.JOINED):
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
        set_("speculative", section(SpeculativeParams, self.speculative, "speculative"))
        set_("gate", section(GateConfig, self.gate, "gate"))
        set_("state", section(StateConfig, self.state, "state"))
        set_("upstream", section(UpstreamConfig, self.upstream, "upstream"))
        set_("canary_percent", number("canary_percent", self.canary_percent, 0, 100))
        for name in ("allow_header_override", "response_headers"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(name, f"must be true or false, got {getattr(self, name)!r}")
        get_adapter(self.adapter)  # ConfigError("adapter", ...) if no such adapter is registered
        set_("pools", MappingProxyType(self._check_pools(self.pools)))
        set_("paths", self._check_paths(self.paths))
        set_("route_set", frozenset(self.paths))
        if self.admin is not None:
            set_("admin", section(AdminConfig, self.admin, "admin"))
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
        return section(cls, resolve_references(data), "")

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
            if not isinstance(name, str) or not POOL_NAME.fullmatch(name):
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
                key = section(KeySettings, raw_settings, "")
                if key.candidates is not None:
                    base = replace(self.speculative, **key.speculative)
                    candidates = _candidates("candidates", key.candidates, base)
                else:  # the org's candidates, each with the key's speculative fields on top
                    inherited = [replace(c, **key.speculative) for c in self.org.candidates]
                    candidates = _candidates("candidates", inherited, self.speculative)
            except ConfigError as exc:
                raise ConfigError(join_path(f"keys.{label}", exc.path), exc.problem) from None
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
