"""vLLM's spec (engine "vllm", replica/backends/vllm_backend.py VllmBackend): vLLM's engine in
each replica, in the vLLM venv's interpreter. It takes the pool, block size, batch limits, model
and LoRA from EngineConfig and its own knobs from VllmSettings (replica/backends/vllm_settings.py);
what vLLM would refuse at a replica's start is refused when the config loads."""

from __future__ import annotations

import re
import tempfile
from dataclasses import fields
from pathlib import Path
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
    handover = True  # through vLLM's own KV connector (replica/backends/vllm_connector.py, docs/vllm.md)
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
        if config.split and "kv_transfer_config" in (config.vllm.get("engine_args") or {}):
            raise ValueError("vllm: engine_args.kv_transfer_config is prefixgate's with prefill_replicas / "
                             "decode_replicas (vLLM's file-based KV connector for the hand-over, docs/vllm.md); "
                             "another connector is not supported with roles")

    def settings(self, config: Any, model_id: str) -> VllmEngineSettings:
        knobs = {"cpu_kvcache_gib": max(1, -(-config.kv_cache_mb // 1024)), **dict(config.vllm)}
        if config.split:  # both roles' engines run the hand-over's connector on one directory
            knobs["engine_args"] = {**knobs.get("engine_args", {}),
                                    "kv_transfer_config": handover_connector(handover_dir(config.key_prefix, model_id))}
        return VllmEngineSettings(engine_config(config, model_id), VllmSettings(**knobs))

    def actor_options(self, config: Any) -> dict[str, Any]:
        # its own interpreter: the vLLM venv (docs/vllm.md)
        return {**super().actor_options(config), "runtime_env": {"py_executable": vllm_python(config.vllm_python)}}

    async def create_backend(self, settings: VllmEngineSettings, torch_threads: int) -> EngineBackend:
        from replica.backends.vllm_backend import VllmBackend

        return await VllmBackend.create(settings.config, settings.vllm, torch_threads)


def handover_dir(key_prefix: str, model_id: str) -> str:
    """Where a model's hand-overs are saved: one directory per app (its key prefix) and model
    under the machine's temp directory, which every replica of a one-machine stack reads."""
    safe = [re.sub(r"[^A-Za-z0-9._-]", "_", part) for part in (key_prefix, model_id)]
    return str(Path(tempfile.gettempdir()) / "prefixgate-pd" / safe[0] / safe[1])


def handover_connector(directory: str) -> dict[str, Any]:
    """vLLM's kv_transfer_config for the hand-over: its file-based ExampleConnector as
    replica/backends/vllm_connector.py narrows it, saving and loading on every replica."""
    return {"kv_connector": "PrefixgateHandoverConnector", "kv_connector_module_path": "replica.backends.vllm_connector",
            "kv_role": "kv_both", "kv_connector_extra_config": {"shared_storage_path": directory}}


VLLM = VllmSpec()
