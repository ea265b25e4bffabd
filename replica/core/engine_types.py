"""The engine's torch-free vocabulary: outputs, stats and the refusal error (its configuration and
defaults: replica/engine_config.py).

Kept apart from replica/engine.py (which imports torch and transformers) so that light
processes (the gateway, the simulated-compute replica) can speak the engine's types without
loading either.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from replica.core.request_metrics import RequestMetrics
from replica.core.step_timings import StepTotals

if TYPE_CHECKING:
    from replica.core.sequence import Sequence
    from router.protocol.messages import GenerateRequest


class InvalidRequestError(ValueError):
    """A request the engine refuses at submission (nothing else in flight is touched)."""


class UnknownAdapterError(InvalidRequestError):
    """A request names a LoRA adapter this engine does not serve (a 404, as vLLM answers)."""


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    new_text: str
    token_ids: list[int]  # the whole output, on the finished output (empty before it)
    text: str  # the whole text so far (on the finished output: all of it)
    num_prompt_tokens: int
    num_cached_tokens: int
    finished: bool
    finish_reason: str | None = None  # "stop", "length", "abort"
    # per new token when the request asked for logprobs: {"token_id", "token", "bytes", "logprob", "top": [...]}
    logprobs: list[dict] | None = None
    metrics: RequestMetrics | None = None  # on the finished output: timestamps (replica/serve/metrics.py)


@dataclass
class EngineStats:
    running: int
    waiting: int
    prompt_tokens: int
    cached_tokens: int
    blocks_total: int
    blocks_used: int
    blocks_cached: int
    blocks_free: int
    evictions: int
    preemptions: int
    pending_prefill_tokens: int = 0
    steps: int = 0
    generated_tokens: int = 0
    tiers: dict[str, TierUsage] = field(default_factory=dict)  # per lower medium (host, disk)
    # LoRA (vLLM's lora_requests_info): adapters with running / waiting requests, the batch's limit
    lora_running: list[str] = field(default_factory=list)
    lora_waiting: list[str] = field(default_factory=list)
    max_loras: int = 0
    lora_resident: list[str] = field(default_factory=list)  # identities in host memory (no disk read to start)
    lora_load_s: float = 0.0  # measured: reading one adapter from disk (0: none read yet)
    # for the router's latency model (the Heartbeat's context_tokens, step_token_budget, step_*)
    context_tokens: int = 0  # tokens of the running requests
    # the work not started yet by priority: {priority: (requests waiting, prompt tokens not
    # computed)} (the Heartbeat's queued_by_priority; empty: the engine does not say)
    queued_by_priority: dict[int, tuple[int, int]] = field(default_factory=dict)
    step_token_budget: int = 0  # the most tokens one step schedules (0: unknown)
    step_totals: StepTotals = field(default_factory=StepTotals)


@dataclass
class TierUsage:
    """One tier below the pool: occupancy and traffic since start (the metrics and heartbeat)."""

    capacity_blocks: int
    blocks: int
    hit_tokens: int  # prompt tokens served from this tier (moved back instead of recomputed)
    promotions: int  # blocks moved from it back into the pool
    demotions: int  # blocks moved into it from the tier above
    dropped: int  # blocks that left it for no tier below
    written_behind: int = 0  # demotions whose copy was made ahead, during a forward pass (first tier)
    bytes_in: int = 0  # bytes copied into it
    bytes_out: int = 0  # bytes copied out of it
    promotion_bytes_per_s: int = 0  # measured rate of its copies back into the pool (0: none yet)


def request_output(seq: Sequence, text: str, scheduled_at: float | None, now: float) -> RequestOutput:
    """What a step tells a sequence's caller: the text and token ids new since the last output,
    the usage so far, and on the last output the request's timings. Shared by LLMEngine and
    SimEngine so both account identically (the fleet harness compares them)."""
    new_text = text[seq.emitted_text_len :]
    seq.emitted_text_len = len(text)
    # only the new tokens are copied: a copy of the whole output per step is O(n^2) per request
    new_ids = seq.token_ids[seq.num_prompt_tokens + seq.emitted_tokens :]
    seq.emitted_tokens = seq.num_output_tokens
    metrics = None
    if seq.is_finished:
        metrics = RequestMetrics(
            arrival_time=seq.arrival_time, first_scheduled_time=scheduled_at,
            first_token_time=seq.first_token_time, finished_time=now,
            num_prompt_tokens=seq.num_prompt_tokens, num_cached_tokens=max(seq.num_cached_tokens, 0),
            num_generation_tokens=seq.num_output_tokens, num_preemptions=seq.num_preemptions,
        )
    return RequestOutput(
        request_id=seq.request_id,
        new_token_ids=new_ids,
        new_text=new_text,
        token_ids=seq.output_token_ids if seq.is_finished else [],
        text=text,
        num_prompt_tokens=seq.num_prompt_tokens,
        num_cached_tokens=max(seq.num_cached_tokens, 0),
        finished=seq.is_finished,
        finish_reason=seq.finish_reason,
        metrics=metrics,
    )


def refuse_unfit(request: GenerateRequest, vocab_size: int, max_model_len: int, block_size: int,
                 num_blocks: int) -> None:
    """What every engine (ours, the sim, vLLM's backend) refuses before a request touches its
    scheduler: an empty or out-of-vocabulary prompt or continuation, more than the context, more
    blocks than the whole pool. The sampling parameters were checked where the request entered the
    process (SamplingParams, `checked_request`); the prompt ids' types are checked here, once."""
    token_ids, prefix, max_tokens = request.prompt_token_ids, request.prefix_output_token_ids, request.params.max_tokens
    if not token_ids:
        raise InvalidRequestError("prompt is empty")
    for name, ids in (("prompt token ids", token_ids), ("prefix_output_token_ids", prefix)):
        if any(type(t) is not int or not 0 <= t < vocab_size for t in ids):
            raise InvalidRequestError(f"{name} must be integers in [0, {vocab_size})")
    if prefix and len(prefix) >= max_tokens:
        raise InvalidRequestError("prefix_output_token_ids must be shorter than max_tokens")
    total = len(token_ids) + max_tokens
    if total > max_model_len:
        raise InvalidRequestError(
            f"prompt ({len(token_ids)} tokens) + max_tokens ({max_tokens}) = {total} exceeds the "
            f"model's context of {max_model_len} tokens"
        )
    needed = -(-total // block_size)
    if needed > num_blocks:
        raise InvalidRequestError(f"request needs {needed} blocks but the pool has {num_blocks}")
