"""Request schemas of the OpenAI-compatible API (strict: wrong types are errors, not coerced)."""

from __future__ import annotations

import abc
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from router.protocol.sampling import MAX_LOGPROBS, MAX_STOP

MAX_N = 8
MAX_SESSION_KEY = 256  # characters of a routing session key, from any of its three sources


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class StreamOptions(_Strict):
    include_usage: bool = False


class JSONSchemaFormat(_Strict):
    name: str = Field(default="response", max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | bool = Field(default=True, alias="schema")  # true: any JSON
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _needs_schema(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type json_schema needs a json_schema object")
        return self

    def engine_format(self) -> dict[str, Any] | None:
        """What the replica's constrained decoding takes (replica/model/constrained.py)."""
        if self.type == "json_object":
            return {"type": "json_object"}
        if self.type == "json_schema":
            return {"type": "json_schema", "schema": self.json_schema.schema_}
        return None


class _Sampling(_Strict):
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1, le=1_000_000)
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(default=None, max_length=MAX_SESSION_KEY)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=10.0)  # vLLM's extension
    ignore_eos: bool | None = None  # vLLM's extension (benchmark clients send it)
    min_tokens: int | None = Field(default=None, ge=0)  # vLLM's extension: no stop before this many tokens
    response_format: ResponseFormat | None = None
    prompt_cache_key: str | None = Field(default=None, max_length=MAX_SESSION_KEY)  # routing session key
    service_tier: Any = None  # OpenAI's: auto, default, flex, priority (checked in gateway/flow/tiers.py: 400 naming it)
    priority: int | None = None  # vLLM's extension: lower is earlier, 0 the default (gateway/flow/tiers.py)
    logit_bias: dict[str, float] | None = None  # OpenAI's: token id (a JSON key) -> bias in [-100, 100]

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > MAX_STOP or any(not s for s in stops):
            raise ValueError(f"stop must be at most {MAX_STOP} non-empty strings")
        return stops

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys(cls, v):
        """JSON keys are text: each must spell a token id. How many and how large the biases may
        be is SamplingParams' rule (router/protocol/sampling.py), checked where it is built."""
        for key in v or ():
            if not (key.isascii() and key.isdigit()):
                raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
        return v

    @abc.abstractmethod  # pydantic's model metaclass is an ABCMeta: the two request kinds say it their way
    def top_logprobs_requested(self) -> int | None:
        """None: no logprobs; k: the chosen token's logprob and the k most likely tokens."""

    def engine_params(self) -> dict[str, Any]:
        """Penalties, logprobs, response_format and logit_bias as replica SamplingParams fields."""
        params: dict[str, Any] = {}
        for name in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
            value = getattr(self, name)
            if value is not None:
                params[name] = float(value)
        if self.ignore_eos is not None:
            params["ignore_eos"] = self.ignore_eos
        if self.min_tokens:
            params["min_tokens"] = self.min_tokens
        k = self.top_logprobs_requested()
        if k is not None:
            params["logprobs"] = k
        if self.logit_bias:
            params["logit_bias"] = {int(k): float(b) for k, b in self.logit_bias.items()}
        fmt = self.response_format.engine_format() if self.response_format else None
        if fmt is not None:
            params["response_format"] = fmt
        return params


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1, max_length=1024)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    tools: list | None = None
    functions: list | None = None  # OpenAI's deprecated form of tools
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    @model_validator(mode="after")
    def _top_needs_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs set to true")
        return self

    def top_logprobs_requested(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    def top_logprobs_requested(self) -> int | None:
        return self.logprobs

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens


def routing_session(header: str | None, body: _Sampling) -> str | None:
    """The key that keeps a conversation on one replica: the x-session-id header, else
    prompt_cache_key (OpenAI's field for exactly this), else user. Each is at most
    MAX_SESSION_KEY characters: routers and Redis keep one entry per key (ValueError naming the
    header when it is longer; the body's fields are checked by the schema)."""
    if header is not None and len(header) > MAX_SESSION_KEY:
        raise ValueError(f"x-session-id must be at most {MAX_SESSION_KEY} characters, got {len(header)}")
    return header or body.prompt_cache_key or body.user or None
