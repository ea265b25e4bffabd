"""Per-request timestamps the engine stamps, and the intervals vLLM reports from them.

Pure data (no Ray): the engine fills it, replica/serve/metrics.py turns it into vLLM's histograms.
The intervals follow vLLM's definitions: queue = arrival -> first scheduled; prefill = first
scheduled -> first token; decode = first token -> last token; e2e = arrival -> finished.
All times are time.monotonic() seconds.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finished_time: float
    num_prompt_tokens: int
    num_cached_tokens: int
    num_generation_tokens: int
    num_preemptions: int = 0

    @property
    def queue_time(self) -> float:
        return _span(self.arrival_time, self.first_scheduled_time or self.finished_time)

    @property
    def prefill_time(self) -> float:
        start = self.first_scheduled_time or self.finished_time
        return _span(start, self.first_token_time or self.finished_time)

    @property
    def decode_time(self) -> float:
        return _span(self.first_token_time or self.finished_time, self.finished_time)

    @property
    def inference_time(self) -> float:
        return _span(self.first_scheduled_time or self.finished_time, self.finished_time)

    @property
    def e2e_time(self) -> float:
        return _span(self.arrival_time, self.finished_time)

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else _span(self.arrival_time, self.first_token_time)

    @property
    def time_per_output_token(self) -> float | None:
        """Mean decode time per token after the first (vLLM's TPOT); None with under 2 tokens."""
        if self.num_generation_tokens < 2:
            return None
        return self.decode_time / (self.num_generation_tokens - 1)


def _span(start: float, end: float) -> float:
    return max(0.0, end - start)
