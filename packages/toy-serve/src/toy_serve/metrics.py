"""Prometheus metrics of one server: ``Metrics`` owns its own registry.

What is measured (all names start with ``toy_``):

- ``toy_requests_total{endpoint, status}``: every HTTP request, counted when
  its response has been sent (a stream counts when it ends). ``endpoint`` is
  the route path for the known routes and "other" for anything else, so a
  client probing random paths cannot grow the label set.
- ``toy_prompt_tokens_total`` / ``toy_completion_tokens_total``: tokens of
  finished sequences (generation and embedding jobs), counted by the engine
  worker when a job ends, whatever its finish reason.
- ``toy_sequences_finished_total{finish_reason}``: jobs ended, by reason
  (stop, length, cancelled).
- gauges ``toy_queue_depth``, ``toy_active_sequences``,
  ``toy_kv_cells_used`` (cached tokens over all slots), set by the worker
  after each step and each submit.
- histograms ``toy_time_to_first_token_seconds`` (submit to first sampled
  token), ``toy_inter_token_latency_seconds`` (between two tokens of one
  sequence), ``toy_queue_wait_seconds`` (submit to admission into a slot)
  and ``toy_request_duration_seconds{endpoint}`` (HTTP request start to the
  last byte of the response, for every endpoint).

- the prefix cache (``toy.engine.prefix``), read from its stats at each
  scrape while it is on: ``toy_prefix_cache_hits_total`` and
  ``toy_prefix_cache_misses_total`` (16-token prompt blocks found or not by
  lookups), the gauge ``toy_prefix_cache_hit_ratio`` (hits / (hits +
  misses) since start), ``toy_prefix_cache_evictions_total{tier}`` (RAM:
  blocks evicted, spilled to disk when there is a folder; disk: files
  deleted for the folder's bound), ``toy_prefix_cache_discarded_total``
  (damaged or foreign block files), gauges ``toy_prefix_cache_bytes{tier}``
  and ``toy_prefix_cache_blocks{tier}``. ``toy_prefix_cache_cached_tokens_total``
  (always there) sums the usage ``cached_tokens`` of finished sequences.

- speculative decoding (``toy.engine.speculative``):
  ``toy_speculative_draft_tokens_total{proposer}`` (draft tokens verified by
  the target, proposer ngram or draft) and
  ``toy_speculative_accepted_tokens_total{proposer}`` (of them, the ones the
  target's own token step produced), counted by the worker at each verify.

- ``toy_telemetry_ok`` (gauge, 1 or 0) and ``toy_telemetry_errors_total``
  (counter): whether the run bundle's last write succeeded, and how many
  events could not be written (a full ``--runs-dir``, an I/O error). Read
  from the run writer when /metrics is scraped (``watch_telemetry``); the
  requests themselves never see such a failure (``toy.runs.writer``'s
  "degrade" policy). ``toy_telemetry_ok`` is 1 while no bundle is open yet.
- ``toy_requests_total{status="401"}`` is the only record of a refused
  (unauthenticated) request: no ``request`` event is written for it (a
  client without a key must not be able to grow the run bundle); the guard
  adds at most one ``note`` per minute with the count instead.

Invariants: no module-level state. Each ``Metrics`` has its own
``CollectorRegistry``, so several apps (tests) in one process never share
or clash over series. All methods are thread-safe (prometheus_client's
metrics are): the worker thread and the event loop both call them.

Decision: request duration is observed per HTTP request by the app, not per
job: a request with n=4 or with several prompts is one request, and the
duration includes tokenization and the response. ``finished`` accepts the
job's own duration (the worker passes it) but does not observe it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# generate_latest writes the classic text format (0.0.4); newer prometheus_client versions name 1.0.0 in
# their CONTENT_TYPE_LATEST for the same bytes, so the version is stated here, matching what is written.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Bucket edges (seconds). A small model on a CPU decodes in ~5-50 ms per token and a request
# can wait in the queue for minutes, so the ranges differ per histogram.
_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5)
_WAIT = (0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_DURATION = (0.005, 0.025, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class _Telemetry:
    """A collector reading the run writer's health at scrape time (``Metrics.watch_telemetry``)."""

    def __init__(self) -> None:
        self.source: Callable[[], Any] | None = None

    def collect(self) -> Any:
        writer = self.source() if self.source is not None else None
        ok = GaugeMetricFamily("toy_telemetry_ok", "1 while the run bundle's last write succeeded, else 0.")
        ok.add_metric([], 1.0 if getattr(writer, "healthy", True) else 0.0)
        errors = CounterMetricFamily("toy_telemetry_errors", "Run-bundle events that could not be written.")
        errors.add_metric([], float(getattr(writer, "errors", 0)))
        return [ok, errors]


class _PrefixCacheStats:
    """A collector reading the prefix cache's stats at scrape time (``Metrics.watch_prefix_cache``)."""

    def __init__(self) -> None:
        self.source: Callable[[], Any] | None = None

    def collect(self) -> Any:
        st = self.source() if self.source is not None else None
        if st is None:
            return []
        hits = CounterMetricFamily("toy_prefix_cache_hits", "Prompt blocks (16 tokens) found in the prefix cache.")
        hits.add_metric([], float(st.hits))
        misses = CounterMetricFamily("toy_prefix_cache_misses", "Prompt blocks looked up and not found.")
        misses.add_metric([], float(st.misses))
        ratio = GaugeMetricFamily("toy_prefix_cache_hit_ratio", "hits / (hits + misses) since start (0 before any).")
        ratio.add_metric([], st.hits / (st.hits + st.misses) if st.hits + st.misses else 0.0)
        ev = CounterMetricFamily(
            "toy_prefix_cache_evictions",
            "Blocks evicted: from RAM (spilled to disk if any), from disk.",
            labels=["tier"],
        )
        ev.add_metric(["ram"], float(st.evictions))
        ev.add_metric(["disk"], float(st.disk_evictions))
        bad = CounterMetricFamily("toy_prefix_cache_discarded", "Damaged or foreign block files deleted unused.")
        bad.add_metric([], float(st.discarded))
        size = GaugeMetricFamily("toy_prefix_cache_bytes", "Bytes of blocks held, by tier.", labels=["tier"])
        size.add_metric(["ram"], float(st.ram_bytes))
        size.add_metric(["disk"], float(st.disk_bytes))
        blocks = GaugeMetricFamily("toy_prefix_cache_blocks", "Blocks held, by tier.", labels=["tier"])
        blocks.add_metric(["ram"], float(st.ram_blocks))
        blocks.add_metric(["disk"], float(st.disk_blocks))
        return [hits, misses, ratio, ev, bad, size, blocks]


class Metrics:
    """The counters, gauges and histograms of one app; ``render()`` is the /metrics body."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "toy_requests", "HTTP requests by endpoint and status code.", ["endpoint", "status"], registry=r
        )
        self.prompt_tokens = Counter("toy_prompt_tokens", "Prompt tokens of finished sequences.", registry=r)
        self.completion_tokens = Counter("toy_completion_tokens", "Generated tokens of finished sequences.", registry=r)
        self.sequences = Counter(
            "toy_sequences_finished", "Sequences (jobs) finished, by finish reason.", ["finish_reason"], registry=r
        )
        self.queue_depth = Gauge("toy_queue_depth", "Sequences waiting for a cache slot.", registry=r)
        self.active = Gauge("toy_active_sequences", "Sequences holding a cache slot.", registry=r)
        self.kv_cells = Gauge("toy_kv_cells_used", "KV cache cells in use over all slots.", registry=r)
        self.time_to_first_token = Histogram(
            "toy_time_to_first_token_seconds",
            "From submit to the first sampled token.",
            buckets=_WAIT,
            registry=r,
        )
        self.inter_token = Histogram(
            "toy_inter_token_latency_seconds",
            "Between two consecutive tokens of one sequence.",
            buckets=_LATENCY,
            registry=r,
        )
        self.queue_wait_s = Histogram(
            "toy_queue_wait_seconds", "From submit to admission into a cache slot.", buckets=_WAIT, registry=r
        )
        self.request_duration = Histogram(
            "toy_request_duration_seconds",
            "HTTP request duration, to the last byte of the response.",
            ["endpoint"],
            buckets=_DURATION,
            registry=r,
        )
        self.cached_tokens = Counter(
            "toy_prefix_cache_cached_tokens",
            "Prompt tokens not prefilled because their K/V were cached (a slot's own prefix or prefix-cache "
            "blocks): the sum of the responses' usage cached_tokens.",
            registry=r,
        )
        self.draft_tokens = Counter(
            "toy_speculative_draft_tokens",
            "Draft tokens verified by the target model, by proposer (ngram, draft).",
            ["proposer"],
            registry=r,
        )
        self.accepted_tokens = Counter(
            "toy_speculative_accepted_tokens",
            "Draft tokens accepted (equal to the token the target's own step produced), by proposer.",
            ["proposer"],
            registry=r,
        )
        self._telemetry = _Telemetry()
        r.register(self._telemetry)
        self._prefix = _PrefixCacheStats()
        r.register(self._prefix)

    # -- called by the engine worker (its thread)

    def queue_wait(self, seconds: float) -> None:
        self.queue_wait_s.observe(max(0.0, seconds))

    def ttft(self, seconds: float) -> None:
        self.time_to_first_token.observe(max(0.0, seconds))

    def itl(self, seconds: float) -> None:
        self.inter_token.observe(max(0.0, seconds))

    def finished(self, job: Any, reason: str, duration_s: float | None = None) -> None:
        """A job ended: count its tokens (prompt = ``len(job.ids)``, completion = ``len(job.out)``)."""
        self.prompt_tokens.inc(len(getattr(job, "ids", ()) or ()))
        self.completion_tokens.inc(len(getattr(job, "out", ()) or ()))
        self.cached_tokens.inc(getattr(job, "cached", 0) or 0)
        self.sequences.labels(finish_reason=str(reason)).inc()

    def speculated(self, proposer: str, drafted: int, accepted: int) -> None:
        """One verify step of a speculating job: ``drafted`` draft tokens, ``accepted`` of them kept."""
        self.draft_tokens.labels(proposer=proposer).inc(drafted)
        self.accepted_tokens.labels(proposer=proposer).inc(accepted)

    def gauges(self, queue: int, active: int, kv_cells: int) -> None:
        self.queue_depth.set(queue)
        self.active.set(active)
        self.kv_cells.set(kv_cells)

    # -- called by the app

    def request(self, endpoint: str, status: int | str, duration_s: float | None = None) -> None:
        """Count one HTTP request (and observe its duration when given)."""
        self.requests.labels(endpoint=endpoint, status=str(status)).inc()
        if duration_s is not None:
            self.request_duration.labels(endpoint=endpoint).observe(max(0.0, duration_s))

    def watch_prefix_cache(self, source: Callable[[], Any]) -> None:
        """Report ``source()``'s prefix-cache stats (a ``toy.engine.prefix.PrefixStats``) at each scrape."""
        self._prefix.source = source

    def watch_telemetry(self, source: Callable[[], Any]) -> None:
        """Report ``source()``'s ``healthy``/``errors`` (a ``RunWriter``, or None) at each scrape."""
        self._telemetry.source = source

    def render(self) -> bytes:
        """The Prometheus text exposition format (``CONTENT_TYPE``)."""
        return generate_latest(self.registry)

    def value(self, name: str, labels: dict[str, str] | None = None) -> float | None:
        """One sample's current value (tests and diagnostics), e.g. ``value("toy_requests_total", {...})``."""
        return self.registry.get_sample_value(name, labels or {})


__all__ = ["CONTENT_TYPE", "Metrics"]
