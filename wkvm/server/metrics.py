"""Prometheus metrics (`wkvm_*`), one registry per server."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, Metric

if TYPE_CHECKING:
    from wkvm.engine.engine import EngineStats
    from wkvm.state.store import StateStore

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


STREAM_COUNTERS = {
    "cache_hits": "Weight-layer cache hits",
    "cache_misses": "Weight-layer cache misses",
    "readahead_hits": "Cache misses whose layer the read-ahead looked at beforehand",
    "readahead_misses": "Cache misses with no read-ahead before them",
    "readahead_requests": "Layers the read-ahead asked the OS to read from disk (others were already in RAM)",
    "bytes_read": "Weight bytes copied from the pack files (OS page cache or disk)",
    "disk_reads": "Layers read from disk because the OS had not cached them",
}


class StreamCollector:
    """Weight-streaming counters, read from the model's provider at scrape time."""

    def __init__(self) -> None:
        self.stats: object | None = None  # StreamStats; read by attribute name

    def collect(self) -> Iterator[Metric]:
        stats = self.stats
        if stats is None:
            return
        for name, help_ in STREAM_COUNTERS.items():
            yield CounterMetricFamily(f"wkvm_weight_{name}", help_, value=getattr(stats, name))


class StoreCollector:
    """The state store's own counters, read at scrape time."""

    def __init__(self) -> None:
        self.not_kept: int | None = None

    def collect(self) -> Iterator[Metric]:
        if self.not_kept is not None:
            yield CounterMetricFamily("wkvm_checkpoints_not_kept", "Reuse checkpoints and parked chats not kept: "
                                      "larger than --checkpoint-bytes, the state tiers or --max-state-tokens allow",
                                      value=self.not_kept)  # fmt: skip


class DraftCollector:
    """Speculative decoding's counters (vLLM's spec_decode_num_draft_tokens / _accepted_tokens), read at scrape
    time from the engine's stats; none while it does not speculate."""

    def __init__(self) -> None:
        self.counts: tuple[int, int] | None = None  # (drafted, accepted)

    def collect(self) -> Iterator[Metric]:
        if self.counts is not None:
            yield CounterMetricFamily("wkvm_spec_decode_draft_tokens", "Draft tokens checked (speculative decoding)",
                                      value=self.counts[0])  # fmt: skip
            yield CounterMetricFamily("wkvm_spec_decode_accepted_tokens", "Draft tokens accepted (speculative "
                                      "decoding): tokens put out beyond one a step", value=self.counts[1])  # fmt: skip


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("wkvm_requests", "HTTP requests by route and status", ["route", "status"], registry=r)
        self.prompt_tokens = Counter("wkvm_prompt_tokens", "Prompt tokens received", registry=r)
        self.generated_tokens = Counter("wkvm_generation_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram("wkvm_time_to_first_token_seconds", "Time to first token", buckets=LATENCY_BUCKETS,
                              registry=r)  # fmt: skip
        self.itl = Histogram("wkvm_inter_token_latency_seconds", "Time between tokens", buckets=LATENCY_BUCKETS,
                             registry=r)  # fmt: skip
        # as vLLM's request_success_total{finished_reason} and e2e_request_latency_seconds, one per choice
        self.finish_reasons = Counter("wkvm_choices_finished", "Choices finished, by reason (stop, length, abort, "
                                      "error)", ["finished_reason"], registry=r)  # fmt: skip
        self.e2e = Histogram("wkvm_e2e_request_latency_seconds", "Time from a request's arrival to a choice's end",
                             buckets=LATENCY_BUCKETS + (60, 120, 300), registry=r)  # fmt: skip
        self.queue_time = Histogram("wkvm_request_queue_time_seconds", "Time a choice waited in the engine's queue "
                                    "for a slot (vLLM's request_queue_time_seconds)",
                                    buckets=LATENCY_BUCKETS + (60, 120), registry=r)  # fmt: skip
        self.queue_depth = Gauge("wkvm_queue_depth", "Requests waiting for a slot", registry=r)
        self.running = Gauge("wkvm_running_requests", "Requests holding a slot", registry=r)
        self.slots_free = Gauge("wkvm_slots_free", "Free state slots", registry=r)
        self.slots_total = Gauge("wkvm_slots_total", "State slots", registry=r)
        # attention models (llama.cpp's kv_cache_usage_ratio, vLLM's kv_cache_usage_perc): 0 without a KV pool
        self.kv_usage = Gauge("wkvm_kv_cache_usage_ratio", "Share of the key/value page pool held by sequences",
                              registry=r)  # fmt: skip
        self.kv_pages = Gauge("wkvm_kv_cache_pages", "Pages of the key/value pool", registry=r)
        self.states = Gauge("wkvm_states", "Stored state blobs by tier", ["tier"], registry=r)
        self.state_bytes = Gauge("wkvm_state_bytes", "Bytes of stored states by tier", ["tier"], registry=r)
        self.reuse_hits = Counter("wkvm_prefix_reuse_hits", "Requests that resumed from a stored state", registry=r)
        self.reuse_misses = Counter("wkvm_prefix_reuse_misses", "Requests computed from scratch", registry=r)
        self.reuse_tokens = Counter("wkvm_prefix_reuse_tokens", "Prompt tokens not recomputed thanks to reuse",
                                    registry=r)  # fmt: skip
        self.restarts = Counter("wkvm_session_restarts", "Chat sessions restarted, by reason", ["reason"], registry=r)
        self.stream = StreamCollector()
        r.register(self.stream)
        self.store_counts = StoreCollector()
        r.register(self.store_counts)
        self.drafts = DraftCollector()
        r.register(self.drafts)

    def count_request(self, route: str, status: int) -> None:
        self.requests.labels(route, str(status)).inc()

    def finished(self, reason: str, seconds: float, queued: float | None) -> None:
        """A choice's end: its reason, its time since the request arrived and (if it got a slot) its time waiting
        for one in the engine's queue."""
        self.finish_reasons.labels(reason).inc()
        self.e2e.observe(seconds)
        if queued is not None:
            self.queue_time.observe(queued)

    def reuse_hit(self, tokens: int) -> None:
        self.reuse_hits.inc()
        self.reuse_tokens.inc(tokens)

    def reuse_miss(self) -> None:
        self.reuse_misses.inc()

    def restart(self, reason: str) -> None:
        self.restarts.labels(reason).inc()

    def render(self, e: EngineStats, store: StateStore | None) -> bytes:
        self.stream.stats = e.weight_stream
        self.drafts.counts = (e.draft_tokens, e.accepted_tokens) if e.speculates else None
        self.queue_depth.set(e.waiting)
        self.running.set(e.running)
        self.slots_free.set(e.slots_free)
        self.slots_total.set(e.slots_total)
        self.kv_pages.set(e.kv_pages_total)
        self.kv_usage.set(e.kv_pages_used / e.kv_pages_total if e.kv_pages_total else 0.0)
        if store is not None:
            self.store_counts.not_kept = store.internal_not_kept
            for tier, (count, nbytes) in store.tier_stats().items():
                if count is not None:
                    self.states.labels(tier).set(count)
                self.state_bytes.labels(tier).set(nbytes)
        return generate_latest(self.registry)
