"""Reading a configuration document: TOML or JSON by the file's suffix, bounded in size, from a
regular file only, opened without blocking (so a FIFO at the path cannot hang a reader); and the
secrets it refers to.

A secret stays out of the file: any string value may be written as a reference table,
``{env = "VAR"}`` (an environment variable) or ``{file = "/run/secrets/x"}`` (a file, as Kubernetes
mounts secrets; one trailing line break is dropped). References are resolved when the document is
loaded; a missing variable or unreadable file is a ConfigError naming the field and the source,
never the value."""

from __future__ import annotations

import json
import os
import stat
import sys
from collections.abc import Mapping
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


REFERENCE_KINDS = ("env", "file")
# Tables whose keys the operator names (developer keys, pool names): a key there called "env" or
# "file" is a name, not a reference.
NAMED_TABLES = ("keys", "pools")
MAX_SECRET_FILE_BYTES = 64 * 1024


def resolve_references(document: Any, path: str = "") -> Any:
    """The document with every ``{env = ...}`` / ``{file = ...}`` table replaced by the string it names."""
    if isinstance(document, Mapping):
        if _is_reference(document) and path.rsplit(".", 1)[-1] not in NAMED_TABLES:
            return _resolve(document, path or "config")
        return {key: resolve_references(value, _child(path, key)) for key, value in document.items()}
    if isinstance(document, list):
        return [resolve_references(value, f"{path}[{i}]") for i, value in enumerate(document)]
    return document


def _child(path: str, key: Any) -> str:
    if path in NAMED_TABLES:  # keys.<raw key> must not print the raw key
        return f"{path}.<{'key' if path == 'keys' else 'pool'}>"
    return f"{path}.{key}" if path else str(key)


def _is_reference(table: Mapping[Any, Any]) -> bool:
    return len(table) == 1 and next(iter(table)) in REFERENCE_KINDS


def _resolve(reference: Mapping[str, Any], path: str) -> str:
    kind, name = next(iter(reference.items()))
    if not isinstance(name, str) or not name:
        raise ConfigError(path, f"{{{kind} = ...}} must name a {'variable' if kind == 'env' else 'file'}")
    if kind == "env":
        value = os.environ.get(name)
        if value is None:
            raise ConfigError(path, f"environment variable {name} is not set")
        return value
    try:
        with open(name, "rb") as f:
            data = f.read(MAX_SECRET_FILE_BYTES + 1)
    except OSError as exc:
        raise ConfigError(path, f"cannot read secret file {name}: {exc.strerror or exc}") from None
    if len(data) > MAX_SECRET_FILE_BYTES:
        raise ConfigError(path, f"secret file {name} is larger than {MAX_SECRET_FILE_BYTES} bytes")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(path, f"secret file {name} is not UTF-8 text") from None
    return text.removesuffix("\n").removesuffix("\r")
