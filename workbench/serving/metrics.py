"""``/metrics`` in Prometheus' text format: requests by route and outcome, prompt and generated
tokens, requests in flight, the engine's queue and KV blocks (from the ranks' telemetry),
speculative decoding's drafted and accepted tokens and their ratio, and time to first token and
per output token as histograms. A registry of its own per endpoint, so
two endpoints in one kernel never mix their counts."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class Metrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("workbench_requests", "HTTP requests by route and status",
                                ["route", "status"], registry=r)
        self.prompt_tokens = Counter("workbench_prompt_tokens", "prompt tokens of finished "
                                     "requests", registry=r)
        self.generation_tokens = Counter("workbench_generation_tokens", "tokens generated",
                                         registry=r)
        self.in_flight = Gauge("workbench_requests_in_flight", "requests sent to the ranks "
                               "and not finished", registry=r)
        self.running = Gauge("workbench_engine_running", "requests running in the engines",
                             registry=r)
        self.waiting = Gauge("workbench_engine_waiting", "requests waiting in the engines",
                             registry=r)
        self.kv_used = Gauge("workbench_kv_blocks_used", "KV cache blocks in use", registry=r)
        self.kv_total = Gauge("workbench_kv_blocks_total", "KV cache blocks", registry=r)
        # the engines' cumulative counts (since each was built), turned into counters
        self.spec_drafted = Counter("workbench_spec_draft_tokens", "speculative draft tokens "
                                    "verified by the engines", registry=r)
        self.spec_accepted = Counter("workbench_spec_accepted_tokens", "speculative draft "
                                     "tokens the engines accepted", registry=r)
        self.spec_acceptance = Gauge("workbench_spec_acceptance_rate", "accepted / drafted "
                                     "tokens over the engines' lives (0 before any draft)",
                                     registry=r)
        self._spec_seen: dict[Any, tuple[int, int]] = {}  # replica: (drafted, accepted) counted
        self.ttft = Histogram("workbench_time_to_first_token_seconds", "time to first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("workbench_time_per_output_token_seconds",
                              "mean time between output tokens of a request",
                              buckets=LATENCY_BUCKETS, registry=r)

    def finished(self, delta: dict[str, Any]) -> None:
        """A request's last delta (its counts and timings)."""
        self.prompt_tokens.inc(delta.get("prompt_tokens") or 0)
        n = delta.get("completion_tokens") or 0
        first, done = delta.get("first_token_s"), delta.get("finished_s")
        if first is not None:
            self.ttft.observe(first)
            if done is not None and n > 1:
                self.tpot.observe((done - first) / (n - 1))

    def engines(self, blocks: list[dict[str, Any]]) -> None:
        """The replicas' latest ``inference`` telemetry blocks (one per replica)."""
        self.running.set(sum(b.get("running", 0) for b in blocks))
        self.waiting.set(sum(b.get("waiting", 0) for b in blocks))
        self.kv_used.set(sum(b.get("blocks_used", 0) for b in blocks))
        self.kv_total.set(sum(b.get("blocks_total", 0) for b in blocks))
        drafted = accepted = 0
        for b in blocks:
            d, a = int(b.get("spec_drafted_tokens") or 0), int(b.get("spec_accepted_tokens") or 0)
            seen_d, seen_a = self._spec_seen.get(b.get("replica"), (0, 0))
            if d < seen_d or a < seen_a:  # a new engine: its counts start again
                seen_d = seen_a = 0
            self.spec_drafted.inc(d - seen_d)
            self.spec_accepted.inc(a - seen_a)
            self._spec_seen[b.get("replica")] = (d, a)
            drafted, accepted = drafted + d, accepted + a
        self.spec_acceptance.set(accepted / drafted if drafted else 0.0)

    def text(self) -> bytes:
        return generate_latest(self.registry)
