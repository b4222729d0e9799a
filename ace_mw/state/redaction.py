"""Redis URLs and errors as an operator may see them: every credential redis-py accepts, masked."""

from __future__ import annotations

from urllib.parse import parse_qsl, quote, unquote, urlsplit

# The query parameter redis-py's `from_url` passes on as the connection's password.
_SECRET_PARAMETERS = ("password",)


def redact(url: str) -> str:
    """The URL with every credential redis-py accepts masked (for logs and status pages): the
    user info's password (``redis://user:pw@host``, ``redis://:pw@host``) and the ``password``
    query parameter (``redis://host/0?password=pw``, ``unix:///s.sock?db=0&password=pw``).
    A URL that cannot be parsed is shown as its scheme only."""
    try:
        parts = urlsplit(url)
        netloc = parts.netloc
        if parts.password is not None:
            host = parts.hostname or ""
            if parts.port is not None:
                host += f":{parts.port}"
            netloc = f"{parts.username or ''}:***@{host}"
        query = "&".join(_redacted_parameter(item) for item in parts.query.split("&"))
        # Put together by hand: urlunsplit would turn unix:///path into unix:/path.
        return f"{parts.scheme}://{netloc}{parts.path}" + (f"?{query}" if query else "")
    except ValueError:  # e.g. a port that is not a number
        return url.split("://", 1)[0] + "://..."


def _redacted_parameter(item: str) -> str:
    name, equals, _ = item.partition("=")
    return f"{name}=***" if equals and unquote(name).lower() in _SECRET_PARAMETERS else item


def _secrets(url: str) -> list[str]:
    """Every credential in `url`, raw and percent-decoded, longest first (to scrub error texts)."""
    try:
        parts = urlsplit(url)
        found = [parts.password] if parts.password else []
        found += [value for name, value in parse_qsl(parts.query) if name.lower() in _SECRET_PARAMETERS and value]
    except ValueError:
        return []
    return sorted(
        {variant for secret in found for variant in (secret, unquote(secret), quote(secret))}, key=len, reverse=True
    )


def describe(exc: BaseException, url: str) -> str:
    """An exception as text for a log or a status page, every credential of `url` masked."""
    text = f"{type(exc).__name__}: {exc}"
    for secret in _secrets(url):
        text = text.replace(secret, "***")
    return text[:300]
