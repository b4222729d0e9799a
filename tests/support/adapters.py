"""What the adapter and observer tests share (core/test_adapters*.py, core/test_observer*.py): the two
directives, request bodies, what an adapter forces, and reading a payload through a named adapter."""

from ace_mw.acceptance import AcceptanceFigures
from ace_mw.adapters import Injection, get_adapter
from ace_mw.adapters.base import FORCED_META_INFO, FORCED_USAGE
from ace_mw.directive import BASELINE_POOL, SPECULATIVE_POOL, SpecDirective

ON = SpecDirective(True, "eagle_2", 4, pool=SPECULATIVE_POOL, reason="ok", measure=True)
OFF = SpecDirective(False, pool=BASELINE_POOL, reason="temperature")
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 0.2}
STREAM = {**CHAT, "stream": True}
USAGE_FORCED = Injection(SPECULATIVE_POOL, ("stream_options.include_usage",), frozenset({FORCED_USAGE}))
META_FORCED = Injection(SPECULATIVE_POOL, ("return_meta_info",), frozenset({FORCED_META_INFO}))


def extract(name: str, payload: dict) -> AcceptanceFigures | None:
    return get_adapter(name).extract(payload)
