"""In-process speculative decoding engine (``pip install 'ace-mw[engine]'``).

The engine's names load torch on first use, not on import of the package, so that its torch-free
modules (``bundled``: where the bundled models live; ``prompts``: the held-out prompts) import
without it: the demo layer reads them on a machine that installed the middleware alone.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .engine import Engine
    from .generation import GenerationResult, GenerationStats, StreamChunk
    from .params import EngineError, SamplingParams, SpecParams

__all__ = [
    "Engine",
    "EngineError",
    "GenerationResult",
    "GenerationStats",
    "SamplingParams",
    "SpecParams",
    "StreamChunk",
]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from . import engine, params

        return getattr(params if hasattr(params, name) else engine, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
