"""Real llama.cpp servers from package registries only, for the demo, the benchmarks and the tests.

llama-server is built from the llama.cpp that the pinned `llama-cpp-python` sdist on PyPI vendors
(its sha256 checked), the server target alone, in a cache that survives between runs; the bundled
models are converted to GGUF with the converter of the same sdist, deterministically, cached by
the sha256 of their weights; servers start on free loopback ports and are stopped with their
context. Nothing of llama.cpp is committed: it is fetched and built here.

    python -m ace_mw.demo.llamacpp build     # once per machine (4-12 minutes on 2 cores), then cached
    python -m ace_mw.demo.llamacpp where     # the binary, or how to get it

`ACE_MW_CACHE` moves the cache (default ~/.cache/ace-mw); `ACE_MW_LLAMA_SERVER` names a binary
built elsewhere.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ace_mw.usage import Parser

from .signals import sigterm_exits

SDIST = "llama-cpp-python"
VERSION = "0.3.36"  # vendors llama.cpp 0c1e570 (build b1-0c1e570)
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
LLAMA_CPP_COMMIT = "0c1e570"
# Only what llama-server needs: no libcurl, no OpenSSL, no web UI to download, no tests; static
# libraries, so the binary runs from wherever the cache is. For this machine's CPU (GGML_NATIVE).
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
)
# The bundled tokenizer is ByteLevel(use_regex=True) with no normalizer: GPT-2's split rule, which
# the converter does not know by this tokenizer's hash (it asks for an update of its table).
BUNDLED_PRE_TOKENIZER = "gpt-2"
HOW_TO_GET = f"python -m ace_mw.demo.llamacpp build (builds llama-server from {SDIST}=={VERSION}, 4-12 min)"


class LlamaCppError(RuntimeError):
    """llama-server could not be built, a model converted, or a server started (one line)."""


def cache_dir() -> Path:
    return Path(os.environ.get("ACE_MW_CACHE") or Path.home() / ".cache" / "ace-mw") / "llama.cpp" / VERSION


def server_binary() -> Path | None:
    """The llama-server to run: `ACE_MW_LLAMA_SERVER`, else the cached build; None if neither."""
    named = os.environ.get("ACE_MW_LLAMA_SERVER")
    if named:
        return Path(named) if Path(named).is_file() else None
    built = _build_dir() / "bin" / "llama-server"
    return built if built.is_file() else None


def _build_dir() -> Path:
    """One build per set of flags: a change of flags builds afresh."""
    return cache_dir() / f"build-{hashlib.sha256(' '.join(CMAKE_FLAGS).encode()).hexdigest()[:8]}"


def source(log: Iterator[str] | None = None) -> Path:
    """The vendored llama.cpp of the pinned sdist, downloaded from PyPI and unpacked once."""
    root = cache_dir()
    tree = root / f"llama_cpp_python-{VERSION}" / "vendor" / "llama.cpp"
    if (tree / "CMakeLists.txt").is_file():
        return tree
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root) as scratch:
        _run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:"]
            + [f"{SDIST}=={VERSION}", "-d", scratch],
            "download the sdist",
        )
        (archive,) = Path(scratch).glob("*.tar.gz")
        digest = hashlib.sha256(archive.read_bytes()).hexdigest()
        if digest != SDIST_SHA256:
            raise LlamaCppError(f"{archive.name}: sha256 {digest}, expected {SDIST_SHA256}: refused")
        with tarfile.open(archive) as tar:
            tar.extractall(scratch, filter="data")
        shutil.rmtree(root / f"llama_cpp_python-{VERSION}", ignore_errors=True)
        (Path(scratch) / f"llama_cpp_python-{VERSION}").rename(root / f"llama_cpp_python-{VERSION}")
    return tree


def build(jobs: int | None = None) -> Path:
    """Build llama-server (only that target) into the cache, unless it is there; its path."""
    found = _build_dir() / "bin" / "llama-server"
    if found.is_file():
        return found
    if shutil.which("cmake") is None or shutil.which("c++") is None:
        raise LlamaCppError("building llama-server needs cmake and a C++ compiler (Debian: build-essential cmake)")
    tree = source()
    out = _build_dir()
    _run(["cmake", "-S", str(tree), "-B", str(out), *CMAKE_FLAGS], "configure llama.cpp")
    jobs = jobs or os.cpu_count() or 2
    _run(["cmake", "--build", str(out), "--target", "llama-server", "-j", str(jobs)], "build llama-server")
    if not found.is_file():
        raise LlamaCppError(f"the build finished without {found}")
    return found


def gguf(model_dir: Path, outtype: str = "f32") -> Path:
    """The GGUF of a Hugging Face model folder (converted once, cached by the weights' sha256:
    the conversion is deterministic, so the same weights give the same file)."""
    weights = sorted(model_dir.glob("*.safetensors"))
    if not weights:
        raise LlamaCppError(f"{model_dir}: no .safetensors weights to convert")
    digest = hashlib.sha256()
    for path in weights:
        digest.update(path.read_bytes())
    target = cache_dir() / "gguf" / f"{model_dir.name}-{digest.hexdigest()[:16]}-{outtype}.gguf"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".partial")
    _run(
        [sys.executable, "-m", "ace_mw.demo.llamacpp", "convert", str(model_dir), str(partial), outtype],
        f"convert {model_dir.name} to GGUF",
    )
    partial.replace(target)
    return target


def _convert(model_dir: Path, out: Path, outtype: str) -> None:
    """Run the sdist's convert_hf_to_gguf.py in this process, telling it the bundled tokenizer's
    pre-tokenizer (its table does not know this tokenizer's hash)."""
    import runpy

    tree = source()
    sys.path[:0] = [str(tree), str(tree / "gguf-py")]
    import conversion.base as base  # type: ignore[import-not-found]  # the sdist's converter, put on the path above

    owner: Any = next(c for c in vars(base).values() if isinstance(c, type) and "get_vocab_base_pre" in vars(c))
    known = owner.get_vocab_base_pre
    bundled = _is_bundled_tokenizer(model_dir)

    def get_vocab_base_pre(self: object, tokenizer: object) -> str:
        try:
            return str(known(self, tokenizer))
        except NotImplementedError:
            if not bundled:
                raise
            return BUNDLED_PRE_TOKENIZER

    owner.get_vocab_base_pre = get_vocab_base_pre
    sys.argv = ["convert_hf_to_gguf.py", str(model_dir), "--outfile", str(out), "--outtype", outtype]
    runpy.run_path(str(tree / "convert_hf_to_gguf.py"), run_name="__main__")


def _is_bundled_tokenizer(model_dir: Path) -> bool:
    from ace_mw.engine.bundled import MODELS_DIR

    def digest(folder: Path) -> str | None:
        path = folder / "tokenizer.json"
        return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None

    return digest(model_dir) is not None and digest(model_dir) == digest(MODELS_DIR / "ace-tiny-chat")


# -- servers ------------------------------------------------------------------------------------

SPEC_TYPES = ("none", "draft", "ngram")


@dataclass(frozen=True)
class ServerSpec:
    """One llama-server: its GGUF model, how it speculates (none, a draft model, prompt lookup),
    threads (generation and batch, the draft's too) and parallel slots."""

    model: Path
    spec: str = "none"
    draft: Path | None = None
    threads: int = 1
    parallel: int = 1
    context: int = 4096
    draft_max: int = 8
    ngram_n: int = 3
    ngram_m: int = 10
    cores: str | None = None  # taskset list the server is pinned to, e.g. "0" or "0-1"

    def flags(self) -> list[str]:
        """The command-line flags of llama.cpp 0c1e570 (docs/adapters.md has both generations)."""
        threads = ["-t", str(self.threads), "-tb", str(self.threads)]
        flags = ["-m", str(self.model), *threads, "-np", str(self.parallel), "-c", str(self.context * self.parallel)]
        if self.spec == "draft":
            if self.draft is None:
                raise ValueError("a draft server needs a draft model")
            flags += ["-md", str(self.draft), "--spec-type", "draft-simple"]
            flags += ["--spec-draft-n-max", str(self.draft_max), "--spec-draft-n-min", "0"]
            flags += ["-td", str(self.threads), "-tbd", str(self.threads)]
        elif self.spec == "ngram":
            flags += ["--spec-type", "ngram-simple"]
            flags += ["--spec-ngram-simple-size-n", str(self.ngram_n), "--spec-ngram-simple-size-m", str(self.ngram_m)]
        elif self.spec != "none":
            raise ValueError(f"spec must be one of {', '.join(SPEC_TYPES)}, got {self.spec!r}")
        return flags + ["--no-webui"]


class LlamaServer:
    """A llama-server process on a free loopback port: `with LlamaServer(spec) as server:`, then
    `server.url`. Its log is kept for errors (`log_tail`)."""

    def __init__(self, spec: ServerSpec, binary: Path | None = None) -> None:
        found = binary or server_binary()
        if found is None:
            raise LlamaCppError(f"llama-server is not built here: {HOW_TO_GET}")
        self.spec = spec
        self.binary = found
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = tempfile.NamedTemporaryFile(prefix="llama-server-", suffix=".log", delete=False)
        self._process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> LlamaServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self, timeout_s: float = 120.0) -> None:
        command = [str(self.binary), *self.spec.flags(), "--host", "127.0.0.1", "--port", str(self.port)]
        if self.spec.cores:
            command = ["taskset", "-c", self.spec.cores, *command]
        self._process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while True:
            if self._process.poll() is not None:
                raise LlamaCppError(f"llama-server exited with {self._process.returncode}: {self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as reply:
                    if json.load(reply).get("status") == "ok":
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise LlamaCppError(f"llama-server did not become ready in {timeout_s:.0f} s: {self.log_tail()}")
            time.sleep(0.1)

    def stop(self) -> None:
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            process.terminate()
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(10)

    def log_tail(self, size: int = 2000) -> str:
        self._log.flush()
        return Path(self._log.name).read_text(errors="replace")[-size:].replace("\n", " | ")


@contextmanager
def pools(specs: dict[str, ServerSpec], binary: Path | None = None) -> Iterator[dict[str, LlamaServer]]:
    """Several servers at once (started one after the other, all stopped on exit, SIGTERM
    included: ``signals.py``): name -> server."""
    started: dict[str, LlamaServer] = {}
    with sigterm_exits():
        try:
            for name, spec in specs.items():
                started[name] = LlamaServer(spec, binary)
                started[name].start()
            yield started
        finally:
            for server in started.values():
                server.stop()


def bundled_specs(threads: int = 1, parallel: int = 1, outtype: str = "f32") -> dict[str, ServerSpec]:
    """The three pools of the bundled models: plain, prompt lookup and the draft model."""
    from ace_mw.engine.bundled import MODELS_DIR

    target = gguf(MODELS_DIR / "ace-tiny-chat", outtype)
    draft = gguf(MODELS_DIR / "ace-tiny-chat-draft", outtype)
    return {
        "baseline": ServerSpec(target, threads=threads, parallel=parallel),
        "ngram": ServerSpec(target, "ngram", threads=threads, parallel=parallel),
        "draft": ServerSpec(target, "draft", draft, threads=threads, parallel=parallel),
    }


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _run(command: Sequence[str], what: str) -> None:
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout)[-1500:].strip().replace("\n", " | ")
        raise LlamaCppError(f"could not {what} (exit {done.returncode}): {tail}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = Parser(prog="python -m ace_mw.demo.llamacpp", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    built = commands.add_parser("build", help="build llama-server into the cache (and convert the bundled models)")
    built.add_argument("-j", "--jobs", type=int, help="parallel compile jobs (default: every core)")
    commands.add_parser("where", help="print the llama-server binary, or how to get it (exit 1)")
    convert = commands.add_parser("convert", help=argparse.SUPPRESS)
    convert.add_argument("model", type=Path)
    convert.add_argument("out", type=Path)
    convert.add_argument("outtype")
    args = parser.parse_args(argv)
    try:
        if args.command == "convert":
            _convert(args.model, args.out, args.outtype)
        elif args.command == "build":
            started = time.monotonic()
            print(f"llama-server: {build(args.jobs)} ({time.monotonic() - started:.0f} s)")
            for name, spec in bundled_specs().items():
                print(f"{name}: {spec.model}" + (f" + {spec.draft}" if spec.draft else ""))
        else:
            binary = server_binary()
            if binary is None:
                print(f"llama-server is not built here: {HOW_TO_GET}", file=sys.stderr)
                return 1
            print(binary)
    except LlamaCppError as exc:
        print(f"llamacpp: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
