"""A bad config cannot be missed: `uvicorn app:app` with a broken config exits non-zero with the
ConfigError on stderr under every lifespan setting that runs start-up, and with `--lifespan off`
every request gets a 500 that names the error (never a silent traceback per request)."""

from __future__ import annotations

import subprocess
import sys
import time

import httpx
import pytest
from support.ports import free_port

APP = """
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route

from ace_mw.integrations import AceSpecDec


async def hello(request):
    return JSONResponse({{"ok": True}})


app = Starlette(routes=[Route("/hello", hello)])
app.add_middleware(AceSpecDec, config={config})
"""


def write_app(tmp_path, config: str) -> None:
    (tmp_path / "app.py").write_text(APP.format(config=config))


def uvicorn(tmp_path, *flags: str, port: int | None = None) -> subprocess.Popen:
    command = [sys.executable, "-m", "uvicorn", "app:app", "--port", str(port or free_port()), *flags]
    return subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


CONFIGS = {
    "broken file": ("'broken.toml'", 'mode = "prod"\nadapter = "vlm"\n'),
    "dict with a typo": ('{"mode": "prod", "adapter": "vlm"}', None),
    "unknown field": ('{"mode": "prod", "adaptr": "vllm"}', None),
}


@pytest.mark.parametrize("case", CONFIGS)
@pytest.mark.parametrize("lifespan", [[], ["--lifespan", "on"], ["--lifespan", "auto"]])
def test_uvicorn_exits_non_zero_with_the_config_error_on_stderr(tmp_path, case, lifespan):
    config, file_text = CONFIGS[case]
    if file_text is not None:
        (tmp_path / "broken.toml").write_text(file_text)
    write_app(tmp_path, config)
    process = uvicorn(tmp_path, *lifespan)
    try:
        _, stderr = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode != 0
    assert "ace-mw: invalid configuration" in stderr
    assert ("did you mean 'adapter'" if case == "unknown field" else "vlm") in stderr
    assert "Application startup complete" not in stderr


def test_with_lifespan_off_every_request_gets_a_500_that_names_the_error(tmp_path):
    write_app(tmp_path, '{"mode": "prod", "adapter": "vlm"}')
    port = free_port()
    process = uvicorn(tmp_path, "--lifespan", "off", port=port)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                response = httpx.get(f"http://127.0.0.1:{port}/hello", timeout=5)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "uvicorn never answered"
                time.sleep(0.1)
        assert response.status_code == 500
        error = response.json()["error"]
        assert error["type"] == "ace_config_error" and "adapter" in error["message"] and "vlm" in error["message"]
    finally:
        process.terminate()
        _, stderr = process.communicate(timeout=30)
    assert "ace-mw: invalid configuration" in stderr


def test_a_required_redis_that_cannot_be_reached_fails_start_up(tmp_path):
    pytest.importorskip("redis")
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    write_app(tmp_path, repr({"mode": "prod", "state": {"backend": "redis", "url": url, "required": True}}))
    process = uvicorn(tmp_path)
    try:
        _, stderr = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode != 0
    assert "state.required: Redis at redis://127.0.0.1" in stderr and "cannot be reached" in stderr


# -- the same, in this process ------------------------------------------------------------------------


def test_an_invalid_config_fails_the_lifespan_start_up_with_its_message():
    import anyio
    from support.upstream import FakeUpstream

    from ace_mw.integrations import AceSpecDec

    middleware = AceSpecDec(FakeUpstream().app, config={"mode": "prod", "adapter": "vlm"})
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "lifespan.startup"}

    async def send(message: dict) -> None:
        sent.append(message)

    anyio.run(middleware, {"type": "lifespan"}, receive, send)
    (failed,) = sent
    assert failed["type"] == "lifespan.startup.failed" and "adapter" in failed["message"]


def test_an_invalid_config_answers_every_request_with_a_500_naming_it():
    from support.servers import serve_asgi
    from support.upstream import FakeUpstream

    from ace_mw.integrations import AceSpecDec

    with serve_asgi(AceSpecDec(FakeUpstream().app, config={"mode": "prod", "adaptr": "vllm"})) as url:
        for path in ("/v1/chat/completions", "/anything"):
            response = httpx.post(url + path, json={}, timeout=10)
            assert response.status_code == 500
            assert (
                response.json()["error"]["message"]
                == "ace-mw: invalid configuration: adaptr: unknown field; did you mean 'adapter'?"
            )
