"""Prometheus metrics of one server (its own registry, so several servers can live in one process)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class Metrics:
    def __init__(self, model_name: str):
        self.registry = r = CollectorRegistry()
        labels = {"model_name": model_name}

        def counter(name, doc, extra=()):
            return Counter(name, doc, list(labels) + list(extra), registry=r)

        def gauge(name, doc):
            return Gauge(name, doc, list(labels), registry=r).labels(**labels)

        def hist(name, doc, buckets=_LATENCY_BUCKETS):
            return Histogram(name, doc, list(labels), buckets=buckets, registry=r).labels(**labels)

        self._http = counter("radixlm_http_requests_total", "HTTP requests by route and status", ("route", "status"))
        self._finished = counter("radixlm_requests_finished_total", "Finished generation requests by reason",
                                 ("finish_reason",))
        self.prompt_tokens = counter("radixlm_prompt_tokens_total", "Prompt tokens of finished requests").labels(**labels)
        self.cached_tokens = counter("radixlm_cached_prompt_tokens_total",
                                     "Prompt tokens served from the radix cache").labels(**labels)
        self.generation_tokens = counter("radixlm_generation_tokens_total", "Generated tokens").labels(**labels)
        self.ttft = hist("radixlm_time_to_first_token_seconds", "Time to first token")
        self.itl = hist("radixlm_inter_token_latency_seconds", "Time between output tokens")
        self.e2e = hist("radixlm_e2e_request_latency_seconds", "End-to-end request latency")
        self.requests_in_flight = gauge("radixlm_requests_in_flight", "Requests the HTTP process is waiting on")
        self.num_running = gauge("radixlm_num_running_reqs", "Requests in the running batch")
        self.num_waiting = gauge("radixlm_num_waiting_reqs", "Requests in the waiting queue")
        self.kv_usage = gauge("radixlm_kv_cache_usage_ratio", "KV slots held by running requests / all slots")
        self.kv_cached = gauge("radixlm_kv_cache_cached_tokens", "KV slots held by the radix cache")
        self.hit_rate = gauge("radixlm_cache_hit_rate", "Cached prompt tokens / prompt tokens since start")
        self.gen_throughput = gauge("radixlm_gen_throughput_tokens_per_second",
                                    "Generated tokens per busy second of the scheduler")
        self._labels = labels

    def http(self, route: str, status: int) -> None:
        self._http.labels(route=route, status=str(status), **self._labels).inc()

    def on_finish(self, state, now: float) -> None:
        self._finished.labels(finish_reason=state.finish_reason.get("type", "unknown"), **self._labels).inc()
        self.prompt_tokens.inc(state.prompt_tokens)
        self.cached_tokens.inc(state.cached_tokens)
        self.e2e.observe(now - state.created)

    def set_scheduler_stats(self, stats: dict) -> None:
        self.num_running.set(stats["num_running"])
        self.num_waiting.set(stats["num_waiting"])
        self.kv_usage.set(stats["kv_used"] / max(stats["kv_total"], 1))
        self.kv_cached.set(stats["kv_cached"])
        self.hit_rate.set(stats["cache_hit_rate"])
        self.gen_throughput.set(stats["gen_throughput"])

    def render(self) -> bytes:
        return generate_latest(self.registry)
