"""The framework-neutral view of one request that the controller decides on.

Integrations (ASGI, gRPC) build a `RequestView`; the core never sees framework objects. The
derived fields are read straight from the parsed body and headers once, when the view is built: no
copies, no validation beyond types.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .errors import OVERRIDE_HEADER

CONVERSATION_HEADER = "x-ace-conversation-id"
# Headers that say who the caller is, or which mode it asks for: repeated with different values
# they are ambiguous (ace-mw and the app could each take another), and the request is refused.
SINGLE_VALUED = frozenset(("authorization", "x-api-key", "api-key", OVERRIDE_HEADER))
# The model name keys the state (memory, Redis, status page, spans), and the client chooses it: a
# longer one is kept as its head plus a digest of the whole, so distinct names stay distinct and
# none costs more than MAX_MODEL_CHARS characters anywhere.
MAX_MODEL_CHARS = 256
_MODEL_HEAD = MAX_MODEL_CHARS - 20  # "..." + "#" + 16 hex digits


@dataclass(slots=True)
class RequestView:
    """Read-only by contract (not frozen: it is built for every request, and a frozen dataclass's
    constructor costs several times a plain one's).

    Derived when built: `api_key` (``Authorization: Bearer X``, else ``x-api-key``, else
    ``api-key``), `model` (a string or None; over `MAX_MODEL_CHARS`, shortened by `bounded_model`),
    `temperature` (the raw value as sent, None when absent or null: the gate judges it), `stream`
    and `sticky_id` (what keeps one conversation on one side of a canary: conversation header, body
    ``user``, else the request id)."""

    method: str
    path: str
    headers: Mapping[str, str]  # lower-case names
    body: dict[str, Any] | None  # parsed JSON object, or None (see body_error)
    body_error: str | None = None  # "empty" | "too_large" | "not_json" | "not_object" | "unsupported_content_type"
    request_id: str | None = None
    conflicts: frozenset[str] = frozenset()  # SINGLE_VALUED headers sent twice, differently (see `conflicting`)
    api_key: str | None = field(init=False)
    model: str | None = field(init=False)
    temperature: Any = field(init=False)
    stream: bool = field(init=False)
    sticky_id: str | None = field(init=False)

    def __post_init__(self) -> None:
        # One pass per request (they were properties, read several times each per decision).
        headers, body = self.headers, self.body
        self.api_key = _api_key(headers)
        conversation = headers.get(CONVERSATION_HEADER)
        if body is None:
            self.model, self.temperature, self.stream = None, None, False
            self.sticky_id = conversation or self.request_id
            return
        model, user = body.get("model"), body.get("user")
        self.model = bounded_model(model) if isinstance(model, str) else None
        self.temperature = body.get("temperature")
        self.stream = body.get("stream") is True
        self.sticky_id = conversation or (user if isinstance(user, str) and user else self.request_id)


def bounded_model(model: str) -> str:
    """A model name of at most MAX_MODEL_CHARS characters: itself when short enough, else its head,
    "...#" and the first 16 hex digits of the SHA-256 of the whole name."""
    if len(model) <= MAX_MODEL_CHARS:  # nearly always: one length check
        return model
    digest = hashlib.sha256(model.encode("utf-8", "surrogatepass")).hexdigest()[:16]
    return f"{model[:_MODEL_HEAD]}...#{digest}"


def conflicting(headers: Iterable[tuple[str, str]]) -> frozenset[str]:
    """The SINGLE_VALUED header names (lower-case) that occur with more than one value; the
    integrations call this only when a request repeats some header name at all."""
    seen: dict[str, str] = {}
    found: set[str] = set()
    for name, value in headers:
        if name in SINGLE_VALUED and seen.setdefault(name, value) != value:
            found.add(name)
    return frozenset(found)


def _api_key(headers: Mapping[str, str]) -> str | None:
    auth = headers.get("authorization")
    if auth and auth[:7].lower() == "bearer ":
        key = auth[7:].strip()
        if key:
            return key
    return headers.get("x-api-key") or headers.get("api-key") or None
