"""Each engine's steps, summed for the heartbeat: what the router's latency model learns from
(router/latency_model.py; the Heartbeat's step_* fields). Cumulative totals, not samples: a
router reading two heartbeats gets the mean step of the interval between them, whatever it
missed in between, and a heartbeat stays a few integers. Torch-free (ours, the sim, vLLM's)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StepTotals:
    """Steps since the engine started: their count, wall time (us) and what they computed."""

    count: int = 0
    us: int = 0
    prefill_tokens: int = 0
    rows: int = 0  # decode rows (one output token each)
    context_tokens: int = 0  # tokens of K/V the step's rows attend over, summed over its rows
    started: int = 0  # requests whose first chunk ran in the step (a per-request cost, vLLM's and the sim's)

    def record(self, seconds: float, prefill_tokens: int, rows: int, context_tokens: int, started: int) -> None:
        self.count += 1
        self.us += round(seconds * 1e6)
        self.prefill_tokens += prefill_tokens
        self.rows += rows
        self.context_tokens += context_tokens
        self.started += started

    def heartbeat(self) -> dict[str, int]:
        """The Heartbeat's step_* fields."""
        return {"step_count": self.count, "step_us": self.us, "step_prefill_tokens": self.prefill_tokens,
                "step_rows": self.rows, "step_context_tokens": self.context_tokens, "step_started": self.started}


def chunk_shape(chunks) -> tuple[int, int, int]:
    """(prefill tokens, decode rows, context tokens) of one step of our engine's scheduler
    (ScheduledChunk: seq, start, end): a row of one token past its prompt decodes."""
    prefill = rows = context = 0
    for c in chunks:
        n = c.end - c.start
        if n == 1 and c.start >= c.seq.num_prompt_tokens:
            rows += 1
        else:
            prefill += n
        context += c.end
    return prefill, rows, context
