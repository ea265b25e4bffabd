"""Per-request generation settings: part of the gateway -> replica contract.

One typed struct with its limits defined here once (the gateway's schema reads them too). It is
validated when it is built (`__post_init__`): by the gateway, once per request (a bad value is a
400 naming the field before anything reaches a replica), and where the request enters a replica
process (router/protocol/messages.py `checked_request`, which rebuilds it). The engines read it
as is and never re-check it.
"""

from __future__ import annotations

import math
from typing import Any

import msgspec

MAX_LOGPROBS = 20  # top alternatives per token, as OpenAI's top_logprobs and vLLM's default cap
MAX_LOGIT_BIAS = 1024  # token ids one request may bias (OpenAI's range per bias: [-100, 100])
MAX_STOP = 4  # stop strings per request, as OpenAI's API


class InvalidParam(ValueError):
    """A sampling field out of its range; `param` names it (the 400's `param`)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class SamplingParams(msgspec.Struct, kw_only=True):
    max_tokens: int = 64
    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means no top-k cut
    seed: int | None = None
    stop: list[str] = msgspec.field(default_factory=list)
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0  # vLLM's: no end-of-sequence, stop token or stop string before this many tokens
    # OpenAI semantics, over the generated tokens only: logit -= f * count + p * (count > 0)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # vLLM/HF semantics, over prompt and generated tokens: positive logits / r, negative * r
    repetition_penalty: float = 1.0
    logprobs: int | None = None  # None: none; k: the chosen token's logprob and the k most likely
    # {"type": "json_object"} or {"type": "json_schema", "schema": {...}}: constrained decoding
    response_format: dict[str, Any] | None = None
    # OpenAI's: token id -> a number in [-100, 100] added to its logit before sampling
    logit_bias: dict[int, float] = msgspec.field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if self.logit_bias is None:
            self.logit_bias = {}
        self.validate()

    def validate(self) -> None:
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise InvalidParam("max_tokens", f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not (0.0 <= float(self.temperature) <= 100.0):
            raise InvalidParam("temperature", f"temperature must be in [0, 100], got {self.temperature!r}")
        if not (0.0 < float(self.top_p) <= 1.0):
            raise InvalidParam("top_p", f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidParam("top_k", f"top_k must be an integer >= 0, got {self.top_k!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed < 2**63):
            raise InvalidParam("seed", f"seed must be an integer in [0, 2**63), got {self.seed!r}")
        if len(self.stop) > MAX_STOP or any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidParam("stop", f"stop must be at most {MAX_STOP} non-empty strings")
        if not isinstance(self.min_tokens, int) or isinstance(self.min_tokens, bool) or not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidParam("min_tokens", f"min_tokens must be an integer in [0, max_tokens], got {self.min_tokens!r}")
        if not isinstance(self.ignore_eos, bool):
            raise InvalidParam("ignore_eos", f"ignore_eos must be a boolean, got {self.ignore_eos!r}")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise InvalidParam("stop_token_ids", "stop_token_ids must be non-negative integers")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _real(value) or not -2.0 <= value <= 2.0:
                raise InvalidParam(name, f"{name} must be a number in [-2, 2], got {value!r}")
        if not _real(self.repetition_penalty) or not 0.0 < self.repetition_penalty <= 10.0:
            raise InvalidParam("repetition_penalty", f"repetition_penalty must be in (0, 10], got {self.repetition_penalty!r}")
        if self.logprobs is not None and (
            not isinstance(self.logprobs, int) or isinstance(self.logprobs, bool)
            or not 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            raise InvalidParam("logprobs", f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS or any(
            not isinstance(t, int) or isinstance(t, bool) or t < 0 or not _real(b) or not -100.0 <= b <= 100.0
            for t, b in self.logit_bias.items()
        ):
            raise InvalidParam("logit_bias", f"logit_bias must map at most {MAX_LOGIT_BIAS} token ids to numbers in "
                                             "[-100, 100]")
        rf = self.response_format
        if rf is not None:
            kind = rf.get("type") if isinstance(rf, dict) else None
            if kind not in ("text", "json_object", "json_schema"):
                raise InvalidParam("response_format", "response_format.type must be 'text', 'json_object' or 'json_schema'")
            if kind == "json_schema" and not isinstance(rf.get("schema"), (dict, bool)):
                raise InvalidParam("response_format", "response_format json_schema needs a schema object")

    @property
    def greedy(self) -> bool:
        # a temperature this small is argmax in all but name, and dividing by it overflows
        return self.temperature < 1e-5

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def constrained(self) -> bool:
        return self.response_format is not None and self.response_format.get("type") != "text"


def _real(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
