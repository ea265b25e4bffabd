"""Chat template and tokenisation, done once in the gateway: the router hashes these token ids
and the replica computes on them, so both always agree."""

from __future__ import annotations

from transformers import AutoConfig, AutoTokenizer

from gateway.config import AppConfig
from gateway.errors import bad_request
from gateway.openai_models import ChatCompletionRequest, CompletionRequest
from replica.default_model import resolve_model


class PromptBuilder:
    def __init__(self, config: AppConfig) -> None:
        path = resolve_model(config.model)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        model_config = AutoConfig.from_pretrained(path)
        self.model_name = config.model_name or path.name
        self.vocab_size = model_config.vocab_size
        limit = getattr(model_config, "max_position_embeddings", 2048)
        self.max_model_len = min(config.max_model_len or limit, limit)
        self.pool_tokens = _pool_tokens(config, model_config)
        self.default_max_tokens = config.default_max_tokens

    def chat(self, body: ChatCompletionRequest) -> tuple[list[int], str]:
        if body.tools:
            raise bad_request("tools are not supported by this server", param="tools")
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
        # equal id prefixes as equal text prefixes
        return list(prompt), " ".join(map(str, prompt))

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


def _pool_tokens(config: AppConfig, model_config) -> int:
    """Tokens one replica's K/V pool holds: the same arithmetic as the engine's sizing."""
    import torch

    from replica.model_runner import ModelShape

    if config.num_blocks:
        return config.num_blocks * config.block_size
    dtype = torch.bfloat16 if config.device.startswith("cuda") else torch.float32  # 2 bytes either way on GPU
    per_block = ModelShape.from_config(model_config).bytes_per_block(config.block_size, dtype)
    return max(16, config.kv_cache_mb * 2**20 // per_block) * config.block_size
