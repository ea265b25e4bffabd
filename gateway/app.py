"""Builds the Ray Serve application: Gateway x K (ingress, each with its own router) ->
PrefixCacheReplica x N per model, with the request router chosen by policy name (router/registry.py).

Nothing imported here loads torch: the replica deployment imports its engine when a replica
starts, and a simulated-compute replica (engine "sim") never imports it at all. A vLLM
replica (engine "vllm") runs in the vLLM venv's interpreter (Ray's runtime_env py_executable),
so vLLM's pins never meet ours (docs/vllm.md).
"""

from __future__ import annotations

import re

from ray import serve
from ray.serve.config import RequestRouterConfig

from gateway.config import AppConfig
from gateway.flow.saturation import HEADROOM_PER_REPLICA
from gateway.server import Gateway
from replica.backends.engine_protocol import ENGINE_NAMES
from replica.backends.vllm_settings import (
    VLLM_BLOCK_MULTIPLE,
    VLLM_LORA_RANKS,
    VllmSettings,
    vllm_python,
)
from replica.engine_config import EngineConfig
from replica.serve.deployment import PrefixCacheReplica
from replica.serve.replica_settings import ReplicaSettings
from router import registry

ENGINES = ENGINE_NAMES
SIM_DEFAULT_BLOCKS = 1024  # per sim replica when num_blocks is not given (no model to size a pool by)


def router_config(config: AppConfig, model_id: str) -> RequestRouterConfig | None:
    """Ours run inside PrefixGateRouter; Ray's by their import path (None: Serve's default)."""
    entry = registry.get(config.policy)
    if entry.is_ours:
        return RequestRouterConfig(
            request_router_class=registry.OUR_ROUTER_CLASS,
            request_router_kwargs=config.router_options(model_id).to_kwargs(),
        )
    return RequestRouterConfig(request_router_class=entry.ray_router) if entry.ray_router else None


def engine_config(config: AppConfig, model_id: str) -> EngineConfig:
    """What every replica's engine is built from."""
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


def build_app(config: AppConfig) -> serve.Application:
    """Each process resolves the model itself (the bundled default is converted on first use on
    each node), so the app builds anywhere; `prefixgate serve` converts it up front. One replica
    deployment per model (`models`), all behind the one gateway deployment."""
    if config.gateways < 1:
        raise ValueError(f"gateways must be at least 1, got {config.gateways}")
    several = len(config.models) > 1
    replicas = {cfg.served_name: replica_deployment(cfg, deployment_name(cfg.served_name) if several else REPLICA_NAME)
                for cfg in config.model_configs()}
    gateway_actor = {"num_cpus": config.gateway_num_cpus}
    if config.gateway_resources:
        gateway_actor["resources"] = dict(config.gateway_resources)
    gateway = Gateway.options(num_replicas=config.gateways, ray_actor_options=gateway_actor, max_ongoing_requests=1000)
    return gateway.bind(replicas, config.to_dict())


REPLICA_NAME = "PrefixCacheReplica"  # the replica deployment's name (one model: as it always was)


def deployment_name(model: str) -> str:
    """A model's replica deployment when several are served: Serve names take no slashes."""
    return f"{REPLICA_NAME}-{re.sub(r'[^A-Za-z0-9_.-]', '_', model)}"


def replica_deployment(config: AppConfig, name: str) -> serve.Application:
    """One model's replicas, bound to their settings, routed by the app's policy."""
    model_id = config.served_name
    settings = replica_settings(config, model_id)
    if settings.sim is not None:
        actor_options = {"num_cpus": config.sim_replica_num_cpus}
    else:
        actor_options = {"num_cpus": config.replica_num_cpus, "num_gpus": config.replica_num_gpus}
    if settings.vllm is not None:  # its own interpreter: the vLLM venv (docs/vllm.md)
        actor_options["runtime_env"] = {"py_executable": vllm_python(config.vllm_python)}
    if config.replica_resources:
        actor_options["resources"] = dict(config.replica_resources)
    options = dict(
        name=name,
        num_replicas=config.replicas,
        ray_actor_options=actor_options,
        # flow control keeps the gateways' sends to replicas x max_ongoing_requests; the seat more
        # is for tenants within their share, who never wait for a flood's seats
        max_ongoing_requests=config.max_ongoing_requests + (HEADROOM_PER_REPLICA if config.flow_control else 0),
        health_check_period_s=2,
        health_check_timeout_s=30,
        graceful_shutdown_timeout_s=config.drain_timeout_s,  # then Serve kills it; the gateway moves what runs
        graceful_shutdown_wait_loop_s=0.5,
    )
    if config.autoscaling:
        del options["num_replicas"]
        options["autoscaling_config"] = dict(config.autoscaling)
    rc = router_config(config, model_id)
    if rc is not None:
        options["request_router_config"] = rc
    return serve.deployment(PrefixCacheReplica, **options).bind(settings.to_dict())


def replica_settings(config: AppConfig, model_id: str) -> ReplicaSettings:
    """What every replica of the app is built from (passed to each through Serve)."""
    return ReplicaSettings(engine=engine_config(config, model_id), redis_url=config.redis_url,
                           key_prefix=config.key_prefix, index_buckets=config.index_buckets,
                           publish_depth=config.publish_depth, torch_threads=config.torch_threads,
                           sim=sim_settings(config, model_id), kv_pull_timeout_s=config.kv_pull_timeout_s,
                           vllm=vllm_settings(config), stream_interval_s=config.stream_interval_ms / 1000,
                           audit_dir=config.audit_dir)


def sim_settings(config: AppConfig, model_id: str) -> dict | None:
    """SimEngineConfig fields for a simulated-compute replica, or None for the real engine.
    Vocabulary, context and end-of-sequence ids come from the model directory's JSON files, so
    the gateway's tokeniser and the sim replica agree on what a valid prompt is."""
    if config.engine not in ENGINES:
        raise ValueError(f"unknown engine {config.engine!r}; choose one of {', '.join(ENGINES)}")
    if config.engine != "sim":
        return None
    from dataclasses import asdict

    from replica.default_model import resolve_model
    from replica.engine_config import SimEngineConfig

    sim = SimEngineConfig.for_model_dir(
        resolve_model(config.model), model_id=model_id, block_size=config.block_size,
        num_blocks=config.num_blocks or SIM_DEFAULT_BLOCKS, max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens, max_model_len=config.max_model_len,
        long_prefill_token_threshold=config.long_prefill_token_threshold,
        time_scale=config.time_scale, service=dict(config.sim_service), max_loras=config.max_loras if config.lora_enabled else 0,
        max_cpu_loras=config.max_cpu_loras,
        **dict(config.sim_transfer),
    )
    sim.service_model().scaled(sim.time_scale)  # refuses unknown service fields and bad scales here
    return asdict(sim)


def vllm_settings(config: AppConfig) -> dict | None:
    """VllmSettings fields for a vLLM replica, or None for our engines; refused here, before
    any replica starts, when vLLM could not take them."""
    if config.engine != "vllm":
        return None
    from dataclasses import asdict

    if config.device == "cpu" and config.block_size % VLLM_BLOCK_MULTIPLE:
        raise ValueError(f"engine vllm on CPU needs a block size that is a multiple of {VLLM_BLOCK_MULTIPLE}, got {config.block_size}")
    if config.lora_enabled and config.max_lora_rank not in VLLM_LORA_RANKS:  # vLLM refuses the engine otherwise
        raise ValueError(f"engine vllm takes max_lora_rank in {', '.join(map(str, VLLM_LORA_RANKS))} (vLLM's "
                         f"LoRAConfig), got {config.max_lora_rank}")
    fields = {"cpu_kvcache_gib": max(1, -(-config.kv_cache_mb // 1024)), **dict(config.vllm)}
    return asdict(VllmSettings(**fields))


def app_builder(args: dict) -> serve.Application:
    """Entry for `serve run gateway.app:app_builder key=value ...` and Serve config files."""
    return build_app(AppConfig.from_dict(args))
