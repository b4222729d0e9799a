"""docs/configuration.md against the config schema: every field of every section is documented, with
its default, and nothing documented is gone from the code, so the reference cannot drift.

The sections come from the code: the top level (`AceConfig`), each of its fields that is a section
of its own (a dataclass, or an optional one: `speculative`, `gate`, `state`, `admin`, and any added
later) under a heading `` `name` ``, and the developer keys' fields (`KeySettings`) in the "key
field" table. A field a section cannot do without (constructing it with defaults is a
`ConfigError` naming it) must be documented as required."""

from __future__ import annotations

import dataclasses
import enum
import math
import re
import sys
import types
import typing
from typing import Any

import pytest
from support.paths import ROOT

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib


from ace_mw import AceConfig, ConfigError, KeySettings

DOC = ROOT / "docs" / "configuration.md"


def sections() -> dict[str, str]:
    """Markdown text under each `## ` heading."""
    parts = re.split(r"^## (.+)$", DOC.read_text(), flags=re.M)
    return {title.strip(): body for title, body in zip(parts[1::2], parts[2::2], strict=True)}


def field_table(text: str, first_column: str) -> dict[str, str]:
    """{field: default cell} of the first table whose first column is `first_column`."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and cells[0] == first_column and cells[1] == "default":
            rows = {}
            for row in lines[i + 2 :]:
                if not row.startswith("|"):
                    break
                name, default = (c.strip() for c in row.strip().strip("|").split("|")[:2])
                rows[name.strip("`")] = default
            return rows
    raise AssertionError(f"no table with columns `{first_column} | default`")


def init_fields(cls: type) -> list[dataclasses.Field[Any]]:
    return [f for f in dataclasses.fields(cls) if f.init]


def default_of(f: dataclasses.Field[Any]) -> Any:
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def nested() -> dict[str, type]:
    """AceConfig's fields that are sections of their own: typed as a dataclass (optional or not)."""
    hints = typing.get_type_hints(AceConfig)
    sections = {}
    for f in init_fields(AceConfig):
        hint = hints[f.name]
        optional = typing.get_origin(hint) in (typing.Union, types.UnionType)  # `X | None`, not `Mapping[str, X]`
        for candidate in typing.get_args(hint) if optional else (hint,):
            if isinstance(candidate, type) and dataclasses.is_dataclass(candidate):
                sections[f.name] = candidate
    return sections


def required(cls: type) -> str | None:
    """The field a section cannot do without: the one its all-defaults construction names."""
    try:
        cls()
    except ConfigError as exc:
        return exc.path.rsplit(".", 1)[-1]
    return None


def as_json(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (tuple, list)):
        return [as_json(v) for v in value]
    if isinstance(value, dict):
        return {k: as_json(v) for k, v in value.items()}
    return value


def documented(cell: str, value: Any) -> bool:
    """Whether a default cell says `value`: `none ...` / `inherit ...` for None; for a section,
    `see below` or an inline table of some of its fields at their defaults; else its first code
    span, read as a TOML value (JSON literals are TOML too)."""
    text = cell.lower()
    if value is None:
        return text.startswith(("none", "inherit"))
    if dataclasses.is_dataclass(value) and text.startswith("see below"):
        return True
    span = re.search(r"`([^`]+)`", cell)
    if span is None:
        return False
    try:
        written = tomllib.loads(f"value = {span.group(1)}")["value"]
    except tomllib.TOMLDecodeError:
        return False
    if dataclasses.is_dataclass(value):
        names = {f.name for f in init_fields(type(value))}
        return bool(written) and all(k in names and as_json(getattr(value, k)) == v for k, v in written.items())
    expected = as_json(value)
    if isinstance(expected, float) and isinstance(written, (int, float)) and not isinstance(written, bool):
        return math.isclose(written, expected)
    return bool(written == expected)


TABLES = [
    ("top level", AceConfig, lambda s: next(b for t, b in s.items() if t.startswith("Top level")), "field"),
    *((f"`{name}`", cls, lambda s, name=name: s[f"`{name}`"], "field") for name, cls in nested().items()),
    ("developer keys", KeySettings, lambda s: s["Developer keys"], "key field"),
]


@pytest.mark.parametrize("title, cls, find, column", TABLES, ids=[t[0] for t in TABLES])
def test_every_field_is_documented_with_its_default(title, cls, find, column):
    table = field_table(find(sections()), column)
    fields = {f.name: f for f in init_fields(cls)}
    assert sorted(set(fields) - set(table)) == [], f"{title}: fields missing from docs/configuration.md"
    assert sorted(set(table) - set(fields)) == [], f"{title}: documented fields the code does not have"
    must = required(cls)
    wrong = {
        name: table[name]
        for name, f in fields.items()
        if not ("required" in table[name].lower() if name == must else documented(table[name], default_of(f)))
    }
    assert wrong == {}, f"{title}: documented defaults that differ from the code"


def test_the_nested_sections_include_every_table_of_the_reference():
    assert {"speculative", "gate", "state", "admin"} <= set(nested())
    assert required(nested()["admin"]) == "token" and required(nested()["gate"]) is None


@dataclasses.dataclass
class Section:
    backend: str = "memory"
    size: int = 3


@pytest.mark.parametrize(
    "cell, value, expected",
    [
        ("`0.70`", 0.7, True),
        ("`0.75`", 0.7, False),
        ('`"shadow"`', "shadow", True),
        ('`["/a", "/b"]`', ("/a", "/b"), True),
        ("none (engine default tree)", None, True),
        ("`5`", None, False),
        ("see below", 5, False),
        ("`{}`", {}, True),
        ("`{speculative = 1}`", {}, False),
        ('`{backend = "memory"}`', Section(), True),
        ('`{backend = "redis"}`', Section(), False),
        ('`{backend = "memory", colour = 1}`', Section(), False),
        ("see below", Section(), True),
    ],
)
def test_default_cells_are_read_strictly(cell, value, expected):
    assert documented(cell, value) is expected
