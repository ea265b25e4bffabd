from collections import Counter

from hypothesis import given, settings

from tests.helpers.fuzz import CHAT_FIELDS, COMPLETION_FIELDS, FUZZ, _fuzz, bodies
from tests.test_vllm_backend import vllm_app  # noqa: F401


@settings(FUZZ, max_examples=150)
@given(raw=bodies(COMPLETION_FIELDS))
def test_soak_completions_vllm(vllm_app, raw):  # noqa: F811
    _fuzz(vllm_app[0], "/v1/completions", raw, Counter())


@settings(FUZZ, max_examples=150)
@given(raw=bodies(CHAT_FIELDS))
def test_soak_chat_vllm(vllm_app, raw):  # noqa: F811
    _fuzz(vllm_app[0], "/v1/chat/completions", raw, Counter())


@settings(FUZZ, max_examples=150)
@given(raw=bodies(COMPLETION_FIELDS))
def test_soak_completions_ours(stack, raw):
    _fuzz(stack.url, "/v1/completions", raw, Counter())


@settings(FUZZ, max_examples=150)
@given(raw=bodies(CHAT_FIELDS))
def test_soak_chat_ours(stack, raw):
    _fuzz(stack.url, "/v1/chat/completions", raw, Counter())
