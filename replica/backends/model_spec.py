"""Our paged engine's spec (engine "model", replica/backends/local_backend.py ModelBackend):
the only engine with our dtype choice, our compiled forward and our K/V tiers."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec

from replica.backends.engine_spec import EngineSpec, engine_config
from replica.engine_config import EngineConfig

if TYPE_CHECKING:
    from replica.backends.engine_protocol import EngineBackend

MODEL_DTYPES = ("float32", "bfloat16", "float16")  # what our engine loads a model in


class ModelEngineSettings(msgspec.Struct, tag="model", tag_field="engine", forbid_unknown_fields=True):
    """A replica running our paged engine."""

    config: EngineConfig = msgspec.field(default_factory=EngineConfig)


class ModelSpec(EngineSpec):
    name = "model"
    settings_type = ModelEngineSettings
    dtype = True
    compile = True

    def check(self, config: Any) -> None:
        super().check(config)
        if config.dtype not in (None, *MODEL_DTYPES):
            raise ValueError(f"dtype must be one of {', '.join(MODEL_DTYPES)}, got {config.dtype!r}")

    def settings(self, config: Any, model_id: str) -> ModelEngineSettings:
        return ModelEngineSettings(engine_config(config, model_id))

    async def create_backend(self, settings: ModelEngineSettings, torch_threads: int) -> EngineBackend:
        from replica.backends.local_backend import ModelBackend

        return await ModelBackend.create(settings.config, torch_threads)


MODEL = ModelSpec()
