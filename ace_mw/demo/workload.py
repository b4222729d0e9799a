"""The closed-loop workload: the demo tenants and their traffic, and the policies to compare.

Six tenants (developer keys) send held-out prompts (code, summarization/extraction, chat, math) at
temperatures from 0 to 1.2, streaming and not; one of them, `flaky`, turns unpredictable mid-run
(prompts its drafter does badly on) and predictable again. A policy is only a configuration made
from the demo config: `adaptive` (and its alias `speed`) with the speed-aware gate, `acceptance`
with the acceptance policy, `always-on` speculating on every request with the tenant's first
candidate, `always-off` never (see `policy_config`). `runner.py` sends the requests, `report.py`
tells what they measured.
"""

from __future__ import annotations

import copy
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ace_mw import AceConfig, get_adapter, hash_key
from ace_mw.config import GateConfig, key_digest, tenant_of
from ace_mw.engine.prompts import CATEGORIES, load_prompts

DEMO_POLICIES = ("adaptive", "always-on", "always-off")
POLICIES = ("adaptive", "speed", "acceptance", "always-on", "always-off")
# Real llama.cpp pools (`--engine llamacpp`): the algorithm each pool's server runs, and the demo's
# policies there: adaptive against every static pool (`always-<pool>`: every request on that pool).
POOL_ALGORITHMS = {"ngram": "ngram", "draft": "draft_model"}
POOL_POLICIES = ("adaptive", "always-ngram", "always-draft", "always-off")
CALIBRATION = "calibration"  # an always-on mount that measures the flaky tenant's prompts, unreported
MAX_PROMPT_CHARS = 1500  # held-out prompts longer than this are skipped (about 500 tokens)
PROMPTS_PER_CATEGORY = 12  # held-out prompts of each category the workloads cycle through
FLAKY = "flaky"
PREDICTABLE, UNPREDICTABLE = "predictable", "unpredictable"
# The flaky tenant's traffic: predictable (long enough for the speed gate to measure both its arms),
# then unpredictable from 35 % of its requests, then predictable again from 65 %, so there is room
# for a trip and for the probes that close it.
FLAKY_PHASES = ((0.35, PREDICTABLE), (0.65, UNPREDICTABLE), (1.0, PREDICTABLE))
UNPREDICTABLE_TEMPERATURE = 0.7  # the hottest temperature the gate still lets speculate
COOLDOWN_INTERVALS = 1.5  # the breaker's first cooldown, in intervals between the flaky tenant's requests
SPEED_HALF_LIFE_REQUESTS = 50  # a speed sample's half-life, in requests of a tenant of weight 1


@dataclass(frozen=True)
class Tenant:
    """One demo developer key and the traffic it sends."""

    name: str
    key: str  # the raw key its client sends (the config holds only its hash)
    weight: int  # share of the requests
    settings: Mapping[str, Any] | None  # its KeySettings; None: not listed, so the org's settings
    about: str
    categories: tuple[str, ...] = ()
    temperatures: tuple[float, ...] = (0.0,)
    headers: tuple[str | None, ...] = (None,)  # override header values, cycled over its requests
    streams_only: bool = False  # an interactive app; the others stream two requests in three


def tenant_id(key: str) -> str:
    """How the controller names a key's tenant: the first 16 hex digits of its SHA-256."""
    return tenant_of(key_digest(key))


NGRAM = {"algorithm": "ngram", "num_speculative_tokens": 10}
TENANTS = (
    Tenant(
        "org",
        "sk-demo-org",
        2,
        None,
        "not listed: the org's settings (prod, EAGLE-2)",
        ("code", "chat", "math"),
        (0.0, 0.0, 0.3, 0.7, 1.0, 1.2),
    ),
    Tenant(
        "shadow",
        "sk-demo-shadow",
        1,
        {"mode": "shadow"},
        "shadow: decided and recorded, the request left untouched",
        ("chat", "summarization"),
        (0.0, 0.5, 1.0),
    ),
    Tenant(
        "canary",
        "sk-demo-canary",
        1,
        {"canary_percent": 5, "speculative": {"algorithm": "draft_model", "num_speculative_tokens": 4}},
        "prod on a 5 % canary, draft model",
        ("code", "math"),
        (0.0, 0.3, 1.2),
    ),
    Tenant(
        "multi",
        "sk-demo-multi",
        2,
        {"candidates": [{"algorithm": "eagle_2", "num_speculative_tokens": 6}, NGRAM]},
        "two candidates: EAGLE-2, then prompt lookup (ngram), which pays on summarization and extraction",
        ("summarization", "summarization", "code"),
        (0.0, 0.0, 0.3),
    ),
    Tenant(
        "header",
        "sk-demo-header",
        1,
        {"mode": "shadow", "allow_header_override": True},
        "shadow, may override by header: sends `prod` on a third of its requests, `off` on another",
        ("chat", "code"),
        (0.0, 0.7),
        (None, "prod", "off"),
    ),
    Tenant(
        FLAKY,
        "sk-demo-flaky",
        5,
        {"speculative": NGRAM},
        "prompt lookup (ngram), an interactive app (always streams); its traffic turns unpredictable "
        "mid-run, then predictable again",
        streams_only=True,
    ),
)
TENANT_NAMES = tuple(t.name for t in TENANTS)
WARM_UP = "warm-up"  # a key nobody reports (its own state); the prior warm-up has one per category


def warm_up_tenant(category: str) -> str:
    return f"{WARM_UP}-{category}"


KEYS = {
    **{t.name: t.key for t in TENANTS},
    WARM_UP: "sk-demo-warm-up",
    **{warm_up_tenant(c): f"sk-demo-{warm_up_tenant(c)}" for c in CATEGORIES},
}


# -- the configurations --------------------------------------------------------------------------


def demo_config(
    adapter: str, pace_s: float, algorithms: Sequence[str], pools: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """The demo's configuration (the `adaptive` policy), as a dict.

    The gate is tuned for a run of a few hundred requests rather than a day of traffic. The rolling
    alpha reacts within a few responses (`ema_half_life` 2, `min_samples` 4, `min_probe_samples`
    3: three responses with alpha near 0 after a long run near 0.85 trip it), half the
    conversations probe while the breaker is open, and an arm counts as measured after 2
    responses. Its clocks follow the run's pace (`pace_s`: the measured seconds one workload
    request takes, every policy's response included), so that the demo behaves alike on a busy CPU
    and on a GPU: the first cooldown lasts 1.5 intervals between the flaky tenant's requests (a
    trip and the probes that close it both fit in the run), and a speed sample loses half its
    weight over 50 requests of the quietest tenant (not in 10 minutes, which on a slow machine are
    only a few of a tenant's requests). The floor and the re-enable threshold (0.40 / 0.55, below
    the defaults) sit between the flaky tenant's two kinds of traffic and under the EAGLE head's
    usual acceptance, so that only a collapse trips the breaker and the speed gate is what moves a
    slow drafter aside. `algorithms` are the drafters the engine has: a tenant whose algorithm is
    missing falls back to the org's. With `pools` (name -> URL, `baseline` included; the others'
    servers run `POOL_ALGORITHMS[name]`) every candidate runs on its algorithm's pool."""
    total = sum(t.weight for t in TENANTS)
    flaky = next(t.weight for t in TENANTS if t.name == FLAKY)
    cooldown_s = max(1.0, COOLDOWN_INTERVALS * pace_s * total / flaky)
    org = "eagle_2" if "eagle_2" in algorithms else algorithms[0]
    per_request = getattr(get_adapter(adapter), "switches_per_request", False)
    route = {algorithm: name for name, algorithm in POOL_ALGORITHMS.items() if pools and name in pools}
    keys = {}
    for tenant in TENANTS:
        if tenant.settings is None:
            continue
        settings = copy.deepcopy(dict(tenant.settings))
        for table in [settings.get("speculative", {}), *settings.get("candidates", [])]:
            if table.get("algorithm", org) not in algorithms:
                table["algorithm"] = org
            if route and "algorithm" in table:
                table["pool"] = route[table["algorithm"]]
        if "candidates" in settings:  # a fallback may have made two candidates the same
            settings["candidates"] = distinct_arms(settings["candidates"], per_request)
        keys[hash_key(tenant.key)] = settings
    speculative = {"algorithm": org, "num_speculative_tokens": 6, **({"pool": route[org]} if route else {})}
    return {
        "mode": "prod",
        "adapter": adapter,
        "allow_header_override": False,
        **({"pools": dict(pools)} if pools else {}),
        "speculative": speculative,
        "gate": {
            "policy": "speed",
            "alpha_floor": 0.40,
            "reenable_threshold": 0.55,
            "ema_half_life": 2.0,
            "min_samples": 4,
            "min_probe_samples": 3,
            "probe_fraction": 0.5,
            "cooldown_s": round(cooldown_s, 1),
            "max_cooldown_s": round(2 * cooldown_s, 1),
            "speed_min_samples": 2.0,
            "speed_half_life_s": round(max(600.0, SPEED_HALF_LIFE_REQUESTS * pace_s * total)),
        },
        "keys": keys,
    }


PRIOR_REQUESTS_PER_ARM = 3  # each warm-up tenant's requests per arm: they seed the adaptive policy's priors


def distinct_arms(candidates: Sequence[Mapping[str, Any]], per_request: bool) -> list[dict[str, Any]]:
    """The candidates less repeats: the same table twice, or (where the engine switches
    speculation per server, not per request) a second candidate on a pool already taken, which
    would be the same server and so the same arm."""
    unique = list({tuple(sorted(c.items())): dict(c) for c in candidates}.values())
    if per_request:
        return unique
    first: dict[str, dict[str, Any]] = {}
    for candidate in unique:
        first.setdefault(candidate.get("pool", "speculative"), candidate)
    return list(first.values())


def prior_warm_up(
    config: Mapping[str, Any], prompts: Mapping[str, Sequence[str]]
) -> tuple[dict[str, Any], list[Request]]:
    """(the demo config with the warm-up tenants listed, their requests).

    A deployed gateway has seen traffic before a tenant joins: its pooled priors say what each arm
    is worth on the model, and how much that differs between tenants. The demo's adaptive policy
    starts the same way, from warm-up tenants that are never reported, one per prompt category
    (prompt lookup pays on extraction and not on chat: the priors learn that spread), each with
    every tenant's arms as its candidates. While they run, every arm short of
    PRIOR_REQUESTS_PER_ARM samples claims all of the exploration (`explore_fraction_unmeasured` 1),
    so each arm is measured about as often."""
    warm = copy.deepcopy(dict(config))
    tables = [warm.get("speculative", {})]
    for settings in warm.get("keys", {}).values():
        tables += [settings["speculative"]] if "speculative" in settings else []
        tables += settings.get("candidates", [])
    per_request = getattr(get_adapter(warm["adapter"]), "switches_per_request", False)
    labelled = {_label(t, warm.get("pools", {})): t for t in tables if t}
    candidates = distinct_arms(list(labelled.values()), per_request)
    categories = [c for c in prompts if prompts[c]]
    keys = {hash_key(KEYS[warm_up_tenant(c)]): {"candidates": candidates} for c in categories}
    warm["keys"] = {**warm.get("keys", {}), **keys}
    warm["gate"] = {
        **warm.get("gate", {}),
        "explore_fraction_unmeasured": 1.0,
        "speed_min_samples": float(PRIOR_REQUESTS_PER_ARM),
    }
    temperatures = band_temperatures(AceConfig.from_dict(warm).gate)
    per_tenant = PRIOR_REQUESTS_PER_ARM * (len(candidates) + 1) * len(temperatures)
    requests = []
    for i in range(per_tenant * len(categories)):
        c, turn = categories[i % len(categories)], i // len(categories)
        # from the end of each category's list (the workload draws from the start)
        prompt = prompts[c][-1 - (turn // len(temperatures)) % len(prompts[c])]
        temperature = temperatures[turn % len(temperatures)]
        requests.append(Request(-1000 - i, warm_up_tenant(c), c, prompt, temperature, i, True))
    return warm, requests


def band_temperatures(gate: GateConfig) -> tuple[float, ...]:
    """A temperature in each band of `gate.temperature_bands` that the temperature gate admits: the
    warm-up seeds every band's priors, as a gateway's earlier traffic, greedy and sampled, would
    have (greedy for the first band, the hottest admitted temperature in each band above)."""
    uppers = (*gate.temperature_bands, math.inf)
    hottest = [min(upper, gate.temperature_threshold) for upper in uppers[1:]]
    return (0.0, *(t for t, lower in zip(hottest, gate.temperature_bands, strict=True) if t > lower))


def _label(table: Mapping[str, Any], pools: Mapping[str, str]) -> str:
    return AceConfig.from_dict({"pools": dict(pools), "speculative": dict(table)}).org.arms[1]


POLICY_MEANING = {
    "adaptive": 'the demo config with the speed-aware gate (`gate.policy = "speed"`): each request runs the arm '
    "(plain or a candidate) measured fastest for its tenant, after the temperature gate and the breaker",
    "speed": "the same as adaptive",
    "acceptance": 'the demo config with `gate.policy = "acceptance"`: always the tenant\'s first candidate '
    "unless the temperature gate or the breaker says no",
    "always-on": "every request speculates with its tenant's first candidate: mode prod at the org and every key "
    "(shadow keys too), canary 100 %, header overrides ignored, no temperature gate (threshold 2.0), a breaker "
    "that cannot trip (alpha floor 0)",
    "always-off": "no request speculates: mode off at the org and every key, header overrides ignored",
    **{
        f"always-{pool}": f"every request runs on the `{pool}` pool (llama-server with {algorithm}): always-on with "
        f"that pool's candidate for every tenant"
        for pool, algorithm in POOL_ALGORITHMS.items()
    },
}


def policy_config(base: Mapping[str, Any], policy: str) -> AceConfig:
    """The configuration of one policy, made from the demo config.

    - `adaptive` / `speed`: the demo config, `gate.policy = "speed"`.
    - `acceptance`: the demo config, `gate.policy = "acceptance"` (always the first candidate while
      the breaker and the temperature gate allow).
    - `always-on`: every request speculates with its tenant's first candidate: mode prod at the org
      and every key (shadow keys included), canary 100 %, no header overrides, no temperature gate
      (threshold 2.0, the API's maximum temperature), a breaker that cannot trip (alpha floor 0),
      acceptance policy.
    - `always-off`: mode off at the org and every key, no header overrides.
    - `always-<pool>` (`always-ngram`, `always-draft`, with real pools): always-on, with the pool's
      candidate for the org and every key.
    """
    if policy not in POLICIES and policy not in POOL_POLICIES:
        raise ValueError(f"unknown policy {policy!r}: expected one of {', '.join(POLICIES + POOL_POLICIES[1:3])}")
    config = copy.deepcopy(dict(base))
    pool = policy.removeprefix("always-")
    if pool in POOL_ALGORITHMS:  # one static pool for everyone: always-on with its candidate alone
        config["speculative"] = {"algorithm": POOL_ALGORITHMS[pool], "pool": pool}
        for settings in config.get("keys", {}).values():
            settings.pop("speculative", None)
            settings.pop("candidates", None)
        policy = "always-on"
    gate = config.setdefault("gate", {})
    if policy in ("adaptive", "speed"):
        gate["policy"] = "speed"
    elif policy == "acceptance":
        gate["policy"] = "acceptance"
    else:
        mode = "prod" if policy == "always-on" else "off"
        config.update(mode=mode, canary_percent=100, allow_header_override=False)
        for settings in config.get("keys", {}).values():
            settings.update(mode=mode, allow_header_override=False)
            settings.pop("canary_percent", None)
        if policy == "always-on":
            gate.update(policy="acceptance", temperature_threshold=2.0, alpha_floor=0.0)
    return AceConfig.from_dict(config)


# -- the requests ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Request:
    """One request of the workload, sent alike to every policy."""

    index: int
    tenant: str
    category: str
    prompt: str
    temperature: float
    seed: int
    stream: bool
    header: str | None = None
    phase: str = ""  # the flaky tenant's phase

    @property
    def conversation(self) -> str:
        """Its conversation id (the body's `user`): canary, probe and exploration draws stick to it."""
        return f"{self.tenant}-{self.index}"


@dataclass(frozen=True)
class Probe:
    """A request of the flaky tenant as calibration measured it."""

    category: str
    prompt: str
    temperature: float
    seed: int
    alpha: float | None = None


@dataclass(frozen=True)
class FlakyPlan:
    """The flaky tenant's requests per phase, chosen by measured acceptance."""

    predictable: tuple[Probe, ...]
    unpredictable: tuple[Probe, ...]


def tenant_schedule(n: int) -> list[Tenant]:
    """`n` tenants in smooth weighted round-robin order (deterministic, evenly spread)."""
    total = sum(t.weight for t in TENANTS)
    credit = dict.fromkeys(TENANT_NAMES, 0)
    order = []
    for _ in range(n):
        for t in TENANTS:
            credit[t.name] += t.weight
        chosen = max(TENANTS, key=lambda t: credit[t.name])
        credit[chosen.name] -= total
        order.append(chosen)
    return order


def flaky_phase(position: float) -> str:
    """The flaky tenant's phase at `position` in [0, 1) of its requests."""
    return next(phase for end, phase in FLAKY_PHASES if position < end)


def build_workload(n: int, prompts: Mapping[str, Sequence[str]], flaky: FlakyPlan, seed: int = 0) -> list[Request]:
    """`n` requests: every tenant's traffic mix, the flaky tenant's phases from `flaky`; every third
    request (the second of each three) non-streaming, except the flaky tenant's."""
    rng = random.Random(seed)
    schedule = tenant_schedule(n)
    flaky_total = sum(t.name == FLAKY for t in schedule)
    seen: dict[str, int] = {}
    requests = []
    for index, tenant in enumerate(schedule):
        k = seen[tenant.name] = seen.get(tenant.name, -1) + 1
        stream = tenant.streams_only or index % 3 != 1
        if tenant.name == FLAKY:
            phase = flaky_phase(k / flaky_total)
            probes = flaky.predictable if phase == PREDICTABLE else flaky.unpredictable
            probe = probes[k % len(probes)]
            requests.append(
                Request(index, FLAKY, probe.category, probe.prompt, probe.temperature, probe.seed, stream, phase=phase)
            )
            continue
        category = rng.choice(tenant.categories)
        pool = prompts[category]
        requests.append(
            Request(
                index,
                tenant.name,
                category,
                pool[rng.randrange(len(pool))],
                rng.choice(tenant.temperatures),
                seed + index,
                stream,
                tenant.headers[k % len(tenant.headers)],
            )
        )
    return requests


def flaky_candidates(prompts: Mapping[str, Sequence[str]], high: int, low: int) -> tuple[list[Probe], list[Probe]]:
    """Requests to calibrate: `high` greedy ones from summarization, code and chat (prompt lookup
    finds its drafts where the answer repeats the prompt or itself), and `low` chat and math ones at
    the hottest temperature that still speculates."""
    greedy = _interleave(prompts, ("summarization", "code", "chat"))[:high]
    hot = _interleave(prompts, ("chat", "math"))[:low]
    return (
        [Probe(c, p, 0.0, 0) for c, p in greedy],
        [Probe(c, p, UNPREDICTABLE_TEMPERATURE, 1000 + i) for i, (c, p) in enumerate(hot)],
    )


def _interleave(prompts: Mapping[str, Sequence[str]], categories: Sequence[str]) -> list[tuple[str, str]]:
    rows = zip(*(prompts[c] for c in categories), strict=False)
    return [(c, p) for row in rows for c, p in zip(categories, row, strict=True)]


def choose_flaky_plan(predictable: Sequence[Probe], unpredictable: Sequence[Probe], per_phase: int = 3) -> FlakyPlan:
    """The `per_phase` measured candidates with the highest acceptance for the predictable phase,
    and with the lowest for the unpredictable one."""

    def alpha(probe: Probe) -> float:
        return probe.alpha if probe.alpha is not None else 0.0

    return FlakyPlan(
        tuple(sorted(predictable, key=alpha, reverse=True)[:per_phase]),
        tuple(sorted(unpredictable, key=alpha)[:per_phase]),
    )


LEARNERS = ("adaptive", "speed")  # the policies whose decisions rest on measured speed (and priors)


def workload_prompts(per_category: int = PROMPTS_PER_CATEGORY) -> dict[str, list[str]]:
    """Held-out prompts by category (`prompts.py`), short enough for any engine's context."""
    return load_prompts(per_category, fits=lambda text: len(text) <= MAX_PROMPT_CHARS)
