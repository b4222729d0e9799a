"""Zero-downtime configuration from a file: real files, a real uvicorn server and a real gRPC server.
A saved change is in force within the bound, a broken one is refused with its ConfigError message
while the old config keeps serving, and the status shows which version runs and what was refused."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import httpx
import pytest
from support.clock import Clock
from support.grpc_services import GENERATE, GENERATE_STREAM, Behaviour, SyncGeneration
from support.servers import serve_asgi, serve_grpc, wait_for
from support.upstream import FakeUpstream, Script

from ace_mw import AceConfig, AceController, ConfigError, RequestView
from ace_mw.integrations import AceSpecDec, AceSpecDecInterceptor, generation_pb2, generation_pb2_grpc
from ace_mw.integrations.status_page import render_status
from ace_mw.operate.reload import ConfigFile

INTERVAL = 0.05  # poll interval of these tests: a change applies within two of them
BOUND = 5.0  # the documented bound for the default interval; these tests must meet it with margin
BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 0.0}


def write(path: Path, text: str) -> None:
    """Save as an editor that replaces the file would (write aside, then rename over it)."""
    aside = path.with_suffix(".tmp")
    aside.write_text(text)
    os.replace(aside, path)


def outcome(url: str) -> str:
    response = httpx.post(url + "/v1/chat/completions", json=BODY, timeout=10)
    assert response.status_code == 200
    return response.headers["x-ace-speculative-decoding"]


def test_a_saved_change_is_served_within_the_bound(tmp_path):
    path = tmp_path / "ace.toml"
    path.write_text('mode = "off"\n')
    middleware = AceSpecDec(FakeUpstream(Script()).app, config=path, reload_interval_s=INTERVAL)
    try:
        with serve_asgi(middleware) as url:
            assert outcome(url) == "off"
            write(path, 'mode = "prod"\n')
            saved = time.monotonic()
            wait_for(lambda: outcome(url) == "applied", timeout=BOUND, what="the saved config to apply")
            assert time.monotonic() - saved < BOUND
            record = middleware.controller.config_record
            assert (record.version, record.source) == (2, f"file:{path}")
    finally:
        middleware.close()


def test_a_broken_file_is_refused_and_the_old_config_keeps_serving(tmp_path):
    path = tmp_path / "ace.toml"
    path.write_text('mode = "prod"\n')
    middleware = AceSpecDec(FakeUpstream(Script()).app, config=path, reload_interval_s=INTERVAL)
    controller = middleware.controller
    try:
        with serve_asgi(middleware) as url:
            write(path, 'mode = "prod"\n[gate]\nalpha_floor = 1.5\n')
            wait_for(lambda: controller.last_rejection is not None, timeout=BOUND, what="the rejection")
            assert controller.last_rejection.error == "gate.alpha_floor: must be in [0, 1], got 1.5"
            assert controller.last_rejection.source == f"file:{path}"
            assert controller.config_record.version == 1
            assert outcome(url) == "applied"  # still the old config
            status = controller.status()["config"]
            assert status["version"] == 1 and status["rejections"] == 1
            assert status["last_rejection"]["after_current"] is True

            write(path, "mode = [unclosed\n")  # not even TOML: refused the same way
            wait_for(lambda: controller.status()["config"]["rejections"] == 2, timeout=BOUND, what="2nd rejection")
            assert controller.last_rejection.error.startswith(f"{path}: cannot read configuration:")

            write(path, 'mode = "off"\n')  # fixed: applies
            wait_for(lambda: outcome(url) == "off", timeout=BOUND, what="the fixed config")
            assert controller.config_record.version == 2
            assert controller.status()["config"]["last_rejection"]["after_current"] is False
    finally:
        middleware.close()


@contextmanager
def polled_by_hand(path: Path, text: str, clock: Clock | None = None) -> Iterator[tuple[ConfigFile, AceController]]:
    """A controller following `path` whose watcher thread sleeps: the test calls poll() itself."""
    path.write_text(text)
    file = ConfigFile(path, clock=clock or Clock())
    controller = AceController(file.load(), source=file.source)
    file.start(controller, interval_s=3600)
    try:
        yield file, controller
    finally:
        file.stop()


def test_a_change_applies_only_once_it_has_settled(tmp_path):
    """Content seen once is pending; the same content at the next look applies."""
    path = tmp_path / "ace.json"
    with polled_by_hand(path, '{"mode": "off"}') as (file, controller):
        path.write_text('{"mode": "shad')  # an editor halfway through its write
        file.poll()
        path.write_text('{"mode": "shadow"}')
        file.poll()
        assert controller.config.mode.value == "off"  # changed since the last look: not yet
        file.poll()
        assert controller.config.mode.value == "shadow"
        assert controller.last_rejection is None  # the half-written content was never loaded
        file.poll()
        assert controller.config_record.version == 2  # unchanged content: no new version


def test_a_missing_file_is_refused_once_and_its_return_reapplies_nothing(tmp_path):
    path = tmp_path / "ace.toml"
    with polled_by_hand(path, 'mode = "prod"\n') as (file, controller):
        path.unlink()
        for _ in range(4):
            file.poll()
        assert controller.status()["config"]["rejections"] == 1  # reported once, not every poll
        assert "cannot read configuration" in controller.last_rejection.error
        assert controller.config.mode.value == "prod"
        path.write_text('mode = "prod"\n')  # the same content is back
        file.poll()
        file.poll()
        assert controller.config_record.version == 1


def test_an_invalid_file_at_startup_is_kept_to_refuse_the_apps_start(tmp_path):
    """Raised here it would be swallowed by Starlette's lazy middleware build under uvicorn's
    `--lifespan auto`; kept, it fails the start-up (tests/integrations/test_asgi_startup.py)."""
    path = tmp_path / "ace.toml"
    path.write_text('mode = "fast"\n')
    middleware = AceSpecDec(FakeUpstream(Script()).app, config=path)
    assert isinstance(middleware.config_error, ConfigError)
    assert str(middleware.config_error).startswith("mode: unknown mode 'fast'")


def test_reloading_can_be_switched_off(tmp_path):
    path = tmp_path / "ace.toml"
    path.write_text('mode = "off"\n')
    controller = AceController.from_file(path, reload_interval_s=None)
    write(path, 'mode = "prod"\n')
    time.sleep(0.3)
    assert controller.config.mode.value == "off"


def test_requests_decided_before_a_swap_keep_their_config(tmp_path):
    path = tmp_path / "ace.toml"
    path.write_text('mode = "prod"\n')
    controller = AceController.from_file(path, reload_interval_s=INTERVAL)
    try:
        before = controller.decide(RequestView("POST", "/v1/chat/completions", {}, dict(BODY), None))
        write(path, 'mode = "off"\n')
        wait_for(lambda: controller.config_record.version == 2, timeout=BOUND, what="the swap")
        assert before.config.mode.value == "prod" and before.outcome == "applied"
        controller.observe(before).finish()  # finishes against the config it was decided with
        after = controller.decide(RequestView("POST", "/v1/chat/completions", {}, dict(BODY), None))
        assert after.outcome == "off"
    finally:
        controller.close()


def test_a_sync_grpc_server_follows_the_file(tmp_path):
    """The watcher is a thread of its own: a sync gRPC server (no event loop) reloads the same way."""
    path = tmp_path / "ace.toml"
    methods = f'["{GENERATE}", "{GENERATE_STREAM}"]'
    path.write_text(f'mode = "off"\npaths = {methods}\n')
    interceptor = AceSpecDecInterceptor(path, reload_interval_s=INTERVAL)

    def call(stub) -> str:
        _, call = stub.Generate.with_call(generation_pb2.GenerateRequest(model="m", prompt="hi", temperature=0.0))
        return dict(call.trailing_metadata())["x-ace-speculative-decoding"]

    try:
        with serve_grpc(SyncGeneration(Behaviour()), [interceptor]) as target, grpc.insecure_channel(target) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            assert call(stub) == "off"
            write(path, f'mode = "prod"\npaths = {methods}\n')
            wait_for(lambda: call(stub) == "applied", timeout=BOUND, what="the gRPC side to reload")
    finally:
        interceptor.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_worker_keeps_following_the_file(tmp_path):
    """A pre-forking server (gunicorn --preload) builds the app before fork; threads do not survive
    fork, so the watcher restarts in the child."""
    path = tmp_path / "ace.toml"
    path.write_text('mode = "off"\n')
    controller = AceController.from_file(path, reload_interval_s=INTERVAL)
    try:
        pid = os.fork()
        if pid == 0:  # the child: wait for the change the parent saves
            code = 1
            try:
                deadline = time.monotonic() + BOUND
                while time.monotonic() < deadline and controller.config.mode.value != "prod":
                    time.sleep(0.01)
                code = 0 if controller.config.mode.value == "prod" else 1
            finally:
                os._exit(code)
        controller.close()  # the parent stops watching: only the child's own watcher can apply it
        write(path, 'mode = "prod"\n')
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert controller.config.mode.value == "off"
    finally:
        controller.close()


def test_config_from_bytes_names_the_source_of_a_bad_document():
    with pytest.raises(ConfigError, match="^body: cannot read configuration"):
        AceConfig.from_bytes(b"{not json", "json", "body")
    with pytest.raises(ConfigError, match="^body: unsupported format 'yaml'"):
        AceConfig.from_bytes(b"mode: prod", "yaml", "body")
    with pytest.raises(ConfigError, match="larger than"):
        AceConfig.from_bytes(b" " * (2 << 20), "json", "body")
    assert AceConfig.from_bytes(b'mode = "prod"', "toml").mode.value == "prod"


TOKEN = "adm-" + "r" * 32
KEYED = f"""mode = "prod"
adapter = "ace"

[admin]
token = "{TOKEN}"

[keys."sk-reload-off"]
mode = "off"
"""


def test_a_writer_stalled_mid_file_is_never_loaded(tmp_path):
    """A save written in place that pauses for several poll intervals: the prefix that parses (it
    lost [admin] and the key set to off) is held, the old config keeps serving, and the finished
    save applies."""
    path = tmp_path / "ace.toml"
    path.write_text(KEYED)
    upstream = FakeUpstream(Script())
    middleware = AceSpecDec(upstream.app, config=path, reload_interval_s=INTERVAL)
    controller = middleware.controller
    finished = KEYED.replace('mode = "prod"', 'mode = "shadow"', 1)
    cut = finished.index("[admin]")
    try:
        with serve_asgi(middleware) as url:
            with path.open("r+") as f:  # in place, as `cat > ace.toml` or a naive tool writes
                f.truncate(0)
                f.write(finished[:cut])
                f.flush()
                time.sleep(20 * INTERVAL)  # the writer stalls for twenty polls
                assert controller.config.mode.value == "prod" and controller.config.admin is not None
                off = httpx.post(
                    url + "/v1/chat/completions", json=BODY, headers={"authorization": "Bearer sk-reload-off"}
                )
                assert off.headers["x-ace-speculative-decoding"] == "off"
                assert httpx.get(url + "/ace/status").status_code == 401  # still the admin API's
                health = controller.status()["config"]["watchers"][0]
                assert health["held"]["why"] == "it drops [admin], [keys]"
                f.write(finished[cut:])
            wait_for(lambda: controller.config.mode.value == "shadow", timeout=BOUND, what="the finished save")
            assert controller.config.admin is not None and controller.last_rejection is None
            assert controller.config_record.version == 2
    finally:
        middleware.close()


def test_a_change_that_looks_unfinished_is_held_then_applied_with_a_warning(tmp_path, caplog):
    """Held, not refused: a file cut at a line, or one that really drops a table, applies once it
    has stayed the same for the hold (reload.HOLD_S, at least); a further change ends the hold."""
    clock = Clock()
    path = tmp_path / "ace.toml"
    with polled_by_hand(path, KEYED, clock) as (file, controller):
        path.write_text('mode = "prod"\n[gate]\nalpha_floor = 0.5')  # cut inside 0.55, no line break
        file.poll()
        file.poll()
        assert file.health()["held"]["why"] == "it drops [admin], [keys]"
        clock.now += file.health()["held"]["applies_in_s"] - 1
        file.poll()
        assert controller.config.gate.alpha_floor == 0.55 and "holds the change" in caplog.text
        path.write_text(KEYED.replace("[admin]", "[gate]\nalpha_floor = 0.6\n\n[admin]"))
        file.poll()
        file.poll()
        assert controller.config.gate.alpha_floor == 0.6  # whole: at once
        path.write_text('mode = "off"')  # no line break, and [admin], [keys] are gone for real
        file.poll()
        file.poll()
        assert file.health()["held"]["why"] == "it drops [admin], [gate], [keys]"
        clock.now += file.health()["held"]["applies_in_s"]
        file.poll()
        assert controller.config.mode.value == "off" and controller.config.admin is None
        assert file.health()["held"] is None


def test_a_fifo_at_the_config_path_is_refused_and_never_blocks_the_watcher(tmp_path):
    path = tmp_path / "ace.toml"
    path.write_text('mode = "off"\n')
    controller = AceController.from_file(path, reload_interval_s=INTERVAL)
    try:
        path.unlink()
        os.mkfifo(path)  # nobody ever writes to it: a blocking open would wait forever
        wait_for(lambda: controller.last_rejection is not None, timeout=BOUND, what="the FIFO's refusal")
        assert "not a regular file" in controller.last_rejection.error
        path.unlink()
        write(path, 'mode = "prod"\n')
        wait_for(lambda: controller.config.mode.value == "prod", timeout=BOUND, what="the save after the FIFO")
        assert controller.status()["config"]["watchers"][0]["stuck"] is False
    finally:
        controller.close()
    with pytest.raises(ConfigError, match="not a regular file"):
        os.unlink(path)
        os.mkfifo(path)
        AceController.from_file(path)


def test_a_stuck_or_failing_watcher_shows_on_the_status_page(tmp_path, monkeypatch):
    """A read that hangs (a hung network file system) or a poll that raises is on the page."""
    from ace_mw.operate import reload

    path = tmp_path / "ace.toml"
    path.write_text('mode = "off"\n')
    controller = AceController.from_file(path, reload_interval_s=INTERVAL)
    hung, release = threading.Event(), threading.Event()

    def hanging_read(p):
        hung.set()
        release.wait(30)
        raise OSError("hung")

    monkeypatch.setattr(reload, "STUCK_S", 0.2)
    monkeypatch.setattr(reload, "read_config_file", hanging_read)
    try:
        assert hung.wait(BOUND)
        wait_for(lambda: controller.status()["config"]["watchers"][0]["stuck"], timeout=BOUND, what="stuck")
        page = render_status(controller.status())
        assert "stuck reading the file" in page and str(path) in page
        monkeypatch.setattr(reload, "read_config_file", lambda p: 1 / 0)  # a bug: poll raises
        release.set()
        wait_for(lambda: controller.status()["config"]["watchers"][0]["failures_in_a_row"] >= 2, what="failures")
        page = render_status(controller.status())
        assert "polls in a row" in page and "ZeroDivisionError" in page
    finally:
        release.set()
        controller.close()
