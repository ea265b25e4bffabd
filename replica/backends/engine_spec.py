"""What one engine asks of the app's settings: its rules, how its replicas' settings are built
from the flat settings users write, the Ray actor its replicas run in, and how its backend is
started. One `EngineSpec` per engine (model_spec.py, sim_spec.py, vllm_spec.py), found by name or
by its settings' type in engines.py: nothing outside replica/backends/ asks which engine it is.

Importable without torch, Ray or vLLM: the gateway checks and builds settings with these in a
process that loads no engine; each spec imports its backend only in `create_backend`.

`config` below is the app's flat settings (gateway/config.py `AppConfig`, or anything with its
field names): replica/ does not import the gateway.
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any, ClassVar

from replica.engine_config import EngineConfig
from router.protocol.hashing import BLOCK_SIZE

if TYPE_CHECKING:
    from replica.backends.engine_protocol import EngineBackend


class EngineSpec(abc.ABC):
    """One engine's rules (class attributes, checked by `check`) and builders (methods)."""

    name: ClassVar[str]  # one of ENGINE_NAMES (engine_protocol.py)
    settings_type: ClassVar[type]  # its member of the EngineSettings union (engines.py)
    default_block_size: ClassVar[int] = BLOCK_SIZE  # block_size when the config gives none
    default_num_blocks: ClassVar[int | None] = None  # num_blocks when none is given; None: sized from kv_cache_mb
    kv_tiers: ClassVar[bool] = True  # takes kv_host_mb / kv_disk_mb (our K/V tiers, docs/kv-tiers.md)
    dtype: ClassVar[bool] = False  # takes `dtype` (our engine's weights and K/V dtype)
    compile: ClassVar[bool] = False  # takes `compile` (our engine's compiled forward)
    handover: ClassVar[bool] = True  # hands a prompt's K/V from a prefill replica to a decode one (roles)
    # where the engine's own equivalent of a setting it refuses is set: "kv_tiers", "dtype", "compile", "handover"
    elsewhere: ClassVar[dict[str, str]] = {}

    def check(self, config: Any) -> None:
        """The app's settings as this engine can take them, or ValueError naming the setting
        (run when the config loads, before any replica starts)."""
        if (config.kv_host_mb or config.kv_disk_mb) and not self.kv_tiers:
            raise ValueError(f"kv_host_mb / kv_disk_mb are our engine's K/V tiers; engine {self.name} has none of ours"
                             + self._elsewhere("kv_tiers"))
        if config.dtype is not None and not self.dtype:
            raise ValueError(f"dtype is our engine's; engine {self.name} has none of it" + self._elsewhere("dtype"))
        if config.compile and not self.compile:
            raise ValueError(f"compile is our engine's compiled forward; engine {self.name} has none"
                             + self._elsewhere("compile"))
        if (config.prefill_replicas or config.decode_replicas) and not self.handover:
            raise ValueError(f"prefill_replicas / decode_replicas: engine {self.name!r} cannot hand a prompt's K/V "
                             "over between replicas yet" + self._elsewhere("handover"))

    def _elsewhere(self, rule: str) -> str:
        return f" ({self.elsewhere[rule]})" if rule in self.elsewhere else ""

    @abc.abstractmethod
    def settings(self, config: Any, model_id: str) -> Any:
        """What each replica of this engine is built from (an instance of `settings_type`)."""

    def actor_options(self, config: Any) -> dict[str, Any]:
        """The Ray actor options of one replica (resources the app adds to any engine's)."""
        return {"num_cpus": config.replica_num_cpus, "num_gpus": config.replica_num_gpus}

    @abc.abstractmethod
    async def create_backend(self, settings: Any, torch_threads: int) -> EngineBackend:
        """The backend `settings` describe, started (imports the engine: only in a replica)."""


def engine_config(config: Any, model_id: str) -> EngineConfig:
    """The EngineConfig the app's flat settings describe (our engine's; vLLM's replicas take the
    pool, block size, batch limits, model and LoRA from it too)."""
    return EngineConfig(
        model=config.model,
        model_id=model_id,
        block_size=config.block_size,
        num_blocks=config.num_blocks,
        kv_cache_bytes=config.kv_cache_mb * 2**20,
        kv_host_bytes=config.kv_host_mb * 2**20,
        kv_disk_bytes=config.kv_disk_mb * 2**20,
        kv_disk_dir=config.kv_disk_dir,
        device=config.device,
        dtype=config.dtype,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        long_prefill_token_threshold=config.long_prefill_token_threshold,
        max_model_len=config.max_model_len,
        compile=config.compile,
        enable_lora=config.lora_enabled,
        lora_adapters=dict(config.lora),
        max_loras=config.max_loras,
        max_lora_rank=config.max_lora_rank,
        max_cpu_loras=config.max_cpu_loras,
    )
