"""The effective configuration as plain data, with its secrets masked: what `ace-mw check` prints.

Every default is filled in, every key is shown hashed (as the config keeps them), the admin token
as `***` (or the first digits of its hash, when configured hashed) and a Redis URL with every
credential masked."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields, is_dataclass
from enum import Enum
from typing import Any

from ..config import KEY_HASH_PREFIX, AceConfig
from ..state.redaction import redact


def effective(config: AceConfig) -> dict[str, Any]:
    data: dict[str, Any] = _plain(config)
    if config.admin is not None:
        token = config.admin.token
        hashed = token[: len(KEY_HASH_PREFIX)].lower() == KEY_HASH_PREFIX
        data["admin"]["token"] = token[:19] + "..." if hashed else "***"
    if config.state.url is not None:
        data["state"]["url"] = redact(config.state.url)
    return data


def _plain(value: Any) -> Any:
    if is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in fields(value) if f.init}
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value
