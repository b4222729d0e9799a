"""Engine adapters: one per serving engine, chosen by name in the configuration (`adapter`)."""

from __future__ import annotations

from ..errors import ConfigError
from .ace import AceAdapter
from .base import NO_INJECTION, EngineAdapter, Injection
from .llamacpp import LlamaCppAdapter
from .sglang import SGLangAdapter
from .trtllm import TensorRTLLMAdapter
from .vllm import VLLMAdapter

# Adapters are stateless, so one shared instance per engine is enough.
_REGISTRY: dict[str, EngineAdapter] = {
    adapter.name: adapter
    for adapter in (AceAdapter(), VLLMAdapter(), SGLangAdapter(), TensorRTLLMAdapter(), LlamaCppAdapter())
}


def get_adapter(name: str) -> EngineAdapter:
    """The adapter registered under `name`; ConfigError naming the field if there is none."""
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise ConfigError(
            "adapter", f"unknown engine adapter {name!r}, expected one of {', '.join(sorted(_REGISTRY))}"
        ) from None


def register_adapter(adapter: EngineAdapter) -> None:
    """Make a custom engine's adapter available to `get_adapter` (and so to configurations)."""
    _REGISTRY[adapter.name] = adapter


__all__ = ["EngineAdapter", "Injection", "NO_INJECTION", "get_adapter", "register_adapter"]
