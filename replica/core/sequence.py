"""One request's state as it moves through the scheduler."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import Any

from replica.kvcache.block_manager import BlockTable
from router.protocol.sampling import SamplingParams

_ids = itertools.count()


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    prompt_token_ids: list[int]
    params: SamplingParams
    hash_seed: int
    request_id: str = field(default_factory=lambda: f"req-{next(_ids)}")
    token_ids: list[int] = field(init=False)
    status: Status = Status.WAITING
    table: BlockTable = field(default_factory=BlockTable)
    num_computed: int = 0  # tokens whose K/V sits in the pool
    num_cached_tokens: int = -1  # prompt tokens served from cache at first admission
    finish_reason: str | None = None
    output_text: str = ""
    emitted_text_len: int = 0  # how much of output_text the caller has seen
    emitted_tokens: int = 0
    num_preemptions: int = 0
    arrival_time: float = 0.0
    first_token_time: float | None = None
    adapter: str | None = None  # the LoRA adapter it runs under (None: the base model)
    priority: int = 0  # vLLM's: lower is scheduled earlier (the gateway maps service tiers onto it)
    arrival_seq: int = 0  # its place in the scheduler's arrival order (set when queued)
    lora_slot: int = -1  # its adapter's batch slot while running (replica/core/adapter_slots.py)
    ttft_s: float | None = None  # its latency objectives (GenerateRequest.objectives), seconds
    tpot_s: float | None = None
    detok_state: Any = None  # the detokenizer's incremental state (replica.core.detokenizer.DetokState)

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        self.table.token_ids = self.token_ids  # the block manager compares tokens on a hash hit

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        """A copy: O(output length). Per step, use num_output_tokens or index token_ids."""
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED
