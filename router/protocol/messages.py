"""What the gateway sends a replica and what streams back: shared by gateway, router, replica."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any, Literal, NotRequired, TypedDict


@dataclass
class KvSource:
    """A pull hint from the router (docs/kv-pull.md): another replica holds the prompt's leading
    blocks, so the replica taking the request copies their K/V from it instead of computing them.
    The receiver recomputes the hashes from the prompt itself; a failed pull means recompute."""

    replica_id: str  # the holder, as in the index (Serve's replica unique id)
    num_blocks: int  # leading full blocks of the prompt to pull from it


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
    kv_source: KvSource | None = None  # pull these leading blocks from another replica (router's hint)


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
