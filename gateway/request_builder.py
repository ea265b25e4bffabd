"""The one place a parsed OpenAI body becomes the request a replica runs (router/protocol/messages.py
`GenerateRequest`): its sampling parameters built and checked once (SamplingParams' own rules, a
400 naming the field), then one request per choice (`n`), which differ only in their id and seed.
The prompt ids go on as the tokeniser or the body gave them: never copied here."""

from __future__ import annotations

import copy
import uuid
from typing import Any

from gateway.errors import bad_request
from gateway.openai_models import ChatCompletionRequest, CompletionRequest
from router.protocol.lora import AdapterRef
from router.protocol.messages import GenerateRequest
from router.protocol.sampling import InvalidParam, SamplingParams

Body = ChatCompletionRequest | CompletionRequest


def sampling_params(body: Body, max_tokens: int, vocab_size: int) -> SamplingParams:
    """The body's sampling fields as the replicas take them, checked once (a 400 naming the field)."""
    params: dict[str, Any] = {"max_tokens": max_tokens, "stop": list(body.stop or [])}
    if body.temperature is not None:
        params["temperature"] = body.temperature
    elif body.n > 1:
        params["temperature"] = 1.0  # n copies of a greedy answer would be identical
    if body.top_p is not None:
        params["top_p"] = body.top_p
    if body.top_k is not None and body.top_k > 0:
        params["top_k"] = body.top_k
    if body.seed is not None:
        params["seed"] = body.seed
    params.update(body.engine_params())  # penalties, logprobs, response_format, logit_bias
    if any(t >= vocab_size for t in params.get("logit_bias", ())):
        raise bad_request(f"logit_bias token ids must be in [0, {vocab_size})", param="logit_bias")
    try:  # the replicas' own rules, checked here: a bad value is a 400 naming its field
        return SamplingParams(**params)
    except InvalidParam as e:
        raise bad_request(str(e), param=e.param) from None


def build_requests(body: Body, prompt_ids: list[int], prompt_text: str, *, max_tokens: int, vocab_size: int,
                   session: str | None, tenant: str | None, adapter: AdapterRef | None) -> list[GenerateRequest]:
    """The request's `n` choices, each its own request: the same prompt list (never mutated on
    the way: the engine's Sequence copies it) and parameters, its own id, and, with a seed, its
    own seed (seed + i), so choices differ and each is reproducible."""
    params = sampling_params(body, max_tokens, vocab_size)
    first = GenerateRequest(prompt_token_ids=prompt_ids, params=params, prompt=prompt_text, session_id=session,
                            cache_salt=tenant, adapter=adapter)
    requests = [first]
    for i in range(1, body.n):
        choice = copy.copy(first)  # shallow: the prompt list is shared, nothing is re-checked
        choice.request_id = uuid.uuid4().hex
        if params.seed is not None:
            choice.params = copy.copy(params)
            choice.params.seed = (params.seed + i) % 2**63
        requests.append(choice)
    return requests
