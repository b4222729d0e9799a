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
    """Make a custom engine's adapter available to `get_adapter` (and so to configurations).

    The whole contract is checked here: an adapter missing a part of it would otherwise fail in
    the response observer, where failing open hides it (the breaker would silently never learn).
    Raises TypeError naming what is missing.
    """
    name = getattr(adapter, "name", None)
    if not isinstance(name, str) or not name:
        raise TypeError(f"an engine adapter needs a non-empty str `name`, got {name!r}")
    for method in ("inject", "extract", "strip"):
        if not callable(getattr(adapter, method, None)):
            raise TypeError(f"engine adapter {name!r} has no {method}() method")
    for markers in ("figure_markers", "strip_markers"):
        value = getattr(adapter, markers, None)
        if not isinstance(value, tuple) or not all(isinstance(marker, str) for marker in value):
            raise TypeError(
                f"engine adapter {name!r}: `{markers}` must be a tuple of str, got {value!r} "
                "(('',) has every SSE event read, () none)"
            )
    _REGISTRY[name] = adapter


__all__ = ["EngineAdapter", "Injection", "NO_INJECTION", "get_adapter", "register_adapter"]
