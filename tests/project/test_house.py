"""The house kept: no Python module of the project over 500 lines unless its docstring says why
("Over 500 lines, on purpose: ..."), so that a module stays one idea a reader can hold."""

from __future__ import annotations

import ast

from support.paths import ROOT

LIMIT = 500
FOLDERS = ("ace_mw", "integrations", "engine", "benchmarks", "examples", "tests")
REASON = f"Over {LIMIT} lines, on purpose:"


def modules():
    for folder in FOLDERS:
        yield from (ROOT / folder).rglob("*.py")


def test_no_module_is_over_500_lines_without_saying_why():
    found = list(modules())
    assert len(found) > 100  # the walk found the project
    long = {}
    for path in found:
        text = path.read_text(encoding="utf-8")
        lines = text.count("\n")
        if lines > LIMIT and REASON not in (ast.get_docstring(ast.parse(text)) or ""):
            long[str(path.relative_to(ROOT))] = lines
    assert not long, f"over {LIMIT} lines, with no '{REASON}' in the docstring: {long}"
