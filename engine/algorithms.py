"""The algorithms the engine runs, as one table: what each drafts with, its default K, and how it
builds a request's drafter (SGLang's `SpeculativeAlgorithm` is the model).

A **source** is what an algorithm drafts with, loaded next to the target: a draft model, an
EAGLE-1/2 head or an EAGLE-3 head, each with the costs its plans are priced by. Prompt lookup needs
none; `baseline` drafts nothing and has no entry.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ace_mw.vocabulary import Algorithm, Word

from .drafting.drafters import Drafter, NgramDrafter
from .params import EngineError, SpecParams
from .planning.cost import EngineCosts


class Source(Word):
    """What an algorithm drafts with (its word is how an error names it)."""

    DRAFT_MODEL = "a draft model"
    EAGLE_HEAD = "an EAGLE head (EAGLE-1/2)"
    EAGLE3_HEAD = "an EAGLE-3 head"


@dataclass(frozen=True)
class Loaded:
    """A source as the engine loaded it: the model that drafts, and the costs its plans are priced by."""

    model: Any
    costs: EngineCosts


@dataclass(frozen=True)
class DraftSetup:
    """Everything a builder reads: the request's parameters and the engine's shared parts."""

    spec: SpecParams
    k: int  # the request's K (chain length, tree depth), its default filled in
    tree_budget: int  # eagle_2/eagle_3 tokens per step at most
    source: Loaded | None
    target: Any  # the target model (a head drafts from its embeddings)
    device: torch.device


# A builder returns the request's drafter; None where the loop drafts for it (a draft model drafts
# a level for all its rows in one batched forward, ``batching/scheduler.py``).
Build = Callable[[DraftSetup], Drafter | None]


def _ngram(s: DraftSetup) -> Drafter:
    return NgramDrafter(device=s.device)


def _draft_model(s: DraftSetup) -> None:
    return None


def _static_tree(s: DraftSetup) -> Drafter:
    from .drafting.eagle import EagleDrafter

    assert s.source is not None
    return EagleDrafter(s.source.model, s.target, s.spec.tree_choices)


def _dynamic_tree(s: DraftSetup) -> Drafter:
    from .drafting.eagle import Eagle2Drafter

    assert s.source is not None
    return Eagle2Drafter(s.source.model, s.target, s.tree_budget, s.k)


@dataclass(frozen=True)
class Entry:
    default_k: int  # K when the request gives none
    source: Source | None  # what it drafts with; None: nothing to load
    build: Build


# Prompt lookup proposes up to 10 (as transformers), a draft model about 4 (each draft token costs a
# draft forward), EAGLE-2 grows 6 levels.
ALGORITHMS: dict[Algorithm, Entry] = {
    Algorithm.NGRAM: Entry(10, None, _ngram),
    Algorithm.DRAFT_MODEL: Entry(4, Source.DRAFT_MODEL, _draft_model),
    Algorithm.EAGLE: Entry(5, Source.EAGLE_HEAD, _static_tree),
    Algorithm.EAGLE_2: Entry(6, Source.EAGLE_HEAD, _dynamic_tree),
    Algorithm.EAGLE_3: Entry(6, Source.EAGLE3_HEAD, _dynamic_tree),
}

# What to load for each source, as the Python API and the command line name it.
LOAD_HINTS = {
    Source.DRAFT_MODEL: "draft=PATH (Python) or --draft DIR (ace-mw serve)",
    Source.EAGLE_HEAD: "eagle=PATH (Python) or --eagle DIR (ace-mw serve)",
    Source.EAGLE3_HEAD: "eagle=PATH (Python) or --eagle DIR (ace-mw serve)",
}


def entry(algorithm: str) -> Entry | None:
    """The algorithm's entry (None for baseline); an unknown name is an EngineError."""
    if algorithm == Algorithm.BASELINE:
        return None
    if algorithm not in ALGORITHMS:
        known = [str(a) for a in Algorithm]
        raise EngineError(
            f"speculative algorithm {algorithm!r} is unknown; expected one of {known}",
            "speculative_algorithm",
            "unknown_speculative_algorithm",
        )
    return ALGORITHMS[Algorithm(algorithm)]


def missing_source(algorithm: str, source: Source) -> EngineError:
    return EngineError(
        f"algorithm {algorithm!r} needs {source}: load the engine with {LOAD_HINTS[source]}",
        "speculative_algorithm",
        "missing_drafter",
    )
