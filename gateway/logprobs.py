"""Logprobs in OpenAI's response shapes, from the per-token entries replicas send in delta chunks.

A replica sends, per generated token, {"token", "bytes", "logprob", "top": [{"token", "bytes",
"logprob"}, ...]} (replica/model/token_text.py). Chat answers `{"content": [{token, logprob, bytes,
top_logprobs}]}`; completions answer the legacy parallel lists with a character `text_offset`.
"""

from __future__ import annotations

from router.protocol.messages import DeltaChunk


class LogprobsView:
    """Renders one request's logprobs, choice by choice; everything is None when not asked for."""

    def __init__(self, chat: bool, body, choices: int) -> None:
        self.chat = chat
        self.enabled = bool(body.logprobs) if chat else body.logprobs is not None
        self.top = (getattr(body, "top_logprobs", None) or 0) if chat else (body.logprobs or 0)
        self._entries: list[list[dict]] = [[] for _ in range(choices)]
        self._offsets = [0] * choices  # completions: characters of text before the next token

    def add(self, index: int, chunk: DeltaChunk) -> None:
        """Keep a delta chunk's entries for the whole (non-streaming) answer."""
        if self.enabled:
            self._entries[index].extend(chunk.logprobs or [])

    def whole(self, index: int) -> dict | None:
        if not self.enabled:
            return None
        return self._render(self._entries[index], index)

    def piece(self, index: int, chunk: DeltaChunk) -> dict | None:
        """The logprobs field of one streamed chunk (offsets continue across chunks)."""
        if not self.enabled:
            return None
        return self._render(chunk.logprobs or [], index)

    def _render(self, entries: list[dict], index: int) -> dict:
        if self.chat:
            return {"content": [self._chat_entry(e) for e in entries], "refusal": None}
        tokens, token_logprobs, top, offsets = [], [], [], []
        for e in entries:
            tokens.append(e["token"])
            token_logprobs.append(e["logprob"])
            alternatives = {t["token"]: t["logprob"] for t in e["top"][: self.top]}
            alternatives.setdefault(e["token"], e["logprob"])  # OpenAI: the sampled token is always there
            top.append(alternatives)
            offsets.append(self._offsets[index])
            self._offsets[index] += len(e["token"])
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}

    def _chat_entry(self, e: dict) -> dict:
        top = [{"token": t["token"], "logprob": t["logprob"], "bytes": t["bytes"]} for t in e["top"][: self.top]]
        return {"token": e["token"], "logprob": e["logprob"], "bytes": e["bytes"], "top_logprobs": top}
