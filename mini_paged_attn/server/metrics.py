"""GET /metrics through prometheus_client: the engine's statistics, the server's counters and
per-request latency histograms.

Each app has its own :class:`ServerMetrics` and ``CollectorRegistry`` (never the process-wide
default one), so two apps in one process keep apart. The gauges and counters are read from the
engine's ``stats()`` and the server's counters when scraped (:class:`_EngineCollector`); the
histograms are observed as each request finishes (:meth:`ServerMetrics.observe`, on the engine
client's output thread: prometheus_client's metrics are thread-safe).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ..engine.outputs import RequestOutput
from .async_client import AsyncClient

PREFIX = "mini_paged_attn_"

# (name without prefix, type, help, EngineStats attribute). A counter's name ends in _total.
_ENGINE_METRICS: tuple[tuple[str, str, str, str], ...] = (
    ("requests_running", "gauge", "Requests in the engine's running batch.", "num_running"),
    ("requests_waiting", "gauge",
     "Requests waiting to be scheduled (what --max-queue limits).", "num_waiting"),
    ("kv_blocks_total", "gauge", "KV cache blocks in the pool.", "kv_blocks_total"),
    ("kv_blocks_free", "gauge",
     "KV cache blocks no live request holds (evictable prefix-cache blocks count as free).",
     "kv_blocks_free"),
    ("prefix_cache_hit_rate", "gauge", "Share of prompt blocks found in the prefix cache.",
     "prefix_cache_hit_rate"),
    ("preemptions_total", "counter", "Requests preempted (recomputed) for lack of blocks.",
     "num_preemptions"),
    ("generation_tokens_total", "counter", "Tokens generated since the engine started.",
     "generation_tokens_total"),
    ("generation_tokens_per_second", "gauge", "Recent generation throughput.",
     "generation_tokens_per_s"),
)

# Seconds; vLLM's buckets, so dashboards made for it read these the same way.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)

# (name without prefix, help, buckets)
_HISTOGRAMS: tuple[tuple[str, str, tuple[float, ...]], ...] = (
    ("time_to_first_token_seconds",
     "Seconds from a request's arrival to its first generated token.", TTFT_BUCKETS),
    ("time_per_output_token_seconds",
     "Seconds per generated token after the first (a request's mean).", TPOT_BUCKETS),
    ("e2e_request_latency_seconds", "Seconds from a request's arrival to its end.",
     REQUEST_BUCKETS),
    ("request_queue_time_seconds", "Seconds a request waited before it was first scheduled.",
     REQUEST_BUCKETS),
)


class _EngineCollector(Collector):
    """The engine's statistics and the server's counters, read at each scrape."""

    def __init__(self, engine: AsyncClient) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        stats: Any = self.engine.stats()
        for name, kind, help_text, attr in _ENGINE_METRICS:
            value = getattr(stats, attr, None)
            if value is None:
                continue
            family = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            yield family(PREFIX + name, help_text, value=value)
        yield GaugeMetricFamily(PREFIX + "engine_up",
                                "1 while the engine runs, 0 once it has died.",
                                value=int(self.engine.alive))
        c = self.engine.counters
        requests = CounterMetricFamily(PREFIX + "server_requests_total",
                                       "Engine requests by how they ended.", labels=["outcome"])
        for outcome, value in (("finished", c.requests_finished), ("aborted", c.requests_aborted),
                               ("failed", c.requests_failed), ("rejected", c.requests_rejected)):
            requests.add_metric([outcome], value)
        yield requests


class ServerMetrics:
    """The registry behind one app's /metrics.

    Args:
        engine: the app's :class:`AsyncClient` (its ``stats()``, ``alive`` and ``counters`` are
            read at each scrape).
    """

    def __init__(self, engine: AsyncClient) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine))

        self.histograms = {
            name: Histogram(PREFIX + name, help_text, buckets=buckets, registry=self.registry)
            for name, help_text, buckets in _HISTOGRAMS}

    def observe(self, output: RequestOutput) -> None:
        """Record a finished request's latencies (those its metrics have times for)."""
        m, h = output.metrics, self.histograms
        if m.first_scheduled_time is not None:
            h["request_queue_time_seconds"].observe(
                max(0.0, m.first_scheduled_time - m.arrival_time))
        if m.first_token_time is not None:
            h["time_to_first_token_seconds"].observe(
                max(0.0, m.first_token_time - m.arrival_time))
            # Samples of one request decode side by side: the longest one counts the steps.
            steps = max((len(c.token_ids) for c in output.outputs), default=0) - 1
            if m.last_token_time is not None and steps > 0:
                h["time_per_output_token_seconds"].observe(
                    max(0.0, m.last_token_time - m.first_token_time) / steps)
        if m.finished_time is not None:
            h["e2e_request_latency_seconds"].observe(max(0.0, m.finished_time - m.arrival_time))

    def render(self, accept: str | None) -> tuple[bytes, str]:
        """``(body, content type)`` of a scrape: Prometheus' text format, or OpenMetrics when
        the ``Accept`` header asks for it."""
        encode, content_type = choose_encoder(accept or "")
        return encode(self.registry), content_type


__all__ = ["PREFIX", "ServerMetrics"]
