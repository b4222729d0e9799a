"""ace-mw: a closed-loop speculative-decoding control plane for Python LLM servers."""

from .acceptance import AcceptanceFigures
from .adapters import EngineAdapter, Injection, get_adapter, register_adapter
from .config import AceConfig, GateConfig, KeySettings, Mode, SpeculativeParams, hash_key
from .controller import AceController
from .decision import Decision
from .directive import SpecDirective
from .errors import AceError, AmbiguousIdentity, ClientError, ConfigError, InvalidOverrideHeader
from .observe.observer import ResponseObserver
from .request import RequestView
from .state import BreakerView, InMemoryStateStore, StateStore
from .version import __version__

__all__ = [
    "AcceptanceFigures",
    "AceConfig",
    "AceController",
    "AceError",
    "AmbiguousIdentity",
    "BreakerView",
    "ClientError",
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
