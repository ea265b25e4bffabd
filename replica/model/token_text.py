"""One token's text and bytes, as OpenAI's logprobs report them.

A byte-level BPE token (GPT-2, Llama 3, SmolLM, Qwen) may hold part of a UTF-8 character, so its
bytes come from the byte-level alphabet, not from decoding it alone; SentencePiece tokens spell a
leading space as U+2581 and raw bytes as <0xNN>. The text is the bytes decoded with replacement
characters, as OpenAI does for partial characters.
"""

from __future__ import annotations

import re
from functools import cache

from replica.model.sampler import TokenLogprob

_SP_BYTE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


@cache
def _byte_decoder() -> dict[str, int]:
    """GPT-2's reversible map from printable characters back to the bytes they stand for."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


class TokenText:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}  # bounded by the vocabulary
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._byte_level = "ByteLevel" in repr(getattr(backend, "decoder", None))

    def text_and_bytes(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is None:
            hit = self._cache[token_id] = self._render(token_id)
        return hit

    def _render(self, token_id: int) -> tuple[str, list[int]]:
        if self.tokenizer is None:
            return f"token_id:{token_id}", []
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if piece is None:
            return f"token_id:{token_id}", []
        if token_id in getattr(self.tokenizer, "all_special_ids", ()):
            raw = piece.encode("utf-8")
        elif (m := _SP_BYTE.match(piece)) is not None:
            raw = bytes([int(m.group(1), 16)])
        elif self._byte_level and all(c in _byte_decoder() for c in piece):
            raw = bytes(_byte_decoder()[c] for c in piece)
        else:
            raw = piece.replace("\u2581", " ").encode("utf-8")
        return raw.decode("utf-8", errors="replace"), list(raw)

    def entry(self, lp: TokenLogprob) -> dict:
        """The wire form of one generated token's logprobs (plain data: cheap to pickle)."""
        text, raw = self.text_and_bytes(lp.token_id)
        top = []
        for token_id, logprob in lp.top:
            t, b = self.text_and_bytes(token_id)
            top.append({"token_id": token_id, "token": t, "bytes": b, "logprob": logprob})
        return {"token_id": lp.token_id, "token": text, "bytes": raw, "logprob": lp.logprob, "top": top}
