"""`ace-mw demo --engine vllm` (and `benchmarks/vllm_pools.py`): the closed loop on real vLLM pools.

The command starts vLLM 0.32 servers of the bundled model (`vllm.py`): plain, prompt lookup, the
shipped EAGLE-3 head and the draft model, each K = 4, and one more, vLLM's own dynamic speculation:
prompt lookup with a `num_speculative_tokens_per_batch_size` schedule (K = 4 up to 2 running
requests, off from 3), the anchor to beat. Every policy is an `AceSpecDec` over a proxy to its pools,
served on loopback and driven with the real `openai` client:

- `adaptive`: the speed policy over the four pools (plain and three candidates), load-aware with
  `upstream.load_scope = "shared"` (the pools share one core), its samples whole requests
  (`gate.speed_counts = "request"`);
- `plain`, `ngram`, `eagle3`, `draft`: one static pool each (the breaker never trips them);
- `vllm-dynamic`: the dynamic pool alone, the middleware off.

Five tenants send held-out prompts of one category each: four greedy (code, summarization, chat,
math) and one at temperature 1.0 (`creative`, chat prompts, a seed per request), where prompt lookup
runs slower than plain on these pools (0.92x): the temperature gate holds adaptive's to plain
decoding, and the static pools take every request (no temperature gate), as a server that
speculates on everything does.
No pool caches prompt prefixes: the policies send the same prompts in turn to pools they share, and a
cached prefill would favour whoever goes second.
Two phases, the policies taking turns (rotating who goes first): one client (each request alone),
then bursts of 1, 2, 4 and 8 concurrent clients. Hardware: every pool's server (API process and
engine, one thread, the model in the engine's process) runs on the same core (`taskset`), and the
policies take turns, so each policy has that core to itself while it runs; the client and the
middleware run on the other core. The adaptive
policy first serves the same tenants their prompts in another order (a warm-up, not reported; the
benchmark's default is three rounds of each tenant's twelve), as a gateway that has been running
has: what it measures is the loop in its steady state. What a tenant new to the gateway pays while
it learns is issue 40's figure (docs/concepts.md).
"""

from __future__ import annotations

import os
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from typing import Any

import openai

from ace_mw import AceConfig
from ace_mw.adapters.vllm import FIRST_TOKEN_MS, GENERATION_TIME_MS

from . import vllm
from .report import paired_interval
from .runner import PolicyRouter, proxy_app, serve
from .workload import PROMPTS_PER_CATEGORY, workload_prompts

POLICIES = ("adaptive", "plain", "ngram", "eagle3", "draft", "vllm-dynamic")
STATIC = ("plain", "ngram", "eagle3", "draft")
ALGORITHM = {"ngram": "ngram", "eagle3": "eagle_3", "draft": "draft_model"}
TENANTS = {
    "code": "sk-vllm-code",
    "summaries": "sk-vllm-summaries",
    "chat": "sk-vllm-chat",
    "math": "sk-vllm-math",
    "creative": "sk-vllm-creative",
}
CATEGORY = {"code": "code", "summaries": "summarization", "chat": "chat", "math": "math", "creative": "chat"}
HOT = {"creative": 1.0}  # tenants that sample (temperature); the others are greedy
DYNAMIC = {
    "method": "ngram",
    "num_speculative_tokens": vllm.K,
    "prompt_lookup_max": 4,
    "prompt_lookup_min": 2,
    "num_speculative_tokens_per_batch_size": [[1, 2, vllm.K], [3, 256, 0]],
}
BURSTS = (1, 2, 4, 8)
# adaptive's warm-up, the loop in its steady state: three rounds of each tenant's twelve prompts
STEADY_WARM_UP = 3 * PROMPTS_PER_CATEGORY * len(TENANTS)
ENGINE_CORE = "0"  # every pool's server; the client and the middleware run on the others


@dataclass(frozen=True)
class Request:
    index: int
    tenant: str
    prompt: str
    temperature: float = 0.0


@dataclass
class Result:
    policy: str
    phase: str  # "single" | "burst-<c>"
    index: int
    tenant: str
    tokens: int
    latency_s: float
    text: str
    arm: str
    reason: str = ""  # the middleware's reason for the arm (x-ace-speculative-decoding-reason)
    error: str | None = None
    round: int = 0  # the bursts' round it was sent in (they send a request again each round)
    # what vLLM said of it (`metrics`, `usage`): its prompt, and its time to the first token and
    # after it (benchmarks/vllm_replay.py feeds them to the store as the middleware does)
    prompt_tokens: int | None = None
    first_token_s: float | None = None
    decode_s: float | None = None


@dataclass(frozen=True)
class Burst:
    """One policy's run of one burst: the same requests every policy ran in that round."""

    policy: str
    round: int
    clients: int
    tokens: int
    latency_s: float  # wall seconds, the first request sent to the last answer


def pool_specs(eager: bool = False) -> dict[str, vllm.PoolSpec]:
    """The five pools, each server (API process and engine) on ENGINE_CORE with one thread and
    its model in the engine's process (`PoolSpec.one_worker`: no worker busy-waiting on the
    shared core)."""
    specs = vllm.bundled_specs(max_num_seqs=8)
    specs["dynamic"] = replace(specs["ngram"], speculative=DYNAMIC)
    # No prefix caching: the policies send the same prompts to shared pools in turn, and a cached
    # prefill would favour whoever goes second (as issue 41 compares servers: caching off on both).
    extra = ("--no-enable-prefix-caching", *(("--enforce-eager",) if eager else ()))
    return {name: replace(spec, cores=ENGINE_CORE, one_worker=True, extra=extra) for name, spec in specs.items()}


def policy_configs(pools: Mapping[str, str]) -> dict[str, AceConfig]:
    candidates = [
        {"algorithm": ALGORITHM[name], "num_speculative_tokens": vllm.K, "pool": name}
        for name in ("ngram", "eagle3", "draft")
    ]
    # Speed over the whole request (vLLM reports its time to the first token): the pools' prefills
    # differ (the draft model's pool prefills the draft too), and what a client gets is the whole.
    # An hour's memory: the policies take turns, so each tenant sends adaptive a request every ten
    # seconds or so, and the default ten minutes would age its evidence out within the run.
    adaptive_gate = {
        "policy": "speed",
        "speed_min_samples": 2,
        "max_measured_per_s": 1000,
        "speed_counts": "request",
        "speed_half_life_s": 3600,
    }
    shared = {"load_scope": "shared"}  # every pool's engine on one core: any request slows every arm
    # A static pool takes every request: no breaker (alpha floor 0), no temperature gate (2.0, the
    # API's maximum).
    static_gate = {
        "policy": "acceptance",
        "alpha_floor": 0.0,
        "reenable_threshold": 0.0,
        "max_measured_per_s": 1000,
        "temperature_threshold": 2.0,
    }
    configs: dict[str, dict[str, Any]] = {
        "adaptive": {
            "mode": "prod",
            "adapter": "vllm",
            "pools": {n: pools[n] for n in ("baseline", *ALGORITHM)},
            "candidates": candidates,
            "gate": adaptive_gate,
            "upstream": shared,
        },
        "plain": {"mode": "off", "adapter": "vllm", "pools": {"baseline": pools["baseline"]}},
        "vllm-dynamic": {"mode": "off", "adapter": "vllm", "pools": {"baseline": pools["dynamic"]}},
    }
    for name in ALGORITHM:
        configs[name] = {
            "mode": "prod",
            "adapter": "vllm",
            "pools": {"baseline": pools["baseline"], name: pools[name]},
            "candidates": [c for c in candidates if c["pool"] == name],
            "gate": static_gate,
        }
    return {name: AceConfig.from_dict(config) for name, config in configs.items()}


def workload(requests: int, offset: int = 0) -> list[Request]:
    """`requests` requests, the tenants taking turns, each with the next held-out prompt of its
    category, round robin over the category's 12 (`offset` starts that many rounds on: the
    warm-up sends the tenants' prompts in another order; a hot tenant that shares its category
    with a greedy one starts half way round)."""
    prompts = workload_prompts()
    names = list(TENANTS)
    found = []
    for i in range(requests):
        tenant = names[i % len(names)]
        pool = prompts[CATEGORY[tenant]]
        turn = offset + i // len(names) + (len(pool) // 2 if tenant in HOT else 0)
        found.append(Request(i, tenant, pool[turn % len(pool)], HOT.get(tenant, 0.0)))
    return found


class Driver:
    """Sends requests to the policies' mounts with the openai client and keeps the results."""

    def __init__(self, url: str, max_tokens: int) -> None:
        self.url, self.max_tokens = url, max_tokens
        self.results: list[Result] = []
        self._clients: dict[tuple[str, str], openai.OpenAI] = {}

    def client(self, policy: str, key: str) -> openai.OpenAI:
        if (policy, key) not in self._clients:
            self._clients[policy, key] = openai.OpenAI(
                base_url=f"{self.url}/{policy}/v1", api_key=key, max_retries=0, timeout=600.0
            )
        return self._clients[policy, key]

    def send(
        self, policy: str, request: Request, phase: str, keys: Mapping[str, str] = TENANTS, round_: int = 0
    ) -> Result:
        started = time.perf_counter()
        try:
            raw = self.client(policy, keys[request.tenant]).chat.completions.with_raw_response.create(
                model=vllm.SERVED_NAME,
                messages=[{"role": "user", "content": request.prompt}],
                temperature=request.temperature,
                max_tokens=self.max_tokens,
                seed=request.index if request.temperature else openai.omit,
            )
            answer = raw.parse()
            tokens = answer.usage.completion_tokens if answer.usage else 0
            timing = _engine_timing(answer)
            text = answer.choices[0].message.content or ""
            arm, reason, error = (
                raw.headers.get("x-ace-speculative-decoding-arm", ""),
                raw.headers.get("x-ace-speculative-decoding-reason", ""),
                None,
            )
        except openai.APIError as exc:
            tokens, text, arm, reason, error = 0, "", "", "", f"{type(exc).__name__}: {exc}"[:200]
            timing = (None, None, None)
        elapsed = time.perf_counter() - started
        return Result(
            policy, phase, request.index, request.tenant, tokens, elapsed, text, arm, reason, error, round_, *timing
        )

    def single(
        self,
        requests: Sequence[Request],
        policies: Sequence[str],
        phase: str = "single",
        keys: Mapping[str, str] = TENANTS,
    ) -> None:
        for request in requests:
            turn = request.index % len(policies)
            for policy in [*policies[turn:], *policies[:turn]]:
                self.results.append(self.send(policy, request, phase, keys))

    def lane(self, work: tuple[str, Sequence[Request], str, Mapping[str, str], int]) -> list[Result]:
        """One client of a burst: its requests one after the other."""
        policy, requests, phase, keys, round_ = work
        return [self.send(policy, request, phase, keys, round_) for request in requests]

    def bursts(
        self,
        requests: Sequence[Request],
        policies: Sequence[str],
        per_client: int,
        keys: Mapping[str, str] = TENANTS,
        phase: str | None = None,
        rounds: int = 1,
    ) -> list[Burst]:
        """Bursts of 1, 2, 4, 8 clients, each sending `per_client` requests one after the other; every
        policy runs each burst in turn, `rounds` times: the order rotates with the burst size, and
        every second round runs the one before it backwards, so that no policy keeps its place or
        the policy before it (the pools share a core, and a burst can feel the one before it).
        Returns every policy's run of every burst."""
        runs: list[Burst] = []
        cursor = 0
        for round_ in range(rounds):
            for turn, clients in enumerate(BURSTS):
                batch = [requests[(cursor + i) % len(requests)] for i in range(clients * per_client)]
                cursor += len(batch)
                first = (turn + round_ // 2) % len(policies)
                order = [*policies[first:], *policies[:first]]
                for policy in order[::-1] if round_ % 2 else order:
                    lanes = [batch[i::clients] for i in range(clients)]
                    label = phase or f"burst-{clients}"
                    started = time.perf_counter()
                    with ThreadPoolExecutor(clients) as pool:
                        answered = pool.map(self.lane, [(policy, lane, label, keys, round_) for lane in lanes])
                        done = [r for lane in answered for r in lane]
                    wall = time.perf_counter() - started
                    runs.append(Burst(policy, round_, clients, sum(r.tokens for r in done), wall))
                    self.results.extend(done)
        return runs


def _engine_timing(answer: Any) -> tuple[int | None, float | None, float | None]:
    """(prompt tokens, seconds to the first token, seconds after it) as vLLM reported them."""
    metrics = (answer.model_extra or {}).get("metrics") or {}
    first, decode = metrics.get(FIRST_TOKEN_MS), metrics.get(GENERATION_TIME_MS)
    return (
        answer.usage.prompt_tokens if answer.usage else None,
        first / 1000 if isinstance(first, (int, float)) else None,
        decode / 1000 if isinstance(decode, (int, float)) else None,
    )


@contextmanager
def started_pools(eager: bool, view: Callable[[str], None]) -> Iterator[dict[str, str]]:
    specs = pool_specs(eager)
    view(f"starting vLLM {vllm.VERSION} pools ({', '.join(specs)}; {'eager' if eager else 'compiled'})")
    with vllm.pools(specs) as servers:
        yield {name: server.url for name, server in servers.items()}


def measure(
    requests: int = 30,
    per_client: int = 2,
    max_tokens: int = 64,
    warm_requests: int = 30,
    eager: bool = False,
    burst_rounds: int = 1,
    view: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Start the pools, run both phases, return the report's data."""
    with started_pools(eager, view) as pools:
        configs = policy_configs(pools)
        router = PolicyRouter({name: proxy_app(dict(configs[name].pools)) for name in POLICIES}, configs)
        with serve(router) as url:
            _pin_to_other_cores()
            driver = Driver(url, max_tokens)
            view("warming up every pool, then the adaptive policy on the tenants' earlier traffic")
            warm = workload(max(warm_requests, len(TENANTS)), offset=6)
            driver.single(warm[: len(TENANTS)], list(POLICIES), phase="warm-up")
            driver.single(warm, ["adaptive"], phase="warm-up")
            for _ in range(2):  # every arm measured at every load band the bursts reach
                driver.bursts(warm, ["adaptive"], 2, phase="warm-up")
            # then a round of the first measured phase's traffic, one client with the policies
            # taking turns: the loop in its steady state there (the first lone requests after
            # bursts open where the hot requests cut in, InFlight.cut_share)
            driver.single(warm[: len(TENANTS)], list(POLICIES), phase="warm-up")
            driver.results = []
            view(f"one client: {requests} requests x {len(POLICIES)} policies, taking turns")
            measured = workload(requests)
            driver.single(measured, list(POLICIES))
            view(
                f"bursts of {', '.join(map(str, BURSTS))} clients, {per_client} requests each, taking turns, "
                f"{burst_rounds} round(s)"
            )
            bursts = driver.bursts(measured, list(POLICIES), per_client, rounds=burst_rounds)
            status = router.controllers["adaptive"].status()
    return summarise(driver.results, bursts, status, pools, requests, per_client, max_tokens, eager, burst_rounds)


def _pin_to_other_cores() -> None:
    """The client and the middleware off the engines' core, where the machine has another."""
    cores = os.sched_getaffinity(0) - {int(ENGINE_CORE)}
    if cores:
        os.sched_setaffinity(0, cores)


def summarise(
    results: Sequence[Result],
    bursts: Sequence[Burst],
    status: Mapping[str, Any],
    pools: Mapping[str, str],
    requests: int,
    per_client: int,
    max_tokens: int,
    eager: bool,
    burst_rounds: int = 1,
) -> dict[str, Any]:
    single = [r for r in results if r.phase == "single"]
    rows = {}
    for policy in POLICIES:
        mine = [r for r in single if r.policy == policy]
        runs = [b for b in bursts if b.policy == policy]
        rows[policy] = {
            "single_tok_s": _rate(mine),
            "burst_tok_s": _rate(runs),
            "burst_by_clients": {c: _rate([b for b in runs if b.clients == c]) for c in BURSTS},
            "errors": sum(r.error is not None for r in results if r.policy == policy),
            # adaptive over this policy, paired: the same request (one client) or the same burst
            "paired": {
                "single": paired_interval(_pairs(single, policy, _sent, ok=_answered)),
                "bursts": paired_interval(_pairs(bursts, policy, lambda b: (b.round, b.clients))),
            },
        }
    tenants = {
        tenant: {
            "single": _tenant_speeds([r for r in single if r.tenant == tenant]),
            "bursts": _tenant_speeds([r for r in results if r.tenant == tenant and r.phase != "single"]),
        }
        for tenant in TENANTS
    }
    # Greedy answers only: a sampled one is the same distribution, not the same text.
    greedy = [r for r in results if not r.error and r.tenant not in HOT]
    plain_text = {(r.phase, r.index): r.text for r in greedy if r.policy == "plain"}
    exact = {
        policy: (
            sum(plain_text.get((r.phase, r.index)) == r.text for r in greedy if r.policy == policy),
            sum(1 for r in greedy if r.policy == policy),
        )
        for policy in POLICIES
    }
    arms: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    reasons: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for r in results:
        if r.policy == "adaptive":
            arms[r.phase][r.arm or "plain"] += 1
            reasons[r.phase][r.reason] += 1
    return {
        "vllm": vllm.VERSION,
        "pools": dict(pools),
        "requests": requests,
        "per_client": per_client,
        "burst_rounds": burst_rounds,
        "max_tokens": max_tokens,
        "eager": eager,
        "policies": rows,
        "tenants": tenants,
        "exact": exact,
        "adaptive_arms": {phase: dict(counts) for phase, counts in arms.items()},
        "adaptive_reasons": {phase: dict(counts) for phase, counts in reasons.items()},
        "adaptive_status": {"priors": status.get("priors"), "tenants": status.get("tenants")},
        "results": [asdict(r) for r in results],
        "bursts": [asdict(b) for b in bursts],
        "when": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "cpus": os.cpu_count(),
    }


def _tenant_speeds(mine: Sequence[Result]) -> dict[str, Any]:
    """One tenant's requests of one phase: each policy's tokens/s over them (under bursts, each
    request's own latency at its burst's concurrency), its best static pool, adaptive over it."""
    speed = {p: _rate([r for r in mine if r.policy == p and _answered(r)]) or 0.0 for p in POLICIES}
    best = max(STATIC, key=lambda p: speed[p])
    return {
        "tok_s": speed,
        "best_static": best,
        "adaptive_vs_best": speed["adaptive"] / speed[best] if speed[best] else None,
        # the same requests paired: a tenant's dozen are noisy (two runs of one pool differ by some 5 %)
        "interval": paired_interval(_pairs(mine, best, _sent, ok=_answered)),
    }


def _answered(result: Result) -> bool:
    return result.error is None


def _sent(result: Result) -> tuple[str, int, int]:
    """What was sent: the same for every policy's run of it."""
    return result.phase, result.round, result.index


def _rate(timed: Sequence[Result] | Sequence[Burst]) -> float | None:
    """Aggregate output tokens/s."""
    seconds = sum(t.latency_s for t in timed)
    return sum(t.tokens for t in timed) / seconds if seconds else None


def _pairs(
    timed: Sequence[Any], other: str, unit: Callable[[Any], Any], ok: Callable[[Any], bool] = lambda _: True
) -> list[tuple[Any, Any]]:
    """(adaptive's, `other`'s) run of each unit both completed: a request, or a burst."""
    found: dict[Any, dict[str, Any]] = defaultdict(dict)
    for t in timed:
        if t.policy in ("adaptive", other) and ok(t):
            found[unit(t)][t.policy] = t
    return [(runs["adaptive"], runs[other]) for runs in found.values() if len(runs) == 2]
