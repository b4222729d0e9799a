"""Mode resolution and canary selection: which settings apply to a request, and in which mode.

Precedence: header override > developer-key setting > org mode. The mode is replaced whole by the
highest level that sets it; speculative parameters, canary percent and the header permission are
merged per field (key over org) at config load, so here a request costs one dict lookup for its
key's SHA-256 (cached for the most recent keys) and one for its settings.
"""

from __future__ import annotations

import hashlib
import random
from functools import lru_cache
from typing import NamedTuple

from ..config import AceConfig, Mode, Settings, key_digest, tenant_of
from ..errors import OVERRIDE_HEADER, InvalidOverrideHeader
from ..request import RequestView

ANONYMOUS = "anonymous"  # tenant of requests without a developer key
OVERRIDE_NOT_PERMITTED = "override_not_permitted"
_HEADER_MODES = {mode.value: mode for mode in Mode}
_TWO_53 = float(2**53)
# Digests of the most recent distinct keys: a key sends many requests, and SHA-256 is a few
# microseconds of cold code per request. The keys live in this process's memory only, like the
# requests that carried them (never in the config, Redis, status, logs or spans).
KEY_DIGEST_CACHE_SIZE = 4096
_cached_digest = lru_cache(maxsize=KEY_DIGEST_CACHE_SIZE)(key_digest)


class Resolution(NamedTuple):
    settings: Settings
    tenant: str  # first 16 hex digits of sha256(key): matches the "sha256:<hex>" config entries
    mode: Mode
    mode_source: str  # "header" | "key" | "org"
    notes: tuple[str, ...]  # e.g. ("override_not_permitted",)


def resolve(config: AceConfig, request: RequestView) -> Resolution:
    """Settings, tenant and mode of one request. Raises InvalidOverrideHeader on a bad header value
    from a key that may override; a key that may not is ignored and noted, not an error."""
    key = request.api_key
    if key is None:
        settings, tenant = config.org, ANONYMOUS
    else:
        digest = _cached_digest(key)
        settings, tenant = config.key_table.get(digest, config.org), tenant_of(digest)
    header = request.headers.get(OVERRIDE_HEADER)
    if header is None:
        return Resolution(settings, tenant, settings.mode, settings.mode_source, ())
    if not settings.allow_header_override:
        return Resolution(settings, tenant, settings.mode, settings.mode_source, (OVERRIDE_NOT_PERMITTED,))
    mode = _HEADER_MODES.get(header.strip().lower())
    if mode is None:
        raise InvalidOverrideHeader(header)
    return Resolution(settings, tenant, mode, "header", ())


def sticky_bucket(tenant: str, sticky_id: str | None) -> float:
    """A number in [0, 1) fixed for one (tenant, conversation): the same conversation always lands
    on the same side of a canary or probe split. Without any id the draw is random."""
    if sticky_id is None:
        return random.random()
    digest = hashlib.blake2b(f"{tenant}\x00{sticky_id}".encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return (int.from_bytes(digest, "big") >> 11) / _TWO_53  # 53 bits: exact in a float, never 1.0


def in_canary(bucket: float, percent: float) -> bool:
    return bucket * 100.0 < percent
