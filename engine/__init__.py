"""In-process speculative decoding engine (``pip install 'ace-mw[engine]'``)."""

from .engine import Engine, EngineError, GenerationResult, GenerationStats, SpecParams, StreamChunk

__all__ = ["Engine", "EngineError", "GenerationResult", "GenerationStats", "SpecParams", "StreamChunk"]
