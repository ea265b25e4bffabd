"""What the gateway sends a replica and what streams back: shared by gateway, router, replica."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any


@dataclass
class GenerateRequest:
    prompt_token_ids: list[int]
    params: dict[str, Any]  # SamplingParams fields
    prompt: str = ""  # rendered prompt text: read only by Ray's PrefixCacheAffinityRouter baseline
    session_id: str | None = None
    cache_salt: str | None = None  # tenant salt: tenants never share cached blocks
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    route: dict[str, Any] | None = None  # set by our router: {"reason", "replica", "matched_blocks"}


# Chunks are plain dicts (cheap to pickle across Ray):
#   {"type": "start", "replica": id, "route": {...} | None}
#   {"type": "delta", "token_ids": [...], "text": str}
#   {"type": "end", "finish_reason": str, "prompt_tokens": n, "cached_tokens": n, "completion_tokens": n}
#   {"type": "error", "code": 400 | 500 | 503, "message": str}
