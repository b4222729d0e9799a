"""SIGTERM while a command's engine servers are up stops them too (`ace_mw/demo/signals.py`): a real
child process is sent the signal, and what it started must be gone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from ace_mw.demo.signals import EXIT_STATUS, sigterm_exits

# A command that starts a long-lived child inside `sigterm_exits`, stops it in `finally`, and says
# the child's pid once it is up.
HOLDS_A_CHILD = textwrap.dedent(
    """
    import subprocess, sys, time
    from ace_mw.demo.signals import sigterm_exits
    with sigterm_exits():
        child = subprocess.Popen(["sleep", "300"])
        try:
            print(child.pid, flush=True)
            time.sleep(300)
        finally:
            child.terminate()
            child.wait()
    """
)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped by its parent) is gone for our purposes
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:  # reaped between the two looks
        return False


def terminated(script: str, timeout_s: float = 60) -> tuple[int, int]:
    """Run ``script``, read the pid it prints, send it SIGTERM: (its exit status, that pid)."""
    process = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        pid = int(process.stdout.readline())
        assert alive(pid)
        process.send_signal(signal.SIGTERM)
        return process.wait(timeout_s), pid
    finally:
        if process.poll() is None:
            process.kill()


def gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_sigterm_unwinds_the_block_so_its_cleanup_stops_the_child():
    status, child = terminated(HOLDS_A_CHILD)
    assert status == EXIT_STATUS == 143
    assert gone_within(child, 5)


def test_the_previous_handler_is_back_after_the_block():
    before = signal.getsignal(signal.SIGTERM)
    with sigterm_exits():
        assert signal.getsignal(signal.SIGTERM) is not before
        with sigterm_exits():  # nested: the outer block's handler stays
            inner = signal.getsignal(signal.SIGTERM)
        assert signal.getsignal(signal.SIGTERM) is inner
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_handler_someone_else_set_is_left_alone():
    def theirs(signum, frame):
        pass

    before = signal.signal(signal.SIGTERM, theirs)
    try:
        with sigterm_exits():
            assert signal.getsignal(signal.SIGTERM) is theirs
        assert signal.getsignal(signal.SIGTERM) is theirs
    finally:
        signal.signal(signal.SIGTERM, before)


def test_off_the_main_thread_the_block_runs_as_it_is():
    seen = []

    def body():
        with sigterm_exits():
            seen.append(signal.getsignal(signal.SIGTERM))

    before = signal.getsignal(signal.SIGTERM)
    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
    assert seen == [before]


def test_a_terminated_command_leaves_no_llama_server_running():
    """The real case: `llamacpp.pools` (as `ace-mw demo --engine llamacpp` runs it), then SIGTERM."""
    llamacpp = pytest.importorskip("ace_mw.demo.llamacpp")
    if llamacpp.server_binary() is None:
        if os.environ.get("CI"):
            pytest.fail(f"llama-server is missing on CI: .ci/run builds it ({llamacpp.HOW_TO_GET})")
        pytest.skip(f"llama-server is not built here: {llamacpp.HOW_TO_GET}")
    script = textwrap.dedent(
        """
        import time
        from ace_mw.demo import llamacpp
        specs = {"baseline": llamacpp.bundled_specs()["baseline"]}
        with llamacpp.pools(specs) as servers:
            print(servers["baseline"]._process.pid, flush=True)
            time.sleep(300)
        """
    )
    status, server = terminated(script)
    assert status == EXIT_STATUS
    assert gone_within(server, 15)
