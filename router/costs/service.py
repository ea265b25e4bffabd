"""Service-time model: how long prefill and decode take on one replica.

Continuous batching with chunked prefill: every engine step runs the decode batch (one token per
running sequence) plus up to `chunk_tokens` prompt tokens. So
  step time          = decode_step_s + decode_s_per_seq * batch (+ the prefill chunk, if any)
  prefill time       = overhead + uncached_tokens * (prefill_s_per_token + decode step / chunk)
  decode time        = output_tokens * (decode_step_s + decode_s_per_seq * batch)
Prefills run one at a time in arrival order (the head of the queue gets the chunk budget);
the batch size is sampled when a phase starts, not integrated over it. Only uncached tokens
cost prefill time, which is how a cache hit shortens time to first token and frees capacity.

The live sim replica (replica/backends/sim_engine.py) charges each real scheduler step with
`engine_step_s`, the same constants per token and per step, so one definition serves both;
`scaled(k)` runs the same model k times faster in wall time (trace replay under --time-scale).

Defaults model a large model on one multi-GPU node: ~7k uncached prompt tokens/s and
~35 tokens/s per sequence at a batch of 10. With them the Mooncake trace at its real rate puts
8 replicas at 60-75% prefill utilization under cache-blind routing (see docs/simulator.md).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from router.costs.transfer_model import GPU_PREFILL_S_PER_TOKEN


@dataclass(frozen=True)
class ServiceModel:
    prefill_s_per_token: float = GPU_PREFILL_S_PER_TOKEN
    prefill_overhead_s: float = 0.02
    decode_step_s: float = 0.025
    decode_s_per_seq: float = 0.0005
    chunk_tokens: int = 2048
    max_running: int = 64  # sequences admitted at once (prefilling + decoding)

    def step_s(self, batch: int) -> float:
        return self.decode_step_s + self.decode_s_per_seq * batch

    def prefill_s(self, uncached_tokens: int, batch: int) -> float:
        per_token = self.prefill_s_per_token
        if batch:
            per_token += self.step_s(batch) / self.chunk_tokens
        return self.prefill_overhead_s + uncached_tokens * per_token

    def decode_s(self, output_tokens: int, batch: int) -> float:
        return output_tokens * self.step_s(batch)

    def engine_step_s(self, decode_seqs: int, prefill_tokens: int, prefills_started: int = 0) -> float:
        """One scheduler step of a live replica: the decode batch (if any) plus the prefill
        tokens in the step, plus the fixed overhead of each prefill that starts in it. Summed
        over a prefill's chunks this gives `prefill_s` for that prefill."""
        t = prefill_tokens * self.prefill_s_per_token + prefills_started * self.prefill_overhead_s
        if decode_seqs:
            t += self.step_s(decode_seqs)
        return t

    def scaled(self, time_scale: float) -> ServiceModel:
        """The same model running `time_scale` times faster (every duration divided by it)."""
        if time_scale <= 0:
            raise ValueError(f"time_scale must be positive, got {time_scale!r}")
        times = {f.name: getattr(self, f.name) / time_scale for f in fields(self) if f.name.endswith("_s") or "_s_" in f.name}
        return replace(self, **times)
