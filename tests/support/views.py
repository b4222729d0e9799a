"""`RequestView`s as the integrations build them, for tests that drive the controller directly."""

from __future__ import annotations

from typing import Any

from ace_mw import RequestView

CHAT_PATH = "/v1/chat/completions"
CHAT_BODY = {"model": "m", "temperature": 0.2, "messages": [{"role": "user", "content": "hi"}]}


def view(
    body: Any = None, headers: dict | None = None, key: str | None = "sk-a", path: str = CHAT_PATH, **kwargs: Any
) -> RequestView:
    """A POST with ``key`` as its bearer token (None: no key); ``body`` None is a short chat
    request at T = 0.2 (unless ``body_error`` says the body could not be read)."""
    headers = dict(headers or {})
    if key is not None:
        headers["authorization"] = f"Bearer {key}"
    if body is None and "body_error" not in kwargs:
        body = dict(CHAT_BODY)
    return RequestView("POST", path, headers, body, **kwargs)
