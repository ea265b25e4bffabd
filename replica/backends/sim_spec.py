"""The simulated engine's spec (engine "sim", replica/backends/local_backend.py SimBackend): a
real cache, scheduler and publisher with modelled compute, no torch. Its pool is a block count
(no model's memory to size it by), its tiers and pulls are modelled (`sim_transfer`), and many
of its replicas fit on a core (`sim_replica_num_cpus`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec

from replica.backends.engine_spec import EngineSpec
from replica.engine_config import SimEngineConfig

if TYPE_CHECKING:
    from replica.backends.engine_protocol import EngineBackend

SIM_DEFAULT_BLOCKS = 1024  # per sim replica when num_blocks is not given (no model to size a pool by)


class SimEngineSettings(msgspec.Struct, tag="sim", tag_field="engine", forbid_unknown_fields=True):
    """A replica running the simulated engine."""

    config: SimEngineConfig = msgspec.field(default_factory=SimEngineConfig)


class SimSpec(EngineSpec):
    name = "sim"
    settings_type = SimEngineSettings
    default_num_blocks = SIM_DEFAULT_BLOCKS
    # kv_host_mb / kv_disk_mb are taken and unused: its modelled tiers are sim_transfer's
    # host_blocks / disk_blocks (docs/sim-replica.md)

    def settings(self, config: Any, model_id: str) -> SimEngineSettings:
        """Vocabulary, context and end-of-sequence ids come from the model directory's JSON
        files, so the gateway's tokeniser and the sim replica agree on what a valid prompt is."""
        from replica.default_model import resolve_model

        limit = {} if config.max_model_len is None else {"max_model_len": config.max_model_len}  # None: the model's
        sim = SimEngineConfig.for_model_dir(
            resolve_model(config.model), model_id=model_id, block_size=config.block_size,
            num_blocks=config.num_blocks or self.default_num_blocks, max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens, **limit,
            long_prefill_token_threshold=config.long_prefill_token_threshold,
            time_scale=config.time_scale, service=dict(config.sim_service),
            max_loras=config.max_loras if config.lora_enabled else 0, max_cpu_loras=config.max_cpu_loras,
            **dict(config.sim_transfer),
        )
        sim.service_model().scaled(sim.time_scale)  # refuses unknown service fields and bad scales here
        return SimEngineSettings(sim)

    def actor_options(self, config: Any) -> dict[str, Any]:
        return {"num_cpus": config.sim_replica_num_cpus}

    async def create_backend(self, settings: SimEngineSettings, torch_threads: int) -> EngineBackend:
        from replica.backends.local_backend import SimBackend

        return await SimBackend.create(settings.config)


SIM = SimSpec()
