"""What a replica tells the gateway about the model it serves (its `info()`): the one definition
the gateway's tokeniser checks prompts against and the replica's backend fills in."""

from __future__ import annotations

import msgspec


class ModelFacts(msgspec.Struct, frozen=True, kw_only=True):
    engine: str  # one of replica/backends/engine_protocol.py ENGINE_NAMES
    model_id: str  # served name, and the identity in block hashes
    max_model_len: int
    vocab_size: int
    block_size: int
    num_blocks: int  # the whole K/V pool of one replica (0: unknown)
    kv_bytes_per_token: int = 0  # 0: unknown; the router prices pulls with it

    @property
    def pool_tokens(self) -> int:
        """Tokens one replica's K/V pool holds (0: unknown)."""
        return self.num_blocks * self.block_size

    def as_info(self) -> dict:
        """The facts as `info()` answers them: every field, and pool_tokens."""
        return {**msgspec.structs.asdict(self), "pool_tokens": self.pool_tokens}

    @classmethod
    def from_info(cls, info: dict) -> ModelFacts:
        """The facts in a replica's `info()` answer, checked as they enter the gateway
        (msgspec.ValidationError naming a missing or wrong field)."""
        return msgspec.convert(info, cls)
