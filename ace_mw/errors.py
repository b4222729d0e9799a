"""Typed errors of the control plane.

Only two kinds of thing ever reach a caller of the middleware: a bad configuration (at load time)
and a client error the integrations answer with 400 / INVALID_ARGUMENT (a bad override header, an
ambiguous identity). Everything else fails open. The `ace-mw` command has a third: an input it
cannot use.
"""

from __future__ import annotations

OVERRIDE_HEADER = "x-ace-skill-speculative-decoding"


class AceError(Exception):
    """Base class of every error ace-mw raises on purpose."""


class ConfigError(AceError, ValueError):
    """A configuration value is invalid; `path` names the field (e.g. ``gate.alpha_floor``)."""

    def __init__(self, path: str, problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.path = path
        self.problem = problem


class ClientError(AceError):
    """A request ace-mw refuses to decide: answered with 400 (HTTP) or INVALID_ARGUMENT (gRPC)."""

    status_code = 400
    param = ""
    code = ""

    def to_openai_error(self) -> dict[str, dict[str, str]]:
        """The error body in the OpenAI API's shape, so OpenAI clients raise BadRequestError."""
        return {
            "error": {"message": str(self), "type": "invalid_request_error", "param": self.param, "code": self.code}
        }


class InvalidOverrideHeader(ClientError):
    """The X-ACE-Skill-Speculative-Decoding header holds something other than off|shadow|prod."""

    param = "X-ACE-Skill-Speculative-Decoding"
    code = "invalid_speculative_decoding_mode"

    def __init__(self, value: str) -> None:
        # Echo a bounded prefix only: the header is client-controlled.
        shown = value if len(value) <= 40 else value[:40] + "..."
        super().__init__(
            f"Invalid X-ACE-Skill-Speculative-Decoding header value {shown!r}: expected one of 'off', 'shadow', 'prod'."
        )
        self.value = value


class AmbiguousIdentity(ClientError):
    """A header that names the caller (or its mode) came more than once, with different values:
    ace-mw and the app could take different ones, so the request is refused rather than decided
    as one tenant and served as another."""

    code = "ambiguous_identity"

    def __init__(self, names: list[str]) -> None:
        super().__init__(
            f"The {', '.join(names)} header{'s' if len(names) > 1 else ''} came more than once with different "
            "values: send each once."
        )
        self.names = names
        self.param = names[0]


class UsageError(AceError):
    """An `ace-mw` command-line input the command cannot use: printed as one line, exit code 2."""


class StoreUnavailable(AceError):
    """`state.required = true` and the shared store cannot be reached at start-up."""
