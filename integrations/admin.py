"""The admin API of `AceSpecDec`; it exists only when the config has an `admin` table.

    GET  /ace/status   JSON when the client accepts application/json, else a self-refreshing HTML page
    POST /ace/config   a whole new config (JSON or TOML body): validated, then swapped in

Every ``/ace/*`` request must carry the admin token, as ``Authorization: Bearer <token>`` or, so
that a browser can ask a person for it, as the password of HTTP Basic credentials (any user name).
The token's SHA-256 is compared in constant time; a missing or wrong token gets 401 with a JSON
error and nothing else is revealed (not even which paths exist). Bodies are read under a cap.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import logging
from dataclasses import replace
from typing import Any

from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.types import Receive, Scope, Send

from ace_mw.config import AceConfig, AdminConfig
from ace_mw.config_file import MAX_CONFIG_BYTES
from ace_mw.controller import AceController
from ace_mw.errors import ConfigError

from .common import FailOpen
from .status_page import render_status

logger = logging.getLogger(__name__)

ADMIN_PREFIX = "/ace/"
STATUS_PATH = "/ace/status"
CONFIG_PATH = "/ace/config"
ADMIN_SOURCE = "admin"  # the source a posted config is recorded with
DEFAULT_STATUS_LIMIT = 100
MAX_STATUS_LIMIT = 1000
_TOML_TYPES = ("application/toml", "application/x-toml", "text/toml", "text/x-toml")
_NO_STORE = {"cache-control": "no-store"}
# The page is static HTML with inline style: nothing else may load or run in it.
_PAGE_HEADERS = {
    **_NO_STORE,
    "content-security-policy": "default-src 'none'; style-src 'unsafe-inline'; frame-ancestors 'none'",
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
}


async def admin_endpoint(
    controller: AceController, admin: AdminConfig, failures: FailOpen, scope: Scope, receive: Receive, send: Send
) -> None:
    """Serve one ``/ace/*`` request."""
    request = Request(scope, receive)
    try:
        if not authorized(request.headers.get("authorization"), admin):
            response = _unauthorized()
        elif request.url.path == STATUS_PATH:
            response = _status(controller, failures, request) if request.method == "GET" else _method("GET")
        elif request.url.path == CONFIG_PATH:
            response = await _post_config(controller, request) if request.method == "POST" else _method("POST")
        else:
            response = _error(404, f"no admin endpoint {request.url.path!r}", "not_found")
    except Exception:
        failures.record("admin")
        response = _error(500, "internal error of the admin endpoint (logged)", "internal_error")
    await response(scope, receive, send)


def authorized(authorization: str | None, admin: AdminConfig) -> bool:
    """Whether an Authorization header value carries the admin token (Bearer, or Basic password)."""
    scheme, _, credentials = (authorization or "").partition(" ")
    scheme, credentials = scheme.lower(), credentials.strip()
    if scheme == "bearer":
        token = credentials.encode("latin-1")  # header values arrive decoded as latin-1
    elif scheme == "basic":
        try:
            token = base64.b64decode(credentials, validate=True).partition(b":")[2]
        except (binascii.Error, ValueError):
            return False
    else:
        return False
    return hmac.compare_digest(hashlib.sha256(token).digest(), admin.digest)


def _status(controller: AceController, failures: FailOpen, request: Request) -> Response:
    limit = _status_limit(request.query_params.get("limit"))
    if limit is None:
        return _error(400, "limit must be an integer >= 0 (ASCII digits)", "invalid_query_parameter", param="limit")
    report = controller.status(limit)
    report["failures"] = dict(failures.counts)  # this middleware's own fail-open counts, by stage
    if "application/json" in request.headers.get("accept", ""):
        return JSONResponse(report, headers=_NO_STORE)
    return HTMLResponse(render_status(report), headers=_PAGE_HEADERS)


def _status_limit(value: str | None) -> int | None:
    """The `limit` query parameter: absent is the default, ASCII digits are clamped to the maximum,
    anything else (signs, other scripts' digits, superscripts, empty) is None."""
    if value is None:
        return DEFAULT_STATUS_LIMIT
    if not (value.isascii() and value.isdigit()):
        return None
    digits = value.lstrip("0")
    return MAX_STATUS_LIMIT if len(digits) > 6 else min(int(value), MAX_STATUS_LIMIT)  # int() refuses 4,300+ digits


async def _post_config(controller: AceController, request: Request) -> Response:
    media = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media == "application/json" or media.endswith("+json"):
        format = "json"
    elif media in _TOML_TYPES:
        format = "toml"
    else:
        return _error(415, "send the config as application/json or application/toml", "unsupported_media_type")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_CONFIG_BYTES:
        return _too_large()
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_CONFIG_BYTES:
            return _too_large()
    try:
        record = controller.reload(lambda: _posted(bytes(body), format, controller.config.admin), ADMIN_SOURCE)
    except ConfigError as exc:
        return _error(400, str(exc), "invalid_config", param=exc.path)
    return JSONResponse(
        {"version": record.version, "loaded_at": record.loaded_at, "source": record.source}, headers=_NO_STORE
    )


def _posted(body: bytes, format: str, admin: AdminConfig | None) -> AceConfig:
    """The posted config; without an admin table it keeps the one in force, so a new config need not
    carry the token (and this endpoint cannot remove itself)."""
    config = AceConfig.from_bytes(body, format, "body")
    return config if config.admin is not None else replace(config, admin=admin)


def _unauthorized() -> Response:
    response = _error(401, "missing or wrong admin token: send Authorization: Bearer <token>", "invalid_admin_token")
    # Bearer for API clients; Basic so that a browser asks a person for the token (as the password).
    response.headers.append("www-authenticate", 'Bearer realm="ace-mw"')
    response.headers.append("www-authenticate", 'Basic realm="ace-mw", charset="UTF-8"')
    return response


def _method(allowed: str) -> Response:
    return _error(405, f"use {allowed}", "method_not_allowed", headers={"allow": allowed})


def _too_large() -> Response:
    return _error(413, f"the config is larger than {MAX_CONFIG_BYTES} bytes", "too_large")


def _error(
    status: int, message: str, code: str, *, param: str | None = None, headers: dict[str, str] | None = None
) -> Response:
    error: dict[str, Any] = {"message": message, "type": "admin_error", "code": code}
    if param is not None:
        error["param"] = param
    return JSONResponse({"error": error}, status_code=status, headers={**_NO_STORE, **(headers or {})})
