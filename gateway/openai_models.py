"""Request schemas of the OpenAI-compatible API (strict: wrong types are errors, not coerced)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_N = 8
MAX_STOP = 4


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
    user: str | None = Field(default=None, max_length=256)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logprobs: bool | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > MAX_STOP or any(not s for s in stops):
            raise ValueError(f"stop must be at most {MAX_STOP} non-empty strings")
        return stops

    def unsupported(self) -> str | None:
        """Fields we parse but do not implement: refused clearly rather than ignored."""
        if self.presence_penalty not in (None, 0, 0.0):
            return "presence_penalty"
        if self.frequency_penalty not in (None, 0, 0.0):
            return "frequency_penalty"
        if self.logprobs:
            return "logprobs"
        return None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1, max_length=1024)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    tools: list | None = None

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens
