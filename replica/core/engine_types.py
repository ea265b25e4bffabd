"""The engine's torch-free vocabulary: configuration, outputs, stats and the refusal error.

Kept apart from replica/engine.py (which imports torch and transformers) so that light
processes (the gateway, the simulated-compute replica) can speak the engine's types without
loading either.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from replica.core.request_metrics import RequestMetrics

if TYPE_CHECKING:
    from replica.core.sequence import Sequence
    from replica.kvcache.block_manager import BlockManager
    from router.protocol.sampling import SamplingParams


# The engine's defaults, defined here once: EngineConfig, the scheduler, the sim engine and the
# gateway's AppConfig (the served defaults) all read these.
BLOCK_SIZE = 16  # tokens per K/V block (vLLM replicas need a multiple of 32: replica/backends/vllm_settings.py)
KV_CACHE_MB = 512  # K/V pool per replica when num_blocks is not given
MAX_NUM_SEQS = 64  # sequences running at once
MAX_NUM_BATCHED_TOKENS = 512  # tokens per step: the prefill chunk, decodes included


class InvalidRequestError(ValueError):
    """A request the engine refuses at submission (nothing else in flight is touched)."""


@dataclass
class EngineConfig:
    model: str | None = None  # local HF model directory; None: the bundled default
    model_id: str | None = None  # identity in block hashes; defaults to the directory name
    block_size: int = BLOCK_SIZE
    num_blocks: int | None = None  # None: derived from kv_cache_bytes
    kv_cache_bytes: int = KV_CACHE_MB * 2**20
    device: str = "cpu"
    dtype: str | None = None  # "float32", "bfloat16", ...; None: float32 on CPU, bf16 on GPU
    max_num_seqs: int = MAX_NUM_SEQS
    max_num_batched_tokens: int = MAX_NUM_BATCHED_TOKENS
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    compile: bool = False  # torch.compile the forward at start (replica/model/compiled_step.py; cached across restarts)
    # K/V tiers below the pool (replica/kvcache/kv_tiers.py): what the pool evicts moves to host memory,
    # then to a bounded local file, and is moved back on a prefix hit instead of recomputed
    kv_host_bytes: int = 0  # 0: no host tier
    kv_disk_bytes: int = 0  # 0: no disk tier
    kv_disk_dir: str | None = None  # where the disk tier's file lives (None: the temp directory)


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    new_text: str
    token_ids: list[int]
    text: str
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


def request_output(seq: Sequence, text: str, scheduled_at: float | None) -> RequestOutput:
    """What a step tells a sequence's caller: the text and token ids new since the last output,
    the usage so far, and on the last output the request's timings. Shared by LLMEngine and
    SimEngine so both account identically (the fleet harness compares them)."""
    new_text = text[seq.emitted_text_len :]
    seq.emitted_text_len = len(text)
    out_ids = seq.output_token_ids
    new_ids = out_ids[seq.emitted_tokens :]
    seq.emitted_tokens = len(out_ids)
    metrics = None
    if seq.is_finished:
        metrics = RequestMetrics(
            arrival_time=seq.arrival_time, first_scheduled_time=scheduled_at,
            first_token_time=seq.first_token_time, finished_time=time.monotonic(),
            num_prompt_tokens=seq.num_prompt_tokens, num_cached_tokens=max(seq.num_cached_tokens, 0),
            num_generation_tokens=len(out_ids), num_preemptions=seq.num_preemptions,
        )
    return RequestOutput(
        request_id=seq.request_id,
        new_token_ids=new_ids,
        new_text=new_text,
        token_ids=list(out_ids),
        text=text,
        num_prompt_tokens=seq.num_prompt_tokens,
        num_cached_tokens=max(seq.num_cached_tokens, 0),
        finished=seq.is_finished,
        finish_reason=seq.finish_reason,
        metrics=metrics,
    )


def validate_request(token_ids: list[int], params: SamplingParams, vocab_size: int, max_model_len: int,
                     blocks: BlockManager) -> None:
    """What both engines refuse before a request touches the scheduler: bad parameters, an empty
    or out-of-vocabulary prompt, more than the context, more blocks than the whole pool."""
    try:
        params.validate()
    except ValueError as e:
        raise InvalidRequestError(str(e)) from None
    if not token_ids:
        raise InvalidRequestError("prompt is empty")
    if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size for t in token_ids):
        raise InvalidRequestError(f"prompt token ids must be integers in [0, {vocab_size})")
    total = len(token_ids) + params.max_tokens
    if total > max_model_len:
        raise InvalidRequestError(
            f"prompt ({len(token_ids)} tokens) + max_tokens ({params.max_tokens}) = {total} exceeds the "
            f"model's context of {max_model_len} tokens"
        )
    if blocks.blocks_needed(total) > blocks.num_blocks:
        raise InvalidRequestError(f"request needs {blocks.blocks_needed(total)} blocks but the pool has {blocks.num_blocks}")
