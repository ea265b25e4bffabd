"""Incremental text for streaming: new text per token, stop strings, no half characters.

Each step decodes only a short window of tokens (vLLM's scheme): the tokens since the last
point where the text was settled, with the tokens before that as context. The window's text
minus its context's text is the new text, so the cost per token does not grow with the output
(the whole output used to be re-decoded every token), and a SentencePiece token keeps its
leading space (decoding a token alone drops it; with context before it, it stays). The first
output token gets the prompt's last tokens as context, so the output text is exactly what the
output adds to the prompt's text.
"""

from __future__ import annotations

from dataclasses import dataclass

from replica.core.sequence import Sequence

PROMPT_CONTEXT = 5  # prompt tokens decoded before the first output token


@dataclass
class DetokState:
    prefix: int  # first token of the context window (index into seq.token_ids)
    read: int  # first token whose text is not settled yet
    prefix_len: int  # len(decode(token_ids[prefix:read]))
    text: str = ""  # settled output text


class Detokenizer:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _advance(self, seq: Sequence) -> str:
        """Settle what the new tokens spell; returns the full output text (settled + pending)."""
        ids = seq.token_ids
        st: DetokState | None = seq.detok_state
        if st is None:
            start = max(0, seq.num_prompt_tokens - PROMPT_CONTEXT)
            read = seq.num_prompt_tokens
            st = seq.detok_state = DetokState(start, read, len(self._decode(ids[start:read])))
        if st.read >= len(ids):
            return st.text
        window = self._decode(ids[st.prefix :])
        new = window[st.prefix_len :] if len(window) > st.prefix_len else ""
        if not new or new.endswith("\ufffd"):
            return st.text + new  # an incomplete character (or nothing yet): settle it later
        st.text += new
        st.prefix, st.read = st.read, len(ids)
        st.prefix_len = len(self._decode(ids[st.prefix : st.read]))
        return st.text

    def update(self, seq: Sequence, check_stops: bool = True) -> str | None:
        """Refresh seq.output_text; returns the stop string that ended it, if any (none is
        looked for while check_stops is false: before a request's min_tokens)."""
        if self.tokenizer is None:
            return None
        text = self._advance(seq)
        seq.output_text = text
        stops = seq.params.stop
        if not stops or not check_stops:
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
