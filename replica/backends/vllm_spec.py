"""vLLM's spec (engine "vllm", replica/backends/vllm_backend.py VllmBackend): vLLM's engine in
each replica, in the vLLM venv's interpreter. It takes the pool, block size, batch limits, model
and LoRA from EngineConfig and its own knobs from VllmSettings (replica/backends/vllm_settings.py);
what vLLM would refuse at a replica's start is refused when the config loads."""

from __future__ import annotations

from dataclasses import fields
from typing import TYPE_CHECKING, Any

import msgspec

from replica.backends.engine_spec import EngineSpec, engine_config
from replica.backends.vllm_settings import (
    VLLM_BLOCK_MULTIPLE,
    VLLM_LORA_RANKS,
    VllmSettings,
    vllm_python,
)
from replica.engine_config import EngineConfig

if TYPE_CHECKING:
    from replica.backends.engine_protocol import EngineBackend


class VllmEngineSettings(msgspec.Struct, tag="vllm", tag_field="engine", forbid_unknown_fields=True):
    """A replica running vLLM's engine."""

    config: EngineConfig = msgspec.field(default_factory=EngineConfig)
    vllm: VllmSettings = msgspec.field(default_factory=VllmSettings)


class VllmSpec(EngineSpec):
    name = "vllm"
    settings_type = VllmEngineSettings
    default_block_size = VLLM_BLOCK_MULTIPLE  # its CPU backend needs a multiple of 32; 32 everywhere
    kv_tiers = False
    handover = False  # vLLM's KV connectors (docs/prefill-decode.md): not wired yet
    elsewhere = {
        "kv_tiers": "vLLM's own offloading reports its medium in its KV events, which the index keeps",
        "dtype": "vLLM's own: --vllm dtype=bfloat16",
        "compile": "vLLM's own: --vllm enforce_eager=false",
    }

    def check(self, config: Any) -> None:
        super().check(config)
        if config.device == "cpu" and config.block_size % VLLM_BLOCK_MULTIPLE:
            raise ValueError(f"engine vllm on CPU needs a block size that is a multiple of {VLLM_BLOCK_MULTIPLE}, "
                             f"got {config.block_size}")
        if config.lora_enabled and config.max_lora_rank not in VLLM_LORA_RANKS:  # vLLM refuses the engine otherwise
            raise ValueError(f"engine vllm takes max_lora_rank in {', '.join(map(str, VLLM_LORA_RANKS))} (vLLM's "
                             f"LoRAConfig), got {config.max_lora_rank}")
        if not isinstance(config.vllm, dict):
            raise ValueError(f"vllm: expected an object of VllmSettings fields, got {config.vllm!r}")
        known = [f.name for f in fields(VllmSettings)]
        unknown = sorted(set(config.vllm) - set(known))
        if unknown:
            raise ValueError(f"vllm: unknown keys {unknown}; valid: {known} (any other vLLM engine argument: "
                             "engine_args)")
        try:
            msgspec.convert(dict(config.vllm), VllmSettings)
        except msgspec.ValidationError as e:
            raise ValueError(f"vllm: {e}") from None

    def settings(self, config: Any, model_id: str) -> VllmEngineSettings:
        knobs = {"cpu_kvcache_gib": max(1, -(-config.kv_cache_mb // 1024)), **dict(config.vllm)}
        return VllmEngineSettings(engine_config(config, model_id), VllmSettings(**knobs))

    def actor_options(self, config: Any) -> dict[str, Any]:
        # its own interpreter: the vLLM venv (docs/vllm.md)
        return {**super().actor_options(config), "runtime_env": {"py_executable": vllm_python(config.vllm_python)}}

    async def create_backend(self, settings: VllmEngineSettings, torch_threads: int) -> EngineBackend:
        from replica.backends.vllm_backend import VllmBackend

        return await VllmBackend.create(settings.config, settings.vllm, torch_threads)


VLLM = VllmSpec()
