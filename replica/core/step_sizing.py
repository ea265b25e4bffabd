"""Steps sized to the tightest latency objective they serve (Sarathi-Serve's rule, learned live).

A step in progress cannot be cut; the next one can be sized. While requests with objectives
(GenerateRequest.objectives: x-slo-ttft-ms / x-slo-tpot-ms) are in the engine, each step's
prefill tokens are capped so that the step's predicted p90 time stays under

* the tightest TPOT objective among the rows it decodes (a decode row waits for the whole step),
* the time left to the nearest TTFT deadline of a request that has not had its first token
  (its arrival in the engine plus its objective), and
* half the tightest TTFT objective seen in the last `ANTICIPATE_S` seconds: a request that
  arrives while a step runs waits for that step, then needs one of its own.

The step's time comes from the engine's own steps: every step feeds the same linear step model
and split-conformal p90 the router learns from heartbeats (router/latency_model.py), here one
sample per step. Until that model has `MIN_SAMPLES` steps, or while it has no cost per prefill
token, nothing is capped. A cap never goes under `MIN_PREFILL_TOKENS`, so prefills always
progress, and a deadline already missed caps nothing (it cannot be met; the throughput of
everyone else can). A request whose deadline is near (`urgent`) gets the next step's first
prefill tokens among the requests of its priority.

Requests without objectives, alone in the engine, are scheduled exactly as without this module:
`prefill_cap` is None and `urgent` is None, and it costs one dict lookup a step.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from replica.core.sequence import Sequence, Status
from replica.core.step_timings import StepTotals
from router.latency_model import LatencyModels, StepFit

MIN_PREFILL_TOKENS = 32  # the smallest prefill a step is cut to: prefills always progress
ANTICIPATE_S = 10.0  # a TTFT objective seen this recently keeps steps under half of it
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
        self._recent_ttft: tuple[float, float] | None = None  # (tightest TTFT objective s, seen at)

    # ---- requests ---------------------------------------------------------------------------
    def track(self, seq: Sequence, now: float) -> None:
        if seq.ttft_s is None and seq.tpot_s is None:
            return
        self._tracked[id(seq)] = seq
        if seq.ttft_s is not None:
            recent = self._recent_ttft
            if recent is None or seq.ttft_s <= recent[0] or now - recent[1] > ANTICIPATE_S:
                self._recent_ttft = (seq.ttft_s, now)

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
        """The tightest step time the live objectives allow (None: no objective constrains it)."""
        limit = math.inf
        recent = self._recent_ttft
        if recent is not None:
            if now - recent[1] <= ANTICIPATE_S:
                limit = recent[0] / 2
            else:
                self._recent_ttft = None
        for seq in self._tracked.values():
            if seq.first_token_time is None:
                if seq.ttft_s is not None:
                    left = seq.arrival_time + seq.ttft_s - now
                    if left > 0:  # a missed deadline caps nothing
                        limit = min(limit, left)
            elif seq.tpot_s is not None:
                limit = min(limit, seq.tpot_s)
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
