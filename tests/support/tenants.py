"""Tenants as the core names them: from the real key digest, never re-implemented."""

from __future__ import annotations

from ace_mw.config import key_digest, tenant_of


def tenant(raw_key: str) -> str:
    """The tenant id a developer key shows under (state keys, status, spans)."""
    return tenant_of(key_digest(raw_key))
