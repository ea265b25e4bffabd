"""Chat template and tokenisation, done once in the gateway: the router hashes these token ids
and the replica computes on them, so both always agree.

The gateway stays a light process: it loads only the model's tokenizer files with
`PreTrainedTokenizerFast` (AutoTokenizer would import torch), and takes the facts it checks
prompts against (context length, vocabulary, one replica's pool in tokens) from the replicas
themselves (their `info()`), fetched once on the first request, never from engine code.
"""

from __future__ import annotations

import asyncio

from transformers import PreTrainedTokenizerFast

from gateway.config import AppConfig
from gateway.errors import APIError, bad_request
from gateway.openai_models import ChatCompletionRequest, CompletionRequest
from replica.default_model import resolve_model
from router.protocol.model_facts import ModelFacts

FACTS_TIMEOUT_S = 60.0  # how long the first request waits for a replica to describe the model


class PromptBuilder:
    def __init__(self, config: AppConfig) -> None:
        path = resolve_model(config.model)
        self.tokenizer = PreTrainedTokenizerFast.from_pretrained(path)
        self.model_name = config.model_name or path.name
        self.default_max_tokens = config.default_max_tokens
        self.facts: ModelFacts | None = None
        self._facts_lock = asyncio.Lock()

    async def ready(self, replicas) -> ModelFacts:
        """The model facts, asked of a replica on first use (a 503 if none answers in time)."""
        if self.facts is None:
            async with self._facts_lock:
                if self.facts is None:
                    try:
                        info = await asyncio.wait_for(replicas.info.remote(), FACTS_TIMEOUT_S)
                        facts = ModelFacts.from_info(info)  # checked as they enter (ValidationError)
                    except Exception as e:
                        raise APIError(503, f"no replica could describe the model yet ({type(e).__name__}); retry shortly",
                                       "server_error", code="replicas_unavailable", headers={"Retry-After": "5"}) from None
                    self.facts = facts
        return self.facts

    @property
    def vocab_size(self) -> int:
        return self._facts().vocab_size

    @property
    def max_model_len(self) -> int:
        return self._facts().max_model_len

    @property
    def pool_tokens(self) -> int:
        """Tokens one replica's pool holds (the context where a replica does not know its pool)."""
        facts = self._facts()
        return facts.pool_tokens or facts.max_model_len

    def _facts(self) -> ModelFacts:
        if self.facts is None:
            raise RuntimeError("PromptBuilder.ready() must run before prompts are checked")
        return self.facts

    def chat(self, body: ChatCompletionRequest) -> tuple[list[int], str]:
        if body.tools or body.functions:
            field = "tools" if body.tools else "functions"
            raise bad_request(f"{field} are not supported by this server", param=field)
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in body.messages]
        try:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as e:  # a template may reject role orders it does not support
            raise bad_request(f"messages do not fit the model's chat template: {e}", param="messages") from None
        return self.tokenizer.encode(text, add_special_tokens=False), text

    def completion(self, body: CompletionRequest) -> tuple[list[int], str]:
        if body.echo or body.suffix or (body.best_of not in (None, 1)):
            raise bad_request("echo, suffix and best_of are not supported by this server")
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise bad_request("one prompt per request: send batched prompts as separate requests", param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            if not prompt:
                raise bad_request("prompt is empty", param="prompt")
            return self.tokenizer.encode(prompt), prompt
        if not prompt:
            raise bad_request("prompt is empty", param="prompt")
        if any(t < 0 or t >= self.vocab_size for t in prompt):
            raise bad_request(f"prompt token ids must be in [0, {self.vocab_size})", param="prompt")
        # text for routers that match on characters (Ray's prefix router): ids spelled out keep
        # equal id prefixes as equal text prefixes; the parsed list goes on as it is (no copy)
        return prompt, " ".join(map(str, prompt))

    def check_length(self, prompt_ids: list[int], requested: int | None) -> int:
        """max_tokens to use; refuses what cannot fit the context or a replica's K/V pool."""
        room = min(self.max_model_len, self.pool_tokens) - len(prompt_ids)
        if room <= 0:
            raise bad_request(
                f"prompt is {len(prompt_ids)} tokens; the model's context is {self.max_model_len} and a "
                f"replica's cache holds {self.pool_tokens}",
                param="messages", code="context_length_exceeded",
            )
        if requested is None:
            return min(self.default_max_tokens, room)
        if requested > room:
            raise bad_request(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({requested}) exceeds the model's context of "
                f"{self.max_model_len} tokens (or a replica's cache of {self.pool_tokens})", param="max_tokens",
                code="context_length_exceeded",
            )
        return requested
