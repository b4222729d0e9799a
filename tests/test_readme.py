"""The README's minimal example works as printed: it is extracted, served with uvicorn and called."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest
from servers import serve_asgi

README = Path(__file__).resolve().parent.parent / "README.md"


@pytest.fixture(scope="module")
def url():
    code = re.search(r"## Minimal example\n\n```python\n(.*?)```", README.read_text(), re.S).group(1)
    namespace: dict = {}
    exec(compile(code, str(README), "exec"), namespace)
    with serve_asgi(namespace["app"]) as base:
        yield base


@pytest.mark.parametrize(
    "key, temperature, pool, outcome",
    [
        ("sk-any", 0.0, "speculative", "applied"),
        ("sk-any", 1.0, "baseline", "gated"),
        ("sk-team-a", 0.0, "baseline", "shadow"),
    ],
)
def test_minimal_example_picks_the_pool_per_request(url, key, temperature, pool, outcome):
    response = httpx.post(
        url + "/v1/chat/completions",
        headers={"authorization": f"Bearer {key}"},
        json={"model": "m", "messages": [], "temperature": temperature},
    )
    assert response.json() == {"pool": pool}
    assert response.headers["x-ace-speculative-decoding"] == outcome
