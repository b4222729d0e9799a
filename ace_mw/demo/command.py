"""`ace-mw demo`: the closed loop on a real workload, with a live view and a report.

The steps: check the inputs (report folder, model folders or upstream), load the engine (or probe
the upstream), serve one `AceSpecDec` per policy in front of it, warm up, calibrate the flaky
tenant (which of its prompts prompt lookup accepts well and badly, and how long its requests take,
which sets the gate's clocks), run the workload (`workload.py`) and write the report
(`report.py`). The terminal shows a spinner or a progress bar with a small live table throughout.
Ctrl-C stops the servers and writes the report of what was measured so far.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import time
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ace_mw import AceConfig, get_adapter
from ace_mw.config import key_digest
from ace_mw.directive import ALGORITHMS
from ace_mw.engine.bundled import MODELS_DIR, missing, weight_files
from ace_mw.errors import ConfigError, UsageError

from . import workload
from .workload import DEMO_POLICIES, FLAKY, TENANTS

if TYPE_CHECKING:
    from .live import View
    from .runner import Record, WorkloadRun

QUICK = (48, 32)  # requests, max_tokens
FULL = (180, 64)
QUICK_VLLM = (10, 32)  # requests at one client (bursts add 15 x 1 more per policy), max_tokens
FULL_VLLM = (30, 64)  # bursts: 15 x 2 more per policy, in two rounds (a tenant's dozen under bursts)
UNTIMED = 1.0  # the pace the config assumes until calibration has timed requests (warm-up, probe)
PROMPT_FILES = (MODELS_DIR / "chat_eval.json", MODELS_DIR / "bench_prompts.json")
BUNDLED = (MODELS_DIR / "ace-tiny-chat", MODELS_DIR / "ace-tiny-chat-eagle", MODELS_DIR / "ace-tiny-chat-draft")
METHOD = """\
- Requests run one at a time; each workload request goes to every policy in turn (the first policy
  rotating), with the same prompt, temperature and seed, so load from other processes hits all alike.
- output tokens/s: the policy's output tokens (`usage.completion_tokens`) over the sum of its request
  latencies, client-side and end to end (prefill included).
- TPOT: decode time per output token after the first. Streams: the client's time from the first to
  the last token-bearing chunk. Non-streaming responses: the engine's reported decode time
  (`metrics.speculative_decoding.decode_time_s`), or none where the engine reports none.
- speculated: the share of the policy's requests it sent to speculate (outcome `applied`); the
  engine may still have drafted little on some of them.
- alpha: the engine's acceptance rate of the response (`draft_acceptance_rate`), read with the
  adapter; breaker and rolling alpha: the tenant's breaker in that policy's controller right after
  the response (`controller.store.view`)."""


@dataclass(frozen=True)
class Plan:
    """What the command line asks for, checked."""

    requests: int
    max_tokens: int
    out: Path
    adapter: str
    upstream: str | None
    folders: tuple[Path | None, Path | None, Path | None]  # target, EAGLE head, draft model
    engine: str = "ace"  # "ace" (in-process, or --upstream) | "llamacpp" (real pools this command starts)


def plan(args: argparse.Namespace, quick: bool) -> Plan:
    requests, max_tokens = QUICK if quick else FULL
    requests = args.requests if args.requests is not None else requests
    max_tokens = args.max_tokens if args.max_tokens is not None else max_tokens
    if requests < 1 or max_tokens < 2:
        raise UsageError("--requests must be >= 1 and --max-tokens >= 2")
    engine = getattr(args, "engine", "ace")
    if engine == "llamacpp":
        return plan_llamacpp(args, requests, max_tokens)
    if args.upstream and not args.adapter:
        raise UsageError("--upstream needs --adapter (vllm, sglang, trtllm, llamacpp or ace)")
    adapter = args.adapter or "ace"
    try:
        get_adapter(adapter)
    except ConfigError as exc:
        raise UsageError(f"--adapter: {exc.problem}") from None
    for prompts in PROMPT_FILES:
        problem = missing(prompts, "the workload's prompt file")
        if problem is not None:
            raise UsageError(problem)
    if args.upstream:
        return Plan(requests, max_tokens, Path(args.out), adapter, args.upstream, (None, None, None))
    target, eagle, draft = (Path(p) if p else None for p in (args.model, args.eagle, args.draft))
    if target is None:  # the bundled model, with the bundled drafters unless others are given
        target = BUNDLED[0]
        eagle = eagle or (BUNDLED[1] if BUNDLED[1].exists() else None)
        draft = draft or (BUNDLED[2] if BUNDLED[2].exists() else None)
    for flag, folder in (("--model", target), ("--eagle", eagle), ("--draft", draft)):
        if folder is not None:
            check_model_folder(flag, folder)
    return Plan(requests, max_tokens, Path(args.out), adapter, None, (target, eagle, draft))


def plan_llamacpp(args: argparse.Namespace, requests: int, max_tokens: int) -> Plan:
    """Real llama-server pools of the bundled models (plain, prompt lookup, draft model), which
    the command starts itself: the binary must be built (`python -m ace_mw.demo.llamacpp build`)."""
    from . import llamacpp

    if args.upstream or args.model or args.eagle or args.draft:
        raise UsageError(
            "--engine llamacpp starts its own pools of the bundled models: drop --upstream/--model/--eagle/--draft"
        )
    if args.adapter not in (None, "llamacpp"):
        raise UsageError("--engine llamacpp runs the llamacpp adapter")
    if args.device != "cpu":
        raise UsageError("--engine llamacpp runs on the CPU (the pinned build has no GPU backend)")
    if llamacpp.server_binary() is None:
        raise UsageError(f"--engine llamacpp: llama-server is not built here: {llamacpp.HOW_TO_GET}")
    for folder in (BUNDLED[0], BUNDLED[2]):
        check_model_folder("the bundled models", folder)
    return Plan(requests, max_tokens, Path(args.out), "llamacpp", None, (BUNDLED[0], None, BUNDLED[2]), "llamacpp")


def check_model_folder(flag: str, folder: Path) -> None:
    problem = missing(folder, flag)
    if problem is not None:
        raise UsageError(problem)
    if not (folder / "config.json").exists():
        raise UsageError(f"{flag} {folder}: no config.json in the folder")
    if not weight_files(folder):
        raise UsageError(f"{flag} {folder}: no model weights (model.safetensors or pytorch_model.bin) in the folder")


def check_writable(out: Path) -> None:
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".ace-demo-write-check"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise UsageError(f"--out {out}: cannot write there ({exc.strerror or exc})") from None


def check_installed(upstream: bool) -> None:
    """Every module the run needs, found before anything loads (the engine's only in-process)."""
    needed = ["openai", "uvicorn", "httpx", "rich", "matplotlib"] + ([] if upstream else ["torch", "transformers"])
    for name in needed:
        if importlib.util.find_spec(name) is None:
            raise UsageError(
                f"{name} is not installed; the demo needs the engine and demo extras: pip install -e '.[demo]'"
            )


def probe_upstream(url: str, adapter_name: str, config: dict[str, Any]) -> str:
    """The upstream's model name, after one speculative request whose response must carry the
    adapter's figures (else the adapter is the wrong one, or the engine reports nothing)."""
    import httpx

    base = url.rstrip("/").removesuffix("/v1")
    try:
        listed = httpx.get(base + "/v1/models", timeout=10.0)
        models = [m.get("id") for m in listed.json().get("data", [])] if listed.status_code == 200 else []
        if not models or not isinstance(models[0], str):
            raise UsageError(f"--upstream {url}: GET /v1/models gave no model (HTTP {listed.status_code})")
        adapter = get_adapter(adapter_name)
        directive = AceConfig.from_dict(config).org.directives[1, "ok", True]
        body, _ = adapter.inject(
            {
                "model": models[0],
                "messages": [{"role": "user", "content": "Repeat after me: one two three, one two three."}],
                "max_tokens": 16,
                "temperature": 0.0,
            },
            directive,
        )
        reply = httpx.post(base + "/v1/chat/completions", json=body, timeout=300.0)
    except httpx.HTTPError as exc:
        raise UsageError(f"--upstream {url}: unreachable ({exc})") from None
    except ValueError:
        raise UsageError(f"--upstream {url}: GET /v1/models did not answer JSON") from None
    if reply.status_code != 200:
        raise UsageError(f"--upstream {url}: the probe request failed with HTTP {reply.status_code}")
    try:
        figures = adapter.extract(reply.json())
    except ValueError:
        figures = None
    if figures is None:
        raise UsageError(
            f"--upstream {url}: the probe response carries none of the {adapter_name} adapter's figures "
            "(wrong --adapter, or the engine does not report per-request figures)"
        )
    return models[0]


# -- the command --------------------------------------------------------------------------------


@dataclass
class Demo:
    """One run of the workload under `policies` (the first is the adaptive one); `run` and `meta`
    hold what was measured and how, also after a Ctrl-C."""

    checked: Plan
    args: argparse.Namespace
    view: View
    policies: Sequence[str]
    run: WorkloadRun | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    def execute(self) -> None:
        if self.checked.engine == "llamacpp":
            from . import llamacpp

            threads = self.args.threads or 1
            self.view.phase(f"starting llama-server pools (plain, prompt lookup, draft model; {threads} thread(s))")
            with llamacpp.pools(llamacpp.bundled_specs(threads=threads)) as servers:
                urls = {name: server.url for name, server in servers.items()}
                text = (
                    f"llama.cpp llama-server {llamacpp.LLAMA_CPP_COMMIT} pools ({', '.join(urls)}), ace-tiny-chat f32, "
                    f"{threads} thread(s) each"
                )
                self.measure_workload(urls, "ace-tiny-chat", tuple(workload.POOL_ALGORITHMS.values()), text, urls)
            return
        self.measure_workload(None, None, ALGORITHMS, "", None)

    def measure_workload(
        self,
        upstream: str | dict[str, str] | None,
        model: str | None,
        algorithms: Sequence[str],
        engine_text: str,
        pools: dict[str, str] | None,
    ) -> None:
        from .runner import WorkloadRun, proxy_app

        checked, view = self.checked, self.view
        if pools is not None:
            assert upstream is not None and model is not None
            app = proxy_app(upstream)
        elif checked.upstream:
            if not getattr(get_adapter(checked.adapter), "switches_per_request", False):
                # One server that speculates one way: one candidate (several would be one arm).
                algorithms = ("eagle_2",)
            view.phase(f"probing {checked.upstream} with the {checked.adapter} adapter")
            probe_config = workload.demo_config(checked.adapter, UNTIMED, algorithms)
            model = probe_upstream(checked.upstream, checked.adapter, probe_config)
            app = proxy_app(checked.upstream.rstrip("/").removesuffix("/v1"))
            engine_text = f"upstream {checked.upstream} ({checked.adapter} adapter)"
        else:
            app, model, algorithms, engine_text = load_engine(checked, self.args, view)
        run = self.run = WorkloadRun(app, model, checked.adapter, checked.max_tokens, self.policies)
        prompts = workload.workload_prompts()
        flaky_count = sum(t.name == FLAKY for t in workload.tenant_schedule(checked.requests))
        high, low = workload.flaky_candidates(prompts, min(24, 2 * flaky_count), min(4, max(1, flaky_count // 2)))
        with run.serving(workload.demo_config(checked.adapter, UNTIMED, algorithms, pools)):
            view.phase("warming up (one short request per policy)")
            run.warm_up(prompts["chat"][0])
            view.phase(f"calibrating the flaky tenant: {len(high) + len(low)} requests with prompt lookup")
            measured, latency = run.calibrate([*high, *low])
            config = workload.demo_config(checked.adapter, latency * len(self.policies), algorithms, pools)
            flaky = workload.choose_flaky_plan(measured[: len(high)], measured[len(high) :])
            warm, warm_requests = workload.prior_warm_up(config, prompts)
            learners = [p for p in self.policies if p in workload.LEARNERS]
            count = len(warm_requests)
            if learners:
                view.phase(f"warming up the priors: {count} requests of warm-up tenants over every arm")
                run.configure(warm)
                run.warm_priors(warm_requests, learners)
                started_from = run.router.controllers[learners[0]].status()["priors"]
            run.configure(config)
            self.meta = describe(config, measured, flaky, engine_text, latency)
            if learners:
                self.meta["priors"] = (
                    f" {', '.join(learners)} started from the priors of {count} warm-up requests (one tenant per"
                    " prompt category, never reported, over every arm; not in the figures), as a gateway that has"
                    " served the model does."
                )
                self.meta["prior_rows"] = started_from
            requests = workload.build_workload(checked.requests, prompts, flaky, self.args.seed)
            view.start(len(requests) * len(self.policies))
            run.run(requests, view.record)


@dataclass(frozen=True)
class Measurement:
    """What a run measured: every record, and the report's account of the setup."""

    checked: Plan
    records: list[Record]
    meta: dict[str, Any]
    interrupted: bool


def measure(args: argparse.Namespace, policies: Sequence[str], quick: bool = False) -> Measurement:
    """Check the inputs, then run the workload under `policies` with the live view; a Ctrl-C stops
    the run (and its servers) and keeps what was measured."""
    checked = plan(args, quick)
    check_writable(checked.out)
    check_installed(checked.upstream is not None)
    from rich.console import Console
    from rich.live import Live

    from .live import View

    console = Console()
    demo = Demo(checked, args, View(console, policies), policies)
    started, load = time.time(), os.getloadavg()[0]
    interrupted = False
    live = Live(demo.view, console=console, refresh_per_second=8) if console.is_terminal else nullcontext()
    try:
        with live:
            demo.execute()
    except KeyboardInterrupt:
        interrupted = True
    records = demo.run.records if demo.run is not None else []
    meta = {**demo.meta, "interrupted": interrupted}
    meta["conditions"] = conditions(checked, meta, records, policies, started, load)
    return Measurement(checked, records, meta, interrupted)


def run_demo(args: argparse.Namespace) -> int:
    from .report import answer, policy_rows, write_report

    if getattr(args, "engine", "ace") == "vllm":
        return run_vllm_demo(args)
    policies = workload.POOL_POLICIES if getattr(args, "engine", "ace") == "llamacpp" else DEMO_POLICIES
    done = measure(args, policies, args.quick)
    status = 130 if done.interrupted else 0
    if not done.records:
        print("interrupted before any response: no report" if done.interrupted else "no responses: no report")
        return status or 1
    report = write_report(done.checked.out, done.records, policies, done.meta)
    print(f"report: {report} (with report.json and the charts)")
    print(answer(policy_rows(done.records, policies), done.records))
    return status


def load_engine(checked: Plan, args: argparse.Namespace, view: View) -> tuple[Any, str, list[str], str]:
    target, eagle, draft = checked.folders
    assert target is not None
    view.phase("importing torch and the engine")
    import torch

    from ace_mw.engine import Engine
    from ace_mw.engine.server.app import create_app

    if args.device == "cpu":
        torch.set_num_threads(args.threads or 1)
    elif args.threads:
        torch.set_num_threads(args.threads)
    drafters = ", ".join(name for name, f in (("EAGLE head", eagle), ("draft model", draft)) if f) or "no drafter"
    view.phase(f"loading {target.name} ({drafters}) on {args.device}")
    try:
        engine = Engine.from_pretrained(target, eagle=eagle, draft=draft, device=args.device)
    except (RuntimeError, ValueError) as exc:
        raise UsageError(f"cannot load the model on {args.device}: {str(exc).splitlines()[0]}") from None
    algorithms = ["ngram"] + ["eagle_2"] * (eagle is not None) + ["draft_model"] * (draft is not None)
    text = (
        f"in-process engine (its self-gating off), {target.name}, {args.device}, "
        f"{torch.get_num_threads()} torch thread(s)"
    )
    # The demo measures the middleware's loop, so the engine drafts what each policy asks for. Left on,
    # the engine's own per-step gate (docs/engine.md) would turn always-on into a second adaptive policy.
    # No prefix caching: the policies send each request in turn, and the one-row loop would start
    # every policy but the first from the prompt the first one left in its row. The first policy
    # rotates with the request, but each tenant's requests fall on the same turns, so per tenant
    # one policy would pay every prefill (docs/benchmarks.md, "The closed loop").
    engine.one_row().prefix_caching = False
    return create_app(engine, self_gate=False), engine.model_name, algorithms, text


def describe(
    config: dict[str, Any], measured: Sequence[workload.Probe], flaky: workload.FlakyPlan, engine: str, latency: float
) -> dict[str, Any]:
    """The report's account of the setup: policies, tenants, gate, calibration."""
    ace = AceConfig.from_dict(config)
    multi = next(t for t in TENANTS if t.name == "multi")

    def span(probes: Sequence[workload.Probe]) -> str:
        alphas = [p.alpha for p in probes if p.alpha is not None]
        return f"alpha {min(alphas):.2f}-{max(alphas):.2f}" if alphas else "alpha n/a"

    gate = config["gate"]
    calibration = (
        "Calibration (always-on, not in the figures): the flaky tenant's candidate requests measured with "
        f"prompt lookup; the best and the worst are used. Predictable phase: {len(flaky.predictable)} greedy "
        "prompts, "
        f"{span(flaky.predictable)}; unpredictable phase: {len(flaky.unpredictable)} chat/math prompts at "
        f"T={workload.UNPREDICTABLE_TEMPERATURE}, {span(flaky.unpredictable)}. Mean calibration request "
        f"{latency:.2f} s, so `gate.cooldown_s` = {gate['cooldown_s']} s (max {gate['max_cooldown_s']} s), "
        f"{workload.COOLDOWN_INTERVALS}x the time between the flaky tenant's requests, and `speed_half_life_s` = "
        f"{gate['speed_half_life_s']} s; `ema_half_life` "
        f"{gate['ema_half_life']}, `min_samples` {gate['min_samples']}, `min_probe_samples` "
        f"{gate['min_probe_samples']}, `probe_fraction` {gate['probe_fraction']}."
    )
    return {
        "engine": engine,
        "config": config,
        "gate": {"alpha_floor": ace.gate.alpha_floor, "reenable_threshold": ace.gate.reenable_threshold},
        "policies": workload.POLICY_MEANING,
        "tenants": {t.name: t.about for t in TENANTS},
        "multi_tenant": multi.name,
        "multi_arms": list(ace.key_table[key_digest(multi.key)].arms),
        "calibration": calibration,
        "flaky_plan": {
            "predictable": [p.alpha for p in flaky.predictable],
            "unpredictable": [p.alpha for p in flaky.unpredictable],
            "measured": [{"category": p.category, "temperature": p.temperature, "alpha": p.alpha} for p in measured],
        },
        "method": METHOD,
    }


OWN_LOAD = 1.0  # the load average the demo adds by itself


def conditions(
    checked: Plan, meta: dict[str, Any], records: Sequence[Record], policies: Sequence[str], started: float, load: float
) -> str:
    """The sentence under the table: what ran where, for how long, under what load."""
    cpus = os.cpu_count() or 1
    end_load = os.getloadavg()[0]
    when = datetime.fromtimestamp(started, tz=timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    requests = len({r.index for r in records})
    text = (
        f"Measured {when} on {platform.machine()} ({cpus} CPUs), {meta.get('engine', '')}: {requests} requests x "
        f"{len(policies)} policies ({len(records)} responses), max_tokens {checked.max_tokens}, "
        f"{time.time() - started:.0f} s. Load average {load:.1f} at the start, {end_load:.1f} at the end."
    ) + meta.get("priors", "")
    # The demo keeps about one core busy itself (the engine's thread, the client): the machine is
    # busy when other work takes over half of the rest.
    if max(load, end_load) > OWN_LOAD + max(0.0, cpus - OWN_LOAD) / 2:
        text += (
            " The machine was busy with other work: absolute figures are low and noisy; the policies shared"
            " the load alike (interleaved), so compare them with each other."
        )
    return text


def run_vllm_demo(args: argparse.Namespace) -> int:
    """`--engine vllm`: the workload of `vllm_run.py` on real vLLM pools the command starts."""
    from . import vllm, vllm_report, vllm_run

    if args.upstream or args.model or args.eagle or args.draft or args.adapter not in (None, "vllm"):
        raise UsageError("--engine vllm starts its own pools of the bundled models with the vllm adapter")
    if vllm.python() is None:
        raise UsageError(f"--engine vllm: vLLM is not built here: {vllm.HOW_TO_GET}")
    requests, max_tokens = QUICK_VLLM if args.quick else FULL_VLLM
    requests = args.requests if args.requests is not None else requests
    max_tokens = args.max_tokens if args.max_tokens is not None else max_tokens
    if requests < 4 or max_tokens < 2:
        raise UsageError("--engine vllm: --requests must be >= 4 and --max-tokens >= 2")
    out = Path(args.out)
    check_writable(out)
    try:
        data = vllm_report.run(
            out,
            requests=requests,
            max_tokens=max_tokens,
            per_client=1 if args.quick else 2,
            burst_rounds=1 if args.quick else 2,
            warm_requests=requests if args.quick else vllm_run.STEADY_WARM_UP,  # the benchmark's
            eager=args.quick,
        )
    except KeyboardInterrupt:
        return 130
    print(vllm_report.table(data))
    print(f"report: {out / 'report.md'} (with report.json)")
    return 0
