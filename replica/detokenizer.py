"""Incremental text for streaming: new text per token, stop strings, no half characters."""

from __future__ import annotations

from replica.sequence import Sequence


class Detokenizer:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def update(self, seq: Sequence) -> str | None:
        """Refresh seq.output_text; returns the stop string that ended it, if any."""
        if self.tokenizer is None:
            return None
        text = self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)
        seq.output_text = text
        stops = seq.params.stop
        if not stops:
            return None
        window_start = max(0, seq.emitted_text_len - max(len(s) for s in stops))
        best: tuple[int, str] | None = None
        for s in stops:
            at = text.find(s, window_start)
            if at >= 0 and (best is None or at < best[0]):
                best = (at, s)
        if best is None:
            return None
        seq.output_text = text[: best[0]]
        return best[1]

    @staticmethod
    def emittable(seq: Sequence) -> str:
        """Text the caller may see now: holds back a possible stop-string prefix and a broken
        UTF-8 tail until the next token settles them."""
        text = seq.output_text
        if seq.is_finished:
            return text
        end = len(text)
        while end > seq.emitted_text_len and text[end - 1] == "\ufffd":
            end -= 1
        for s in seq.params.stop:
            for k in range(min(len(s) - 1, end), 0, -1):
                if text[end - k : end] == s[:k]:
                    end -= k
                    break
        return text[:end] if end > seq.emitted_text_len else text[: seq.emitted_text_len]
