"""The models bundled with the source repository, and what a command says when they are missing.

`models/` (the fixture models and the trained EAGLE head) lives in the repository, next to the
package folders, and is not part of the wheel. A command that loads model folders checks them
first, so a missing one ends in one line that says how to get them instead of a traceback.
"""

from __future__ import annotations

from pathlib import Path

MODELS_DIR = Path(__file__).resolve().parent.parent / "models"


def exit_if_missing(path: str | Path, what: str) -> None:
    """For command-line entry points: SystemExit with one line when `path` (the `what` a command
    needs, e.g. "--target") does not exist."""
    if not Path(path).exists():
        raise SystemExit(
            f"error: {what} {str(path)!r} not found. The bundled models and prompts (models/) come with "
            "a clone of the ace-mw repository, not with the installed package: run from the root of a "
            "clone, or pass paths of your own."
        )
