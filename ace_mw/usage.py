"""Command lines that help: every parser of the package (`ace-mw` and its subcommands, the engine's
server, bench and training) answers an unknown flag or command with the closest one it knows."""

from __future__ import annotations

import argparse
import difflib
import sys
from typing import NoReturn


class Parser(argparse.ArgumentParser):
    """argparse with "did you mean": an unknown flag or command names the closest one."""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {message}{self._suggestion(message)}\n")

    def _suggestion(self, message: str) -> str:
        if message.startswith("unrecognized arguments: "):
            flags = [f for action in self._actions for f in action.option_strings if f.startswith("--")]
            for given in message.removeprefix("unrecognized arguments: ").split():
                close = difflib.get_close_matches(given.split("=", 1)[0], flags, n=1)
                if close:
                    return f" (did you mean {close[0]}?)"
        if "invalid choice: " in message:
            given = message.split("invalid choice: ", 1)[1].split("'")[1]
            choices = [c for action in self._actions for c in (action.choices or ())]
            close = difflib.get_close_matches(given, [str(c) for c in choices], n=1)
            if close:
                return f" (did you mean {close[0]!r}?)"
        return ""
