"""response_format enforced by constrained decoding: xgrammar grammars applied as a token bitmask.

A request's JSON schema is compiled once (and cached by its JSON text, so a client that sends
the same schema again pays nothing); each request then gets its own matcher, which says which tokens
may come next and follows the tokens actually sampled. xgrammar is imported on the first
constrained request, so engines that never see one never load it.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any

import torch

JSON_OBJECT_SCHEMA = {"type": "object"}


class GrammarError(ValueError):
    """A response_format that the grammar library cannot compile: the client gets a 400."""


class Grammars:
    """Compiles response formats for one tokenizer and hands out per-request matchers."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int], max_cached: int = 256) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self.max_cached = max_cached
        self._compiler = None
        self._cache: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()  # submissions may come from several threads
        self.compilations = 0  # how many schemas were really compiled (the cache's misses)

    def _xgr(self):
        import xgrammar as xgr

        if self._compiler is None:
            if self.tokenizer is None:
                raise GrammarError("response_format needs a model with a tokenizer")
            info = xgr.TokenizerInfo.from_huggingface(
                self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids or None
            )
            self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        return xgr

    def compile(self, response_format: dict[str, Any]):
        """The compiled grammar for a response_format; GrammarError for what cannot compile."""
        kind = response_format.get("type")
        if kind == "json_object":
            schema, strict = JSON_OBJECT_SCHEMA, False  # any object: extra properties allowed
        elif kind == "json_schema":
            schema, strict = response_format.get("schema"), True
        else:
            raise GrammarError(f"response_format type {kind!r} is not a constraint")
        try:
            text = json.dumps(schema, allow_nan=False)  # key order kept: it is the generation order
        except (TypeError, ValueError) as e:
            raise GrammarError(f"response_format schema is not plain JSON: {e}") from None
        key = f"{kind}:{text}"
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
            self._xgr()
            try:
                # compact JSON: a small model left free to emit whitespace can pad forever
                compiled = self._compiler.compile_json_schema(text, any_whitespace=False, strict_mode=strict)
            except Exception as e:  # xgrammar raises RuntimeError/ValueError with its parser's message
                raise GrammarError(f"response_format schema is not supported: {_first_line(e)}") from None
            self.compilations += 1
            self._cache[key] = compiled
            if len(self._cache) > self.max_cached:
                self._cache.popitem(last=False)
            return compiled

    def matcher(self, response_format: dict[str, Any]) -> GrammarMatcher:
        compiled = self.compile(response_format)
        return GrammarMatcher(self._xgr().GrammarMatcher(compiled), self.vocab_size)


class GrammarMatcher:
    """One request's position in its grammar."""

    def __init__(self, matcher, vocab_size: int) -> None:
        self._m = matcher
        self.vocab_size = vocab_size

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write this request's allowed next tokens into row `row` of a shared bitmask."""
        if not self._m.is_terminated():
            self._m.fill_next_token_bitmask(bitmask, row)

    def accept(self, token: int) -> bool:
        return self._m.is_terminated() or bool(self._m.accept_token(token))

    @property
    def done(self) -> bool:
        return self._m.is_terminated()


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """All tokens allowed (-1 is every bit set) for rows no grammar touches."""
    return torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Set disallowed tokens of the given rows to -inf, in place, on the logits' device."""
    import xgrammar as xgr

    xgr.apply_token_bitmask_inplace(
        logits, bitmask.to(logits.device, non_blocking=True), vocab_size=logits.shape[-1], indices=rows
    )


def _first_line(e: Exception) -> str:
    text = str(e).strip().splitlines()
    line = text[0] if text else type(e).__name__
    # xgrammar prefixes "[hh:mm:ss] /path/file.cc:123: " to its messages
    return line.split(": ", 1)[1] if line.startswith("[") and ": " in line else line
