"""Typed errors of the control plane.

Only two things ever reach a caller of the middleware: a bad configuration (at load time) and a
bad override header (a client error the app answers with 400). Everything else fails open. The
`ace-mw` command has a third: an input it cannot use.
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


class InvalidOverrideHeader(AceError):
    """The X-ACE-Skill-Speculative-Decoding header holds something other than off|shadow|prod."""

    status_code = 400

    def __init__(self, value: str) -> None:
        # Echo a bounded prefix only: the header is client-controlled.
        shown = value if len(value) <= 40 else value[:40] + "..."
        super().__init__(
            f"Invalid X-ACE-Skill-Speculative-Decoding header value {shown!r}: expected one of 'off', 'shadow', 'prod'."
        )
        self.value = value

    def to_openai_error(self) -> dict[str, dict[str, str]]:
        """The error body in the OpenAI API's shape, so OpenAI clients raise BadRequestError."""
        return {
            "error": {
                "message": str(self),
                "type": "invalid_request_error",
                "param": "X-ACE-Skill-Speculative-Decoding",
                "code": "invalid_speculative_decoding_mode",
            }
        }


class UsageError(AceError):
    """An `ace-mw` command-line input the command cannot use: printed as one line, exit code 2."""
