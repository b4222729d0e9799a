"""Benchmark: the engine's server under concurrent streaming clients, against llama.cpp's
llama-server with as many slots, in the same run.

    python benchmarks/serving.py                                   # 1, 2, 4, 8, 16 clients
    python benchmarks/serving.py --concurrency 1 8 --requests-per-client 2 --threads 2
    python benchmarks/serving.py --concurrency 1 2 8 --rounds 3     # ours three ways, taking turns

Both servers are separate processes on loopback with the bundled model (fp32; GGUF for
llama.cpp), the same threads (`OMP_NUM_THREADS` for ours, `-t`/`-tb` for llama.cpp), plain decoding.
For each concurrency C, C clients (threads with the real `openai` client, streaming, usage
included) each send `--requests-per-client` requests, prompts mixed over the held-out categories,
`--max-tokens` each; llama-server runs with `-np C`. It prints, per server and C: aggregate output
tokens/s (all tokens over the wall time), p50/p99 time to first token and time per output token
(client-side), the share of decoding rows that verified a draft (from /metrics), and ours /
llama.cpp. Ours runs five ways: continuous batching with plain requests (`ace-mw`), the same
server with every request allowing prompt lookup (`ace-ngram`), asking for the bundled draft
model (`ace-draft`) or for EAGLE-2 with the bundled head (`ace-eagle`), the engine drafting per
row only where it pays for the batch, and one request at a time (`ace-fifo`, `--max-num-seqs 1`,
the engine before batching). Every server is up for the whole run, idle but for its turns: at
each concurrency the servers take turns, one batch of clients each, and with `--rounds R` they
take R turns in rotating order and each row is the median of its rounds. So every ratio, ours to
ours and ours to the peers, is measured minutes apart at most, safe from the minutes-long swings
of a shared machine. transformers' own continuous batching (`transformers serve
--continuous-batching`, paged attention, the same model from its Hugging Face folder: `hf-cb`) is
the other peer where accelerate and fastapi are installed (the bench extra).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai

from ace_mw.demo import llamacpp
from ace_mw.engine.batching.scheduler import PREFILL_CHUNK
from ace_mw.engine.prompts import MODELS_DIR, load_prompts

TARGET, DRAFT = MODELS_DIR / "ace-tiny-chat", MODELS_DIR / "ace-tiny-chat-draft"
EAGLE = MODELS_DIR / "ace-tiny-chat-eagle"
WARM_PROMPT = "Say hello."
# llama-server keeps each slot's last prompt and starts a request with the most similar one from
# it; ours keep no prompt cache, and the rounds repeat the prompts: each request pays its prompt.
NO_PROMPT_CACHE = {"cache_prompt": False}
PROMPT_CHARS = 2000  # prompts of at most this many characters: well inside both servers' contexts


@dataclass(frozen=True)
class Answer:
    tokens: int
    ttft_s: float
    tpot_s: float | None  # None with one token


@dataclass(frozen=True)
class Variant:
    """One server as the clients see it: where it listens, what each request adds, the model name."""

    server: str
    url: str
    extra: dict | None = None
    model: str = TARGET.name


@dataclass(frozen=True)
class Row:
    server: str
    clients: int
    tokens_per_s: float
    ttft_ms: tuple[float, float]  # p50, p99
    tpot_ms: tuple[float, float]
    speculated: float | None = None  # share of decoding rows that verified a draft (ours, batching)


def percentile(values: Sequence[float], q: float) -> float:
    """The nearest-rank percentile (q in [0, 1])."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered) + 0.5) - 1))]


def ask(client: openai.OpenAI, model: str, prompt: str, max_tokens: int, extra: dict | None = None) -> Answer:
    started = time.perf_counter()
    first = None
    tokens = 0
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=extra,
    )
    for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter()
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    done = time.perf_counter()
    first = first or done
    return Answer(tokens, first - started, (done - first) / (tokens - 1) if tokens > 1 else None)


def batch_rows(url: str) -> tuple[float, float] | None:
    """(decoding rows, rows that verified a draft) so far, from a batching server's /metrics."""
    try:
        text = httpx.get(url + "/metrics", timeout=10).text
    except httpx.TransportError:
        return None
    found = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in ("ace_engine_batch_rows_total", "ace_engine_batch_speculating_rows_total"):
            found[name] = float(value)
    if len(found) < 2:
        return None
    return found["ace_engine_batch_rows_total"], found["ace_engine_batch_speculating_rows_total"]


def measure(
    url: str,
    server: str,
    clients: int,
    prompts: Sequence[str],
    per_client: int,
    max_tokens: int,
    extra: dict | None = None,
    model: str = TARGET.name,
) -> Row:
    client = openai.OpenAI(base_url=url + "/v1", api_key="sk-bench", max_retries=0, timeout=600)
    # Warm (the first request pays for allocations) on a prompt of no client's: a server that keeps
    # a prompt's cache (llama-server does) must not start a measured request from it.
    ask(client, model, WARM_PROMPT, 4, extra)

    def one_client(c: int) -> list[Answer]:
        picked = [prompts[(c * per_client + i) % len(prompts)] for i in range(per_client)]
        return [ask(client, model, prompt, max_tokens, extra) for prompt in picked]

    before = batch_rows(url)
    started = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        answers = [a for batch in pool.map(one_client, range(clients)) for a in batch]
    wall = time.perf_counter() - started
    after = batch_rows(url)
    speculated = None
    if before is not None and after is not None and after[0] > before[0]:
        speculated = (after[1] - before[1]) / (after[0] - before[0])
    ttft = [a.ttft_s * 1000 for a in answers]
    tpot = [a.tpot_s * 1000 for a in answers if a.tpot_s is not None] or [0.0]
    return Row(
        server,
        clients,
        sum(a.tokens for a in answers) / wall,
        (percentile(ttft, 0.5), percentile(ttft, 0.99)),
        (percentile(tpot, 0.5), percentile(tpot, 0.99)),
        speculated,
    )


def median_row(rounds: Sequence[Row]) -> Row:
    """One server's rounds at one concurrency as one row: the median of each figure."""

    def mid(values: Sequence[float]) -> float:
        return statistics.median(values)

    drafted = [r.speculated for r in rounds if r.speculated is not None]
    return Row(
        rounds[0].server,
        rounds[0].clients,
        mid([r.tokens_per_s for r in rounds]),
        (mid([r.ttft_ms[0] for r in rounds]), mid([r.ttft_ms[1] for r in rounds])),
        (mid([r.tpot_ms[0] for r in rounds]), mid([r.tpot_ms[1] for r in rounds])),
        mid(drafted) if drafted else None,
    )


@contextmanager
def ace_server(
    threads: int, max_num_seqs: int, prefill_chunk: int = PREFILL_CHUNK, dtype: str = "float32"
) -> Iterator[tuple[str, subprocess.Popen]]:
    """`python -m ace_mw.engine.server` on a free port, with `threads` torch threads: (url, process)."""
    port = free_port()
    command = [sys.executable, "-m", "ace_mw.engine.server", "--target", str(TARGET), "--port", str(port)]
    command += ["--max-num-seqs", str(max_num_seqs), "--prefill-chunk", str(prefill_chunk), "--draft", str(DRAFT)]
    command += ["--eagle", str(EAGLE), "--dtype", dtype]
    with serving("the engine server", command, threads, port) as started:  # a first start measures costs
        yield started


def transformers_missing() -> str | None:
    """Why `transformers serve --continuous-batching` cannot run here, or None."""
    missing = [name for name in ("accelerate", "fastapi", "uvicorn") if importlib.util.find_spec(name) is None]
    return f"pip install {' '.join(missing)} (the bench extra)" if missing else None


@contextmanager
def transformers_server(threads: int, dtype: str = "float32") -> Iterator[tuple[str, subprocess.Popen]]:
    """transformers' own server with continuous batching (paged attention) on the same model, offline."""
    port = free_port()
    cli = Path(sys.executable).with_name("transformers")
    command = [str(cli), "serve", str(TARGET), "--continuous-batching", "--device", "cpu", "--dtype", dtype]
    command += ["--host", "127.0.0.1", "--port", str(port)]
    with serving("transformers serve", command, threads, port, {"HF_HUB_OFFLINE": "1"}) as started:
        yield started


def free_port() -> int:
    with socket.socket() as sock:  # a free port, for the server to bind a moment later
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def serving(
    what: str, command: list[str], threads: int, port: int, env: dict[str, str] | None = None
) -> Iterator[tuple[str, subprocess.Popen]]:
    """``command`` started with ``threads`` torch threads, once its /health answers: (url, process)."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), **(env or {})}
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            if process.poll() is not None:
                raise SystemExit(f"{what} exited: {process.stderr.read().decode()[-2000:]}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit(f"{what} did not start within 600 s")
            time.sleep(0.2)
        yield url, process
    finally:
        process.terminate()
        process.wait(timeout=30)


def table(rows: Sequence[Row]) -> list[str]:
    peer = {r.clients: r for r in rows if r.server == "llama.cpp"}
    lines = [
        f"{'server':<10} {'clients':>7} {'tokens/s':>9} {'p50 TTFT ms':>12} {'p99 TTFT ms':>12}"
        f" {'p50 TPOT ms':>12} {'p99 TPOT ms':>12} {'drafted':>8} {'vs llama.cpp':>13}"
    ]
    for r in rows:
        other = peer.get(r.clients)
        ratio = f"{r.tokens_per_s / other.tokens_per_s:.2f}x" if other and r.server != "llama.cpp" else "-"
        drafted = f"{r.speculated:.0%}" if r.speculated is not None else "-"
        lines.append(
            f"{r.server:<10} {r.clients:>7} {r.tokens_per_s:>9.1f} {r.ttft_ms[0]:>12.1f} {r.ttft_ms[1]:>12.1f}"
            f" {r.tpot_ms[0]:>12.2f} {r.tpot_ms[1]:>12.2f} {drafted:>8} {ratio:>13}"
        )
    return lines


def rss_mib(pid: int) -> float:
    """A process's resident memory, from /proc (Linux)."""
    with open(f"/proc/{pid}/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


def soak(seconds: float, clients: int, prompts: Sequence[str], max_tokens: int, threads: int, chunk: int) -> int:
    """`clients` clients streaming without pause for `seconds` against our batching server, its
    resident memory printed every tenth of the run: a leak shows as growth after the warm-up."""
    with ace_server(threads, clients, chunk) as (url, process):
        client = openai.OpenAI(base_url=url + "/v1", api_key="sk-bench", max_retries=0, timeout=600)
        deadline = time.monotonic() + seconds
        served = [0] * clients

        def one_client(c: int) -> None:
            while time.monotonic() < deadline:
                ask(client, TARGET.name, prompts[(c + served[c] * clients) % len(prompts)], max_tokens)
                served[c] += 1

        with ThreadPoolExecutor(clients + 1) as pool:
            running = [pool.submit(one_client, c) for c in range(clients)]
            while time.monotonic() < deadline:
                print(
                    f"{seconds - (deadline - time.monotonic()):6.0f} s  {sum(served):6d} requests  "
                    f"server RSS {rss_mib(process.pid):7.1f} MiB",
                    flush=True,
                )
                time.sleep(seconds / 10)
            for r in running:
                r.result()
        print(f"{seconds:6.0f} s  {sum(served):6d} requests  server RSS {rss_mib(process.pid):7.1f} MiB")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--requests-per-client", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--rounds", type=int, default=1, help="turns of every server per concurrency, in rotating order (medians)"
    )
    parser.add_argument("--prefill-chunk", type=int, default=PREFILL_CHUNK, help="our batching server's")
    parser.add_argument(
        "--dtype", default="float32", choices=("float32", "bfloat16"), help="our servers' weights (llama.cpp: f32)"
    )
    parser.add_argument(
        "--soak", type=float, default=0.0, help="instead: SECONDS of the largest concurrency, the server's memory"
    )
    args = parser.parse_args(argv)
    if min(*args.concurrency, args.requests_per_client, args.max_tokens, args.threads, args.rounds) < 1:
        parser.error("--concurrency, --requests-per-client, --max-tokens, --threads and --rounds must be at least 1")
    prompts = [p for ps in load_prompts(4, fits=lambda text: len(text) < PROMPT_CHARS).values() for p in ps]
    rows = []
    lookup, draft = {"speculative_algorithm": "ngram"}, {"speculative_algorithm": "draft_model"}
    eagle = {"speculative_algorithm": "eagle_2"}
    if args.soak:
        return soak(args.soak, max(args.concurrency), prompts, args.max_tokens, args.threads, args.prefill_chunk)
    missing = transformers_missing()
    if missing:
        print(f"no transformers continuous-batching peer: {missing}")
    if llamacpp.server_binary() is None:
        print(f"llama-server is not built here, so no peer: {llamacpp.HOW_TO_GET}")
    with ExitStack() as servers:  # every server up at once, idle but for its turns
        batching, _ = servers.enter_context(
            ace_server(args.threads, max(args.concurrency), args.prefill_chunk, args.dtype)
        )
        fifo, _ = servers.enter_context(ace_server(args.threads, 1, dtype=args.dtype))
        ours = [
            Variant("ace-mw", batching),
            Variant("ace-ngram", batching, lookup),
            Variant("ace-draft", batching, draft),
        ]
        ours += [Variant("ace-eagle", batching, eagle), Variant("ace-fifo", fifo)]
        if not missing:
            hf, _ = servers.enter_context(transformers_server(args.threads, args.dtype))
            ours.append(Variant("hf-cb", hf, model=str(TARGET)))
        for clients in args.concurrency:
            with ExitStack() as peer:  # llama-server's slots are set at its start: -np per concurrency
                variants = list(ours)
                if llamacpp.server_binary() is not None:
                    spec = llamacpp.bundled_specs(threads=args.threads, parallel=clients)["baseline"]
                    url = peer.enter_context(llamacpp.LlamaServer(spec)).url
                    variants.append(Variant("llama.cpp", url, NO_PROMPT_CACHE))
                by_variant: dict[str, list[Row]] = {v.server: [] for v in variants}
                for r in range(args.rounds):  # take turns, so a slower minute hits all alike
                    turn = r % len(variants)
                    for v in variants[turn:] + variants[:turn]:
                        row = measure(
                            v.url,
                            v.server,
                            clients,
                            prompts,
                            args.requests_per_client,
                            args.max_tokens,
                            v.extra,
                            v.model,
                        )
                        by_variant[v.server].append(row)
                        print(table([row])[-1], flush=True)
                rows += [median_row(measured) for measured in by_variant.values()]
    print()
    print(
        f"{args.requests_per_client} streaming requests of {args.max_tokens} tokens per client, greedy, "
        f"{args.threads} thread(s), ours {args.dtype}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}:"
    )
    order = ["ace-mw", "ace-ngram", "ace-draft", "ace-eagle", "ace-fifo", "hf-cb", "llama.cpp"]
    print("\n".join(table(sorted(rows, key=lambda r: (r.clients, order.index(r.server))))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
