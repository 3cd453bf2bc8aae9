"""Prometheus metrics of one server (its own registry, so several servers can live in one process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from radixlm.srt.constrained.manager import COMPILE_BUCKETS

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
        self._finished = counter(
            "radixlm_requests_finished_total", "Finished generation requests by reason", ("finish_reason",)
        )
        self.prompt_tokens = counter("radixlm_prompt_tokens_total", "Prompt tokens of finished requests").labels(
            **labels
        )
        self.cached_tokens = counter(
            "radixlm_cached_prompt_tokens_total", "Prompt tokens served from the radix cache"
        ).labels(**labels)
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
        self.gen_throughput = gauge(
            "radixlm_gen_throughput_tokens_per_second", "Generated tokens per busy second of the scheduler"
        )
        self.spec_accept_rate = gauge(
            "radixlm_spec_accept_rate", "Speculative decoding: accepted / drafted tokens since start"
        )
        self.spec_accept_length = gauge(
            "radixlm_spec_accept_length",
            "Speculative decoding: tokens a drafting request gains per verify step (accepted drafts + 1)",
        )
        self.spec_draft_tokens = gauge("radixlm_spec_draft_tokens", "Speculative decoding: draft tokens since start")
        self.spec_accepted_tokens = gauge(
            "radixlm_spec_accepted_tokens", "Speculative decoding: draft tokens accepted since start"
        )
        self._labels = labels
        self._grammar: dict = {}
        self._ranks: list[dict] = []
        r.register(_GrammarCollector(self))
        r.register(_RankCollector(self))

    def http(self, route: str, status: int) -> None:
        self._http.labels(route=route, status=str(status), **self._labels).inc()

    def on_finish(self, state, now: float) -> None:
        self._finished.labels(finish_reason=state.finish_reason.type, **self._labels).inc()
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
        self._grammar = stats.get("grammar") or {}
        self._ranks = stats.get("tp_ranks") or []
        if stats.get("speculative"):
            self.spec_accept_rate.set(stats["spec_accept_rate"])
            self.spec_accept_length.set(stats["spec_accept_length"])
            self.spec_draft_tokens.set(stats["spec_draft_tokens"])
            self.spec_accepted_tokens.set(stats["spec_accepted_tokens"])

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _GrammarCollector:
    """The scheduler's grammar counters as they were at the last stats pull: its compile-time histogram is
    kept as bucket counts in the scheduler process, so it is exported as-is rather than re-observed here."""

    def __init__(self, metrics: Metrics):
        self.m = metrics

    def collect(self):
        g, labels = self.m._grammar, self.m._labels
        names, values = list(labels), list(labels.values())

        def family(cls, name, doc, value):
            f = cls(name, doc, labels=names)
            f.add_metric(values, value)
            return f

        yield family(
            CounterMetricFamily, "radixlm_grammar_compiles", "Grammar compilations (cache misses)", g.get("compiles", 0)
        )
        yield family(
            CounterMetricFamily,
            "radixlm_grammar_cache_hits",
            "Grammar requests served from the cache",
            g.get("cache_hits", 0),
        )
        yield family(
            CounterMetricFamily,
            "radixlm_grammar_promotions",
            "Grammars whose later requests moved to a backend with cheaper masks (--grammar-backend auto)",
            g.get("promotions", 0),
        )
        yield family(
            CounterMetricFamily, "radixlm_grammar_failures", "Grammar compilations that failed", g.get("failures", 0)
        )
        yield family(
            CounterMetricFamily,
            "radixlm_grammar_timeouts",
            "Requests whose grammar outran --grammar-compile-timeout",
            g.get("timeouts", 0),
        )
        yield family(
            GaugeMetricFamily, "radixlm_grammar_waiting_reqs", "Requests waiting for their grammar", g.get("waiting", 0)
        )
        yield family(
            CounterMetricFamily,
            "radixlm_jump_forward_tokens",
            "Tokens appended by jump-forward",
            g.get("jump_forward_tokens", 0),
        )
        counts = g.get("compile_buckets") or [0] * len(COMPILE_BUCKETS)
        h = HistogramMetricFamily("radixlm_grammar_compile_seconds", "Grammar compile time", labels=names)
        bounds = ["+Inf" if b == float("inf") else str(b) for b in COMPILE_BUCKETS]
        h.add_metric(values, list(zip(bounds, counts)), g.get("compile_seconds_sum", 0.0))
        yield h


class _RankCollector:
    """Each tensor-parallel rank's memory (one series per rank, labelled with its host and device), as the
    scheduler reported it at the last stats pull."""

    def __init__(self, metrics: Metrics):
        self.m = metrics

    def collect(self):
        names = [*self.m._labels, "rank", "host", "device"]
        used = GaugeMetricFamily("radixlm_tp_rank_memory_used_bytes", "Memory a rank holds (GPU: in use on its "
                                 "device; CPU: resident)", labels=names)  # fmt: skip
        total = GaugeMetricFamily("radixlm_tp_rank_memory_total_bytes", "Memory of a rank's device (or host)",
                                  labels=names)  # fmt: skip
        for r in self.m._ranks:
            values = [*self.m._labels.values(), str(r["rank"]), r["host"], r["device"]]
            used.add_metric(values, r["memory_used_bytes"])
            total.add_metric(values, r["memory_total_bytes"])
        yield used
        yield total
