"""Replica metrics under vLLM's names, the way Ray Serve LLM exports vLLM's engine metrics.

vLLM's `vllm:num_requests_running` becomes the Ray metric `vllm_num_requests_running`, which
Ray exports as `ray_vllm_num_requests_running` (Ray forbids `:` and adds the `ray_` prefix),
tagged `model_name` and `engine` like vLLM's own, plus `WorkerId` (Ray) and `deployment`,
`replica`, `application` (Ray Serve). So Ray's Serve LLM Grafana dashboard and autoscalers keyed
to those names work on our replicas unchanged. Token counts are tokens, times are seconds,
as in vLLM. Created in the replica process (PrefixCacheReplica.__init__), never at import.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from replica.core.engine_types import EngineStats, RequestOutput, TierUsage
from replica.core.request_metrics import RequestMetrics
from router.protocol.media import LOWER_MEDIA
from router.telemetry import Metric

log = logging.getLogger("prefixgate.replica.metrics")

# vLLM's bucket choices for the same quantities (seconds)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                   120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


NO_TIER = TierUsage(capacity_blocks=0, blocks=0, hit_tokens=0, promotions=0, demotions=0, dropped=0)


def token_buckets(max_model_len: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to max_model_len (vLLM's scheme for token counts)."""
    out: list[float] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            v = m * scale
            if v > max_model_len:
                return tuple(out) if out else (1.0,)
            out.append(float(v))
        scale *= 10


class ReplicaMetrics:
    """Records one replica's per-request and periodic metrics."""

    def __init__(self, model_name: str, max_model_len: int, engine_index: str = "0") -> None:
        tags = {"model_name": model_name, "engine": engine_index}

        def metric(kind: str, name: str, doc: str, labels=(), buckets=None) -> Metric:
            return Metric(kind, name, doc, labels, buckets=buckets, default_tags=tags)

        tokens = token_buckets(max_model_len)
        self.running = metric("gauge", "vllm_num_requests_running", "Requests in the running batch")
        self.waiting = metric("gauge", "vllm_num_requests_waiting", "Requests waiting to be scheduled")
        self.swapped = metric("gauge", "vllm_num_requests_swapped", "Requests swapped to CPU (never: we preempt by recompute)")
        self.kv_usage = metric("gauge", "vllm_kv_cache_usage_perc", "Fraction of K/V blocks held by requests (1 = full)")
        self.cache_queries = metric("counter", "vllm_prefix_cache_queries", "Prompt tokens looked up in the prefix cache")
        self.cache_hits = metric("counter", "vllm_prefix_cache_hits", "Prompt tokens found in the prefix cache")
        self.preemptions = metric("counter", "vllm_num_preemptions", "Requests preempted (their blocks freed, recomputed later)")
        self.prompt_tokens = metric("counter", "vllm_prompt_tokens", "Prompt tokens of finished requests")
        self.generation_tokens = metric("counter", "vllm_generation_tokens", "Generated tokens")
        self.success = metric("counter", "vllm_request_success", "Finished requests by finish reason", ["finished_reason"])
        self.prompt_hist = metric("histogram", "vllm_request_prompt_tokens", "Prompt length of finished requests", buckets=tokens)
        self.generation_hist = metric("histogram", "vllm_request_generation_tokens", "Generated tokens per finished request", buckets=tokens)
        self.ttft = metric("histogram", "vllm_time_to_first_token_seconds", "Arrival at the replica to first token", buckets=TTFT_BUCKETS)
        self.itl = metric("histogram", "vllm_inter_token_latency_seconds", "Time between two successive output tokens", buckets=TPOT_BUCKETS)
        self.tpot = metric("histogram", "vllm_request_time_per_output_token_seconds",
                           "Per request: decode time / (generated tokens - 1)", buckets=TPOT_BUCKETS)
        self.e2e = metric("histogram", "vllm_e2e_request_latency_seconds", "Arrival at the replica to finish", buckets=REQUEST_BUCKETS)
        self.queue = metric("histogram", "vllm_request_queue_time_seconds", "Arrival to first scheduled", buckets=REQUEST_BUCKETS)
        self.prefill = metric("histogram", "vllm_request_prefill_time_seconds", "First scheduled to first token", buckets=REQUEST_BUCKETS)
        self.decode = metric("histogram", "vllm_request_decode_time_seconds", "First token to last token", buckets=REQUEST_BUCKETS)
        self.inference = metric("histogram", "vllm_request_inference_time_seconds", "First scheduled to finish", buckets=REQUEST_BUCKETS)
        # the K/V tiers below the pool, per medium
        self.tier_blocks = metric("gauge", "prefixgate_kv_tier_blocks", "Blocks held in a K/V tier below the pool", ["medium"])
        self.tier_capacity = metric("gauge", "prefixgate_kv_tier_capacity_blocks", "Capacity of a K/V tier below the pool", ["medium"])
        self.tier_hits = metric("counter", "prefixgate_kv_tier_hit_tokens", "Prompt tokens served from a lower tier (moved back, not recomputed)", ["medium"])
        self.tier_promotions = metric("counter", "prefixgate_kv_tier_promotions", "Blocks moved from a lower tier back into the pool", ["medium"])
        self.tier_demotions = metric("counter", "prefixgate_kv_tier_demotions", "Blocks moved down into a tier", ["medium"])
        self.tier_dropped = metric("counter", "prefixgate_kv_tier_dropped", "Blocks that left the last tier (their K/V is gone)", ["medium"])
        self.tier_bytes = metric("counter", "prefixgate_kv_tier_bytes", "K/V bytes copied into or out of a tier", ["medium", "direction"])
        # vLLM's: value = time of the reading; llm-d's LoRA-affinity scorer reads the labels
        self.lora_info = metric("gauge", "vllm_lora_requests_info", "Running and waiting LoRA adapters",
                                ["running_lora_adapters", "waiting_lora_adapters", "max_lora"])
        self._preemptions_seen = 0
        self._tier_seen: dict[tuple[str, str], int] = {}
        for counter in (self.cache_queries, self.cache_hits, self.preemptions, self.prompt_tokens, self.generation_tokens):
            counter.zero()
        for reason in ("stop", "length", "abort"):
            self.success.zero(reason)

    def request(self) -> RequestRecorder:
        return RequestRecorder(self)

    def counted(self, prompt_tokens: int, cached_tokens: int, generation_tokens: int, reason: str) -> None:
        """A finished request's counts (prefix cache queries and hits are in tokens, as vLLM's)."""
        self.success.labels(reason).inc()
        self.cache_queries.inc(prompt_tokens)
        self.cache_hits.inc(cached_tokens)
        self.prompt_tokens.inc(prompt_tokens)
        self.prompt_hist.observe(prompt_tokens)
        self.generation_hist.observe(generation_tokens)

    def finished(self, m: RequestMetrics, reason: str) -> None:
        self.counted(m.num_prompt_tokens, m.num_cached_tokens, m.num_generation_tokens, reason)
        if m.ttft is not None:
            self.ttft.observe(m.ttft)
        if m.time_per_output_token is not None:
            self.tpot.observe(m.time_per_output_token)
        self.e2e.observe(m.e2e_time)
        self.queue.observe(m.queue_time)
        self.prefill.observe(m.prefill_time)
        self.decode.observe(m.decode_time)
        self.inference.observe(m.inference_time)

    def gauges(self, s: EngineStats) -> None:
        if s.max_loras:
            self.lora_info.labels(",".join(s.lora_running), ",".join(s.lora_waiting), s.max_loras).set(time.time())
        self.running.set(s.running)
        self.waiting.set(s.waiting)
        self.swapped.set(0)
        self.kv_usage.set(s.blocks_used / s.blocks_total if s.blocks_total else 0.0)
        if s.preemptions > self._preemptions_seen:
            self.preemptions.inc(s.preemptions - self._preemptions_seen)
            self._preemptions_seen = s.preemptions
        for medium in LOWER_MEDIA:  # every medium from start-up: a tier not configured reads 0, not "no data"
            t = s.tiers.get(medium, NO_TIER)
            if (medium, "hits") not in self._tier_seen:  # first sight: every series exists from 0 on
                for counter in (self.tier_hits, self.tier_promotions, self.tier_demotions, self.tier_dropped):
                    counter.zero(medium)
                self.tier_bytes.zero(medium, "in")
                self.tier_bytes.zero(medium, "out")
                self._tier_seen[(medium, "hits")] = 0
            self.tier_blocks.labels(medium).set(t.blocks)
            self.tier_capacity.labels(medium).set(t.capacity_blocks)
            for counter, key, total in (
                (self.tier_hits.labels(medium), "hits", t.hit_tokens),
                (self.tier_promotions.labels(medium), "promotions", t.promotions),
                (self.tier_demotions.labels(medium), "demotions", t.demotions),
                (self.tier_dropped.labels(medium), "dropped", t.dropped),
                (self.tier_bytes.labels(medium, "in"), "in", t.bytes_in),
                (self.tier_bytes.labels(medium, "out"), "out", t.bytes_out),
            ):
                seen = self._tier_seen.get((medium, key), 0)  # the engine counts totals; Ray counters take increments
                if total > seen:
                    counter.inc(total - seen)
                    self._tier_seen[(medium, key)] = total

    async def run_gauges(self, stats: Callable[[], EngineStats], interval_s: float = 1.0) -> None:
        """Refresh the gauges until cancelled (the replica's lifetime); Ray exports the last value."""
        while True:
            try:
                self.gauges(stats())
            except Exception:
                log.exception("gauge refresh failed")
            await asyncio.sleep(interval_s)


class RequestRecorder:
    """One request's stream as the replica sends it: token gaps, then the finish (or abort)."""

    def __init__(self, metrics: ReplicaMetrics) -> None:
        self.metrics = metrics
        self.last_token: float | None = None
        self.done = False

    def output(self, out: RequestOutput) -> None:
        n = len(out.new_token_ids)
        if n:
            now = time.monotonic()
            self.metrics.generation_tokens.inc(n)
            if self.last_token is not None:
                self.metrics.itl.observe((now - self.last_token) / n)
            self.last_token = now
        if out.finished and not self.done:
            self.done = True
            if out.metrics is not None:
                self.metrics.finished(out.metrics, out.finish_reason or "stop")
            else:  # an engine without timestamps: the counts still hold
                self.metrics.counted(out.num_prompt_tokens, out.num_cached_tokens, len(out.token_ids),
                                     out.finish_reason or "stop")

    def close(self) -> None:
        """The stream ended without a finished output (client gone, error): vLLM's "abort"."""
        if not self.done:
            self.done = True
            self.metrics.success.labels("abort").inc()
