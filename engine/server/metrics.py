"""The server's Prometheus metrics (`GET /metrics`), through prometheus_client.

Each app has a registry of its own, so that two servers in one process (tests, a gateway that
embeds one) never share or clash. What an operator of an inference server watches: requests
running and waiting for the engine, a batching engine's steps and rows (mean batch size, the share
of rows that speculated), answers by HTTP status (429s are the queue bound at work),
time to first token and per output token, output tokens, and draft tokens tried and accepted per
algorithm (their ratio is the acceptance the middleware's breaker reads).
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.requests import Request
from starlette.responses import Response

from ace_mw.engine.batching import BatchEngine
from ace_mw.engine.generation import GenerationStats
from ace_mw.engine.params import SpecParams
from ace_mw.vocabulary import Algorithm

from .slot import EngineSlot

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


class ServerMetrics:
    """The metrics of one app, in its own registry."""

    def __init__(self, slot: EngineSlot, batch: BatchEngine | None = None) -> None:
        self.registry = CollectorRegistry()
        if batch is not None:
            self.registry.register(BatchCollector(batch))
        running = Gauge("ace_engine_requests_running", "Requests on the engine now", registry=self.registry)
        running.set_function(lambda: slot.running)
        waiting = Gauge("ace_engine_requests_waiting", "Requests waiting for the engine", registry=self.registry)
        waiting.set_function(lambda: slot.waiting)
        self._answers = Counter(
            "ace_engine_requests", "Completion requests answered, by HTTP status", ["status"], registry=self.registry
        )
        self._ttft = Histogram(
            "ace_engine_time_to_first_token_seconds",
            "Prefill to the first output token",
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        )
        self._tpot = Histogram(
            "ace_engine_time_per_output_token_seconds",
            "Decode time per output token after the first",
            buckets=TPOT_BUCKETS,
            registry=self.registry,
        )
        self._tokens = Counter("ace_engine_output_tokens", "Output tokens generated", registry=self.registry)
        self._drafted = Counter(
            "ace_engine_draft_tokens",
            "Draft positions the verifier tried",
            ["algorithm"],
            registry=self.registry,
        )
        self._accepted = Counter(
            "ace_engine_accepted_draft_tokens", "Draft tokens accepted", ["algorithm"], registry=self.registry
        )

    def finished(self, stats: GenerationStats, speculative: SpecParams | None) -> None:
        """A generation ran to its end (the answer's 200 is counted with it)."""
        self._answers.labels("200").inc()
        self._ttft.observe(stats.ttft_s)
        if stats.output_tokens > 1:
            self._tpot.observe(stats.tpot_s)
        self._tokens.inc(stats.output_tokens)
        algorithm = str(speculative.algorithm if speculative is not None else Algorithm.BASELINE)
        self._drafted.labels(algorithm).inc(stats.drafted)
        self._accepted.labels(algorithm).inc(stats.accepted)

    def refused(self, status: int) -> None:
        self._answers.labels(str(status)).inc()

    async def endpoint(self, request: Request) -> Response:
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)


class BatchCollector(Collector):
    """A batching engine's own counts, read at scrape time: steps, the decoding rows they ran (their
    ratio is the mean batch size), the rows that verified a draft (the share that speculated) and
    the prompt tokens prefix caching saved."""

    def __init__(self, batch: BatchEngine) -> None:
        self._batch = batch

    def collect(self) -> Iterator[Metric]:
        b = self._batch
        yield CounterMetricFamily("ace_engine_batch_steps", "Batched forward steps", value=b.steps)
        yield CounterMetricFamily("ace_engine_batch_rows", "Decoding rows over all steps", value=b.decoding_rows)
        yield CounterMetricFamily(
            "ace_engine_batch_speculating_rows", "Decoding rows that verified a draft", value=b.speculating_rows
        )
        yield CounterMetricFamily(
            "ace_engine_prefix_cached_tokens",
            "Prompt tokens a cache row held already (not computed)",
            value=b.rows.reused,
        )
