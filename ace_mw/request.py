"""The framework-neutral view of one request that the controller decides on.

Integrations (ASGI, gRPC) build a `RequestView`; the core never sees framework objects. The
derived fields are read straight from the parsed body: no copies, no validation beyond types.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

CONVERSATION_HEADER = "x-ace-conversation-id"


@dataclass(slots=True)
class RequestView:
    """Read-only by contract (not frozen: it is built for every request, and a frozen dataclass's
    constructor costs several times a plain one's)."""

    method: str
    path: str
    headers: Mapping[str, str]  # lower-case names
    body: dict[str, Any] | None  # parsed JSON object, or None (see body_error)
    body_error: str | None = None  # "empty" | "too_large" | "not_json" | "not_object" | "unsupported_content_type"
    request_id: str | None = None

    @property
    def api_key(self) -> str | None:
        """The developer key: ``Authorization: Bearer X``, else ``x-api-key``, else ``api-key``."""
        auth = self.headers.get("authorization")
        if auth and auth[:7].lower() == "bearer ":
            key = auth[7:].strip()
            if key:
                return key
        return self.headers.get("x-api-key") or self.headers.get("api-key") or None

    @property
    def model(self) -> str | None:
        model = self.body.get("model") if self.body is not None else None
        return model if isinstance(model, str) else None

    @property
    def temperature(self) -> Any:
        """The raw ``temperature`` value as sent (None when absent or null); the gate judges it."""
        return self.body.get("temperature") if self.body is not None else None

    @property
    def stream(self) -> bool:
        return self.body is not None and self.body.get("stream") is True

    @property
    def sticky_id(self) -> str | None:
        """What keeps one conversation on one side of a canary: conversation header, body
        ``user``, else the request id."""
        conversation = self.headers.get(CONVERSATION_HEADER)
        if conversation:
            return conversation
        user = self.body.get("user") if self.body is not None else None
        if isinstance(user, str) and user:
            return user
        return self.request_id
