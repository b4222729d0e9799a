"""ace-mw: a closed-loop speculative-decoding control plane for Python LLM servers."""

__version__ = "0.1.0"

from .acceptance import AcceptanceFigures  # noqa: E402 (the version comes first: telemetry reads it)
from .adapters import EngineAdapter, Injection, get_adapter, register_adapter  # noqa: E402
from .config import AceConfig, GateConfig, KeySettings, Mode, SpeculativeParams, hash_key  # noqa: E402
from .controller import AceController, Decision  # noqa: E402
from .directive import SpecDirective  # noqa: E402
from .errors import AceError, ConfigError, InvalidOverrideHeader  # noqa: E402
from .observer import ResponseObserver  # noqa: E402
from .request import RequestView  # noqa: E402
from .state import BreakerView, InMemoryStateStore, StateStore  # noqa: E402

__all__ = [
    "AcceptanceFigures",
    "AceConfig",
    "AceController",
    "AceError",
    "BreakerView",
    "ConfigError",
    "Decision",
    "EngineAdapter",
    "GateConfig",
    "InMemoryStateStore",
    "Injection",
    "InvalidOverrideHeader",
    "KeySettings",
    "Mode",
    "RequestView",
    "ResponseObserver",
    "SpecDirective",
    "SpeculativeParams",
    "StateStore",
    "__version__",
    "get_adapter",
    "hash_key",
    "register_adapter",
]
