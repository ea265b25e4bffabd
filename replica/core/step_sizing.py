"""Steps sized to the TPOT objectives of the rows they decode, and urgent deadlines first.

A step in progress cannot be cut; the next one can be sized. While a row with a TPOT objective
(GenerateRequest.objectives: x-slo-tpot-ms) decodes, each step's prefill tokens are capped so
that the step's predicted p90 time keeps that row's mean time per output token within its
objective: the step may take what the row has banked, `tpot x (intervals after this step) -
(time since its first token)`, and at least `tpot` (a row already behind is not made to catch up
by starving prefills; it does not fall further behind). The objective is on the request's mean
(gateway/slo_watch.py measures TPOT as (last - first) / (tokens - 1)), so a step may run long
where the rows beside it are ahead (Sarathi-Serve sizes every chunk to the tail instead).

A waiting request with a TTFT objective whose deadline (its arrival in the engine plus the
objective) is within URGENT_STEPS p90 full steps is urgent: it goes first among its priority,
and running prefills of its priority yield the step to it, so that step is the decodes and its
prefill: the shortest step that serves it. TTFT objectives do not cap steps: a cap sized to a
deadline, or to requests that might arrive, cut the prefill throughput every queued request
needs (`prefixgate bench goodput`: attainment fell from 69% to 34% at the same rate).

The step's time comes from the engine's own steps: every step feeds the same linear step model
and split-conformal p90 that the router learns from heartbeats (router/latency_model.py), here
one sample per step. Until that model has MIN_SAMPLES steps, or while it has no cost per prefill
token, nothing is capped. A cap never goes under MIN_PREFILL_TOKENS, so prefills progress.

Requests without objectives, alone in the engine, are scheduled exactly as without this module:
`prefill_cap` and `urgent` are None, at the cost of an empty dict's check per step.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from replica.core.sequence import Sequence, Status
from replica.core.step_timings import StepTotals
from router.latency_model import LatencyModels, StepFit

MIN_PREFILL_TOKENS = 32  # the smallest prefill a capped step carries: prefills always progress
URGENT_STEPS = 2.0  # a request with this many p90 full steps (or fewer) left to its deadline is urgent
_ENGINE = "engine"  # the one replica the engine's LatencyModels watches: itself


class StepSizer:
    """The engine's step-time model and the live requests with objectives. The engine core calls
    `track`/`untrack` as requests come and go and `learn` after each step; its scheduler asks
    `prefill_cap` and `urgent` before each step."""

    def __init__(self, budget: int) -> None:
        self.budget = budget  # the step's token budget (max_num_batched_tokens)
        self.models = LatencyModels()
        self._tracked: dict[int, Sequence] = {}  # id(seq) -> seq, for requests with objectives

    # ---- requests ---------------------------------------------------------------------------
    def track(self, seq: Sequence) -> None:
        if seq.ttft_s is not None or seq.tpot_s is not None:
            self._tracked[id(seq)] = seq

    def untrack(self, seq: Sequence) -> None:
        self._tracked.pop(id(seq), None)

    # ---- the model ----------------------------------------------------------------------------
    def learn(self, totals: StepTotals, now: float) -> None:
        """One step done: a sample of the step model; refitted every REFIT_S."""
        self.models.observe({_ENGINE: {"step_count": totals.count, "step_us": totals.us,
                                       "step_prefill_tokens": totals.prefill_tokens, "step_rows": totals.rows,
                                       "step_context_tokens": totals.context_tokens,
                                       "step_started": totals.started, "step_token_budget": self.budget}}, now)
        self.models.refit(now, limit=1)

    @property
    def fit(self) -> StepFit | None:
        return self.models.fit(_ENGINE)

    # ---- sizing ---------------------------------------------------------------------------------
    def prefill_cap(self, running: Iterable[Sequence], now: float) -> int | None:
        """The most prefill tokens the next step may carry (None: no cap). `running`: the rows the
        step decodes or continues (the scheduler's running list)."""
        limit = self._limit_s(now)
        if limit is None:
            return None
        fit = self.fit
        if fit is None or fit.coef[1] <= 0:
            return None
        rows = context = 0
        for seq in running:
            if seq.num_computed >= seq.num_prompt_tokens:
                rows += 1
                context += seq.num_tokens
        spare = limit - fit.step_s(0, rows, context, 0) - fit.q
        tokens = math.floor(spare / fit.coef[1]) if spare > 0 else 0
        return max(min(tokens, self.budget), MIN_PREFILL_TOKENS)

    def _limit_s(self, now: float) -> float | None:
        """The longest next step that keeps every decoding row with a TPOT objective within it on
        average (None: no such row)."""
        limit = math.inf
        for seq in self._tracked.values():
            if seq.tpot_s is None or seq.first_token_time is None or seq.status is not Status.RUNNING:
                continue
            intervals = seq.num_output_tokens  # after this step: one more token than the first
            banked = seq.tpot_s * intervals - (now - seq.first_token_time)
            limit = min(limit, max(banked, seq.tpot_s))
        return None if limit == math.inf else limit

    def urgent(self, now: float) -> Sequence | None:
        """The waiting request with a TTFT objective whose deadline is nearest, if it is within
        URGENT_STEPS p90 full steps (and not missed yet): it goes first among its priority."""
        if not self._tracked:
            return None
        fit = self.fit
        if fit is None:
            return None
        window = URGENT_STEPS * (fit.step_s(self.budget, 0, 0, 1) + fit.q)
        best, best_left = None, math.inf
        for seq in self._tracked.values():
            if seq.ttft_s is None or seq.first_token_time is not None or seq.status is not Status.WAITING:
                continue
            left = seq.arrival_time + seq.ttft_s - now
            if 0 < left <= window and left < best_left:
                best, best_left = seq, left
        return best
