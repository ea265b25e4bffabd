"""What an engine is built from: EngineConfig (LLMEngine's, replica/engine.py) and
SimEngineConfig (the simulated-compute engine's, replica/backends/sim_engine.py), with the
defaults they share.

Plain dataclasses, apart from both engines: the gateway builds these configs for its replicas
(gateway/app.py, gateway/config.py) in processes that import neither torch nor the engines.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from router.costs.adapter_memory import LORA_LOAD_MS
from router.costs.service import ServiceModel
from router.costs.transfer_model import TransferModel
from router.protocol.hashing import BLOCK_SIZE  # tokens per K/V block: the hash spec's default
from router.protocol.lora import MAX_CPU_LORAS as _MAX_CPU_LORAS

# The engine's defaults, defined here once: EngineConfig, the scheduler, the sim engine and the
# gateway's AppConfig (the served defaults) all read these.
KV_CACHE_MB = 512  # K/V pool per replica when num_blocks is not given
MAX_NUM_SEQS = 64  # sequences running at once
MAX_NUM_BATCHED_TOKENS = 512  # tokens per step: the prefill chunk, decodes included
# most prompt tokens of one sequence per step (vLLM's long_prefill_token_threshold): a long prompt
# leaves the rest of each step's budget to the prompts queued behind it (0: no cap)
LONG_PREFILL_TOKEN_THRESHOLD = 256
# LoRA limits, with vLLM's meanings: adapters in one batch, the largest rank, adapters resident in
# host memory (the rest are read from disk when a request needs them, least recently used out)
MAX_LORAS = 4
MAX_LORA_RANK = 16
MAX_CPU_LORAS = _MAX_CPU_LORAS  # router/protocol/lora.py: the simulator's too


@dataclass
class EngineConfig:
    model: str | None = None  # local HF model directory; None: the bundled default
    model_id: str | None = None  # identity in block hashes; defaults to the directory name
    block_size: int = BLOCK_SIZE
    num_blocks: int | None = None  # None: derived from kv_cache_bytes
    kv_cache_bytes: int = KV_CACHE_MB * 2**20
    device: str = "cpu"
    dtype: str | None = None  # "float32", "bfloat16", ...; None: float32 on CPU, bf16 on GPU
    max_num_seqs: int = MAX_NUM_SEQS
    max_num_batched_tokens: int = MAX_NUM_BATCHED_TOKENS
    long_prefill_token_threshold: int = LONG_PREFILL_TOKEN_THRESHOLD
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    compile: bool = False  # torch.compile the forward at start (replica/model/compiled_step.py; cached across restarts)
    # K/V tiers below the pool (replica/kvcache/kv_tiers.py): what the pool evicts moves to host memory,
    # then to a bounded local file, and is moved back on a prefix hit instead of recomputed
    kv_host_bytes: int = 0  # 0: no host tier
    kv_disk_bytes: int = 0  # 0: no disk tier
    kv_disk_dir: str | None = None  # where the disk tier's file lives (None: the temp directory)
    # LoRA adapters (replica/model/lora.py): name -> PEFT adapter directory, served from the start.
    # enable_lora without adapters wraps the layers for adapters loaded at run time.
    enable_lora: bool = False
    lora_adapters: dict[str, str] = field(default_factory=dict)
    max_loras: int = MAX_LORAS
    max_lora_rank: int = MAX_LORA_RANK
    max_cpu_loras: int = MAX_CPU_LORAS

    @property
    def lora(self) -> bool:
        return self.enable_lora or bool(self.lora_adapters)


@dataclass
class SimEngineConfig:
    model_id: str = "sim"  # identity in block hashes (the gateway's and router's model id)
    block_size: int = BLOCK_SIZE
    num_blocks: int = 1024
    max_num_seqs: int = MAX_NUM_SEQS
    max_num_batched_tokens: int = 2048  # the service model's prefill chunk (decodes included)
    long_prefill_token_threshold: int = 0  # as EngineConfig's (0: the whole budget, as the service model's chunk)
    max_model_len: int = 4096
    vocab_size: int = 49152
    eos_token_ids: list[int] = field(default_factory=list)  # never emitted as fake output
    time_scale: float = 1.0  # run the service model this many times faster in wall time
    service: dict[str, float] = field(default_factory=dict)  # ServiceModel field overrides
    # K/V pulls (the router's pull hint): modelled like the simulator's, GPU-like defaults
    kv_bytes_per_token: float = TransferModel.kv_bytes_per_token
    pull_bytes_per_s: float = TransferModel.bytes_per_s
    pull_fixed_s: float = TransferModel.fixed_s
    # K/V tiers below the pool, per replica in blocks (0: none), and their modelled rates back into it
    host_blocks: int = 0
    disk_blocks: int = 0
    kv_host_bytes_per_s: float = TransferModel.host_bytes_per_s
    kv_disk_bytes_per_s: float = TransferModel.disk_bytes_per_s
    # LoRA adapters: their identity roots the block hashes; host memory modelled as the
    # simulator's (router/costs/adapter_memory.py: a request under an adapter not resident waits
    # `lora_load_ms` for its read); their compute is not modelled
    max_loras: int = MAX_LORAS
    max_cpu_loras: int = MAX_CPU_LORAS
    lora_load_ms: float = LORA_LOAD_MS

    @classmethod
    def for_model_dir(cls, path: str | Path, **kwargs) -> SimEngineConfig:
        """Vocabulary, context and end-of-sequence ids of a real model, read from its JSON
        files (no weights, no transformers), so prompts tokenised for it validate the same."""
        path = Path(path)
        cfg = json.loads((path / "config.json").read_text())
        eos = cfg.get("eos_token_id")
        gen = path / "generation_config.json"
        if gen.exists():
            eos = json.loads(gen.read_text()).get("eos_token_id", eos)
        facts = {
            "vocab_size": int(cfg["vocab_size"]),
            "eos_token_ids": [e for e in (eos if isinstance(eos, list) else [eos]) if isinstance(e, int)],
        }
        limit = cfg.get("max_position_embeddings")
        if limit:
            facts["max_model_len"] = min(int(limit), kwargs.pop("max_model_len", None) or int(limit))
        return cls(**{**facts, **kwargs})

    def transfer_model(self) -> TransferModel:
        """What a pull or a tier copy costs (unscaled): the simulator's transfer model with these figures."""
        return TransferModel(self.kv_bytes_per_token, self.pull_bytes_per_s, self.pull_fixed_s,
                             1.0 / self.service_model().prefill_s_per_token, self.kv_host_bytes_per_s,
                             self.kv_disk_bytes_per_s)

    def service_model(self) -> ServiceModel:
        """The unscaled service model, with the chunk and batch limits this engine runs."""
        return ServiceModel(**{**self.service, "chunk_tokens": self.max_num_batched_tokens, "max_running": self.max_num_seqs})
