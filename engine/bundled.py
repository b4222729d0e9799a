"""The models bundled with the source repository, and what a command says when they are missing.

`models/` (the fixture models and the trained EAGLE head) lives in the repository, next to the
package folders, and is not part of the wheel. A command that loads model folders checks them
first, so a missing one ends in one line that says how to get them instead of a traceback.
"""

from __future__ import annotations

import json
from pathlib import Path

MODELS_DIR = Path(__file__).resolve().parent.parent / "models"


def missing(path: str | Path, what: str) -> str | None:
    """One line saying how to get `path` (the `what` a command needs, e.g. "--target"), or None
    when it exists. A path shaped like a hub id (`org/name`) also gets how to download it."""
    if Path(path).exists():
        return None
    text = str(path)
    hub_id = text.count("/") == 1 and all(text.split("/")) and not text.startswith((".", "~", "models/"))
    hint = (
        f" If {text!r} is a Hugging Face hub id: the engine loads local folders only, so download it first "
        f"(huggingface-cli download {text} --local-dir models/{text.split('/')[-1]}) and pass that folder."
        if hub_id
        else ""
    )
    return (
        f"{what} {text!r} not found. The bundled models and prompts (models/) come with "
        "a clone of the ace-mw repository, not with the installed package: run from the root of a "
        "clone, or pass paths of your own." + hint
    )


def exit_if_missing(path: str | Path, what: str) -> None:
    """For command-line entry points: SystemExit with that one line when `path` does not exist."""
    problem = missing(path, what)
    if problem is not None:
        raise SystemExit(f"error: {problem}")


def weight_files(path: str | Path) -> list[Path]:
    """The files of a local checkpoint: safetensors (single or sharded) or pytorch_model.bin; [] if
    none (a command can then say so before loading anything)."""
    path = Path(path)
    for single, index in (
        ("model.safetensors", "model.safetensors.index.json"),
        ("pytorch_model.bin", "pytorch_model.bin.index.json"),
    ):
        if (path / single).exists():
            return [path / single]
        if (path / index).exists():
            shards = sorted(set(json.loads((path / index).read_text())["weight_map"].values()))
            return [path / s for s in shards]
    return []
