"""LoRA adapters in the simulator: which sessions run under which adapter, and each replica's
adapters in host memory.

Workload (`AdapterMix`): each session (or, without session ids, each conversation: its first two
block keys, the `--sessions prefix2` rule; on `rag` those are the preamble) is given one of N
adapters, drawn from the seed with Zipf popularity (exponent 0: uniform), and keeps it for all
its turns. Every adapter has its own preamble (system prompt) of `preamble_blocks` blocks before
the session's prompt, so an adapter's prompts share a prefix. A request's cache keys are the live
chain (router/protocol/hashing.py): rooted at `chain_seed(model, None, identity)`, one
`hash_block` per block, a block's "tokens" being its workload key's two 32-bit halves (cheap:
the live replay's synthetic blocks, router/sim/trace.py, draw a random token per position), so
the same tokens under two adapters are two different blocks. The workload's own keys, which stand for the base model's blocks as in every run without adapters,
are kept beside them: what a router that ignores adapters hashes (`--lora-aware false`).

Replica (`AdapterLru`, router/costs/adapter_memory.py, shared with the live sim engine): the
adapters resident in host memory. A request whose adapter is not resident reads it from disk
first (`load_ms`, in its prefill slot, when it is admitted). Not modelled here: the `max_loras`
batch slots, an adapter's compute, adapters read at start (every replica starts with none
resident).
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence
from dataclasses import dataclass, replace

from router.protocol.hashing import chain_seed, hash_block
from router.protocol.lora import AdapterRef
from router.sim.workload import SimRequest, _zipf_cum

SIM_MODEL_ID = "prefixgate-sim"  # the model identity the simulated chains are rooted in
_PREAMBLE_KEYS = 1 << 62  # workload keys of the adapters' preambles, above any trace or generated key


def adapter_identity(index: int) -> str:
    """Adapter `index`'s identity as a live replica computes it (`AdapterRef.identity`: name and
    content digest), with a digest made up from its name."""
    name = f"lora-{index}"
    digest = hashlib.sha256(name.encode()).hexdigest()[:16]
    return AdapterRef(name=name, path=f"/sim/{name}", digest=digest).identity


def key_tokens(key: int) -> tuple[int, int]:
    """The 'token ids' a workload key stands for: its two 32-bit halves (keys are < 2**64)."""
    return key & 0xFFFFFFFF, key >> 32


def adapter_hashes(keys: Sequence[int], identity: str, model_id: str = SIM_MODEL_ID) -> list[int]:
    """Cache keys of a prompt (its blocks' workload keys) under an adapter: the live chain,
    rooted at the adapter's identity."""
    h = chain_seed(model_id, None, identity)
    out = []
    for key in keys:
        h = hash_block(h, key_tokens(key))
        out.append(h)
    return out


@dataclass(frozen=True)
class AdapterMix:
    """How a workload's sessions are spread over adapters (0 adapters: none, the workload as is)."""

    adapters: int = 0
    preamble_blocks: int = 2  # each adapter's own system prompt, before every prompt under it
    zipf_s: float = 1.0  # popularity of adapter i is 1/(i+1)**zipf_s; 0: uniform
    block_size: int = 512  # tokens per block of the workload (the preamble's length)

    def __post_init__(self) -> None:
        if self.adapters < 0 or self.preamble_blocks < 0 or self.zipf_s < 0:
            raise ValueError("adapters, preamble blocks and the Zipf exponent must be >= 0")

    def apply(self, requests: list[SimRequest], seed: int = 0) -> list[SimRequest]:
        """The requests with their sessions' adapters (a new list; the same one with none)."""
        if not self.adapters:
            return requests
        rng = random.Random(f"{seed}:adapters")  # its own stream: the workload's draws are untouched
        cum = _zipf_cum(self.adapters, self.zipf_s)
        chosen: dict[object, int] = {}
        out = []
        for req in requests:
            key = req.session_id or tuple(req.hashes[:2])
            if key not in chosen:
                chosen[key] = rng.choices(range(self.adapters), cum_weights=cum)[0]
            out.append(self.under(req, chosen[key]))
        return out

    def under(self, req: SimRequest, index: int) -> SimRequest:
        """`req` under adapter `index`: its preamble first, keyed under its identity."""
        n = self.preamble_blocks
        keys = [_PREAMBLE_KEYS + index * n + j for j in range(n)] + req.hashes
        identity = adapter_identity(index)
        return replace(req, hashes=adapter_hashes(keys, identity), input_tokens=req.input_tokens + n * self.block_size,
                       adapter=identity, base_hashes=keys)

