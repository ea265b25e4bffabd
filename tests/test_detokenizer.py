"""Incremental detokenizer: same text as decoding everything, SentencePiece leading spaces kept,
no half characters shown, and a bounded amount of decoding per token."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from replica.core.detokenizer import PROMPT_CONTEXT, Detokenizer
from replica.core.sequence import Sequence, Status
from router.protocol.sampling import SamplingParams


class CountingTokenizer:
    """Wraps a tokenizer and records how many tokens every decode call was given."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.calls: list[int] = []

    def decode(self, ids, **kwargs) -> str:
        self.calls.append(len(ids))
        return self.inner.decode(ids, **kwargs)


def _stream(tokenizer, prompt: list[int], output: list[int], stop: list[str] | None = None):
    """Feed output tokens one by one as the engine does; returns (seq, new text per token)."""
    detok = Detokenizer(tokenizer)
    seq = Sequence(prompt, SamplingParams(max_tokens=len(output) + 1, stop=stop or []), hash_seed=0)
    pieces = []
    for i, t in enumerate(output):
        seq.token_ids.append(t)
        if detok.update(seq) is not None or i == len(output) - 1:
            seq.status = Status.FINISHED
        text = detok.emittable(seq)
        pieces.append(text[seq.emitted_text_len :])
        seq.emitted_text_len = len(text)
        if seq.is_finished:
            break
    return seq, pieces


@pytest.fixture(scope="module")
def sentencepiece_like():
    """A Metaspace (SentencePiece-style) tokenizer: "▁world" decoded alone loses its space."""
    vocab = {"<unk>": 0, "▁Hello": 1, "▁world": 2, "!": 3, "▁how": 4, "▁are": 5, "▁you": 6, "?": 7}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def test_sentencepiece_leading_spaces_are_kept(sentencepiece_like):
    assert sentencepiece_like.decode([2]) == "world"  # the trap: a token alone drops its space
    prompt, output = [1, 3], [4, 5, 6, 7, 1, 2, 3]
    seq, pieces = _stream(sentencepiece_like, prompt, output)
    assert pieces == [" how", " are", " you", "?", " Hello", " world", "!"]
    full = sentencepiece_like.decode(prompt + output)
    assert seq.output_text == full[len(sentencepiece_like.decode(prompt)) :] == " how are you? Hello world!"


@pytest.fixture(scope="module")
def byte_level(default_model_dir):
    return AutoTokenizer.from_pretrained(default_model_dir)  # SmolLM2's byte-level BPE


def test_multibyte_characters_are_never_split(byte_level):
    text = " Grüße aus Köln 🌍🎉 — 東京タワー, naïve café! " * 3
    prompt = byte_level.encode("Say hello:")
    output = byte_level.encode(text)
    split = [t for t in output if "\ufffd" in byte_level.decode([t])]
    assert split, "the text must contain tokens holding part of a character"
    seq, pieces = _stream(byte_level, prompt, output)
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == seq.output_text == byte_level.decode(output) == text


def test_stop_string_across_tokens(byte_level):
    prompt = byte_level.encode("Q:")
    output = byte_level.encode(" The answer is forty-two. END of story")
    seq, pieces = _stream(byte_level, prompt, output, stop=["END"])
    assert seq.output_text == " The answer is forty-two. " == "".join(pieces)


def test_decode_work_per_token_is_bounded(byte_level):
    counting = CountingTokenizer(byte_level)
    prompt = byte_level.encode("Tell me a long story.")
    output = byte_level.encode("Once upon a time, in a land far away, there lived a fox. " * 40)
    assert len(output) > 400
    seq, _ = _stream(counting, prompt, output)
    assert seq.output_text == byte_level.decode(output)
    assert max(counting.calls) <= PROMPT_CONTEXT + 4  # a short window, never the whole output
    assert sum(counting.calls) <= 6 * len(output)  # O(1) per token, amortised
