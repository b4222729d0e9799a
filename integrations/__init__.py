"""Framework integrations: ASGI middleware (Starlette, FastAPI) and gRPC server interceptors."""

from .asgi import STATE_DECISION, STATE_POOL, AceSpecDec
from .grpc import AceSpecDecAioInterceptor, AceSpecDecInterceptor, MessageFields, current_decision

__all__ = [
    "AceSpecDec",
    "AceSpecDecAioInterceptor",
    "AceSpecDecInterceptor",
    "MessageFields",
    "STATE_DECISION",
    "STATE_POOL",
    "current_decision",
]
