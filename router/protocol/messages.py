"""What the gateway sends a replica and what streams back: shared by gateway, router, replica."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any, Literal, NotRequired, TypedDict


@dataclass
class GenerateRequest:
    prompt_token_ids: list[int]
    params: dict[str, Any]  # SamplingParams fields
    prompt: str = ""  # rendered prompt text: read only by Ray's PrefixCacheAffinityRouter baseline
    session_id: str | None = None
    cache_salt: str | None = None  # tenant salt: tenants never share cached blocks
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    route: dict[str, Any] | None = None  # set by our router: {"reason", "replica", "matched_blocks"}
    # a migrated stream: output another replica generated and the client already got (token
    # ids, and how many characters of their text were sent); the replica continues after them
    prefix_output_token_ids: list[int] = field(default_factory=list)
    prefix_text_len: int = 0


# What a replica streams back, one chunk at a time: plain dicts at runtime (cheap to pickle
# across Ray), typed here so that gateway and replica share one definition.
class StartChunk(TypedDict):
    type: Literal["start"]
    replica: str
    route: dict[str, Any] | None


class DeltaChunk(TypedDict):
    type: Literal["delta"]
    token_ids: list[int]
    text: str
    # when the request asked for logprobs, one entry per token in token_ids:
    # {"token_id", "token", "bytes", "logprob", "top": [{"token_id", "token", "bytes", "logprob"}]}
    logprobs: NotRequired[list[dict[str, Any]]]


class EndChunk(TypedDict):
    type: Literal["end"]
    finish_reason: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int


class ErrorChunk(TypedDict, total=False):
    type: Literal["error"]
    code: int  # HTTP status the gateway answers with: 400 bad request, 503 replica failed
    message: str
    retry: bool  # the request may continue on another replica (this one is draining or failed)


Chunk = StartChunk | DeltaChunk | EndChunk | ErrorChunk
