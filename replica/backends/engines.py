"""The engines a replica can run, by name: each one's spec (its rules, settings, actor and
backend; engine_spec.py) and the tagged union of their settings, which a replica's settings
carry exactly one of (replica/serve/replica_settings.py). Torch-free: the gateway imports it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from replica.backends.engine_protocol import ENGINE_NAMES
from replica.backends.engine_spec import EngineSpec
from replica.backends.model_spec import MODEL, ModelEngineSettings
from replica.backends.sim_spec import SIM, SimEngineSettings
from replica.backends.vllm_spec import VLLM, VllmEngineSettings

if TYPE_CHECKING:
    from replica.backends.engine_protocol import EngineBackend

# what one replica runs: msgspec decodes it by its "engine" tag ({"engine": "sim", "config": {...}})
EngineSettings = ModelEngineSettings | SimEngineSettings | VllmEngineSettings

SPECS: dict[str, EngineSpec] = {spec.name: spec for spec in (MODEL, SIM, VLLM)}
assert tuple(SPECS) == ENGINE_NAMES, "every engine name has its spec, in ENGINE_NAMES' order"
_BY_TYPE: dict[type, EngineSpec] = {spec.settings_type: spec for spec in SPECS.values()}


def engine_spec(name: str) -> EngineSpec:
    """The spec of the engine named `name` (ValueError listing the names for an unknown one)."""
    spec = SPECS.get(name)
    if spec is None:
        raise ValueError(f"unknown engine {name!r}; choose one of {', '.join(ENGINE_NAMES)}")
    return spec


def spec_of(settings: EngineSettings) -> EngineSpec:
    """The spec whose settings these are (by their type: the union's tag, decoded)."""
    return _BY_TYPE[type(settings)]


async def create_backend(settings: EngineSettings, torch_threads: int) -> EngineBackend:
    """The backend `settings` name, started: the one place that picks an engine."""
    return await spec_of(settings).create_backend(settings, torch_threads)
