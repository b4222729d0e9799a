"""Reading a configuration document: TOML or JSON by the file's suffix, bounded in size, from a
regular file only, opened without blocking (so a FIFO at the path cannot hang a reader)."""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

from .errors import ConfigError

MAX_CONFIG_BYTES = 1 << 20  # a configuration document (file or admin body) larger than this is refused
FORMATS = ("toml", "json")


def parse_document(data: bytes, format: str, source: str = "config") -> Any:
    """The tables of a TOML or JSON document, not yet validated; a ConfigError (path `source`)
    for an unsupported format, a document over MAX_CONFIG_BYTES, or one that does not parse."""
    if format not in FORMATS:
        raise ConfigError(source, f"unsupported format {format!r}: use toml or json")
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(source, f"larger than {MAX_CONFIG_BYTES} bytes")
    try:
        parsed = tomllib.loads(data.decode("utf-8")) if format == "toml" else json.loads(data)
    except (ValueError, RecursionError) as exc:  # syntax and encoding errors (UnicodeDecodeError too)
        raise ConfigError(source, f"cannot read configuration: {exc}") from exc
    return parsed  # from_dict refuses a document that is not a table


def read_config_file(path: Path) -> bytes:
    """The bytes of a config file, at most MAX_CONFIG_BYTES; a ConfigError if it is missing,
    unreadable, too large or not a regular file. Opened without blocking, so a FIFO or a device at
    the path is refused instead of hanging the reader."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0))
    except OSError as exc:
        raise ConfigError(str(path), f"cannot read configuration: {exc}") from exc
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ConfigError(str(path), "not a regular file (a FIFO, socket, device or directory): refused")
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise ConfigError(str(path), f"cannot read configuration: {exc}") from exc
    finally:
        os.close(fd)
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(str(path), f"larger than {MAX_CONFIG_BYTES} bytes")
    return data


def file_format(path: str | os.PathLike[str]) -> str:
    """The format of a config file by its extension: "toml" or "json"."""
    suffix = Path(path).suffix.lower()
    if suffix not in (".toml", ".json"):
        raise ConfigError(str(path), "unsupported file type: use .toml or .json")
    return suffix[1:]
