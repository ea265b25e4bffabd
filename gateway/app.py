"""Builds the Ray Serve application: Gateway x K (ingress, each with its own router) ->
PrefixCacheReplica x N per model, with the request router chosen by policy name (router/registry.py).

Nothing imported here loads torch: the replica deployment imports its engine when a replica
starts, and a simulated-compute replica (engine "sim") never imports it at all. What differs by
engine (its settings, its Ray actor: a sim replica's small CPU share, a vLLM replica's own
interpreter, docs/vllm.md) comes from the engine's spec (replica/backends/engines.py); nothing
here asks which engine it is.
"""

from __future__ import annotations

import re
from dataclasses import replace

from ray import serve
from ray.serve.config import RequestRouterConfig

from gateway.config import AppConfig, check_role_counts
from gateway.flow.saturation import HEADROOM_PER_REPLICA
from gateway.server import Gateway
from replica.serve.deployment import PrefixCacheReplica
from replica.serve.replica_settings import ReplicaSettings
from router import registry


def router_config(config: AppConfig, model_id: str) -> RequestRouterConfig | None:
    """Ours run inside PrefixGateRouter; Ray's by their import path (None: Serve's default)."""
    entry = registry.get(config.policy)
    if entry.is_ours:
        return RequestRouterConfig(
            request_router_class=registry.OUR_ROUTER_CLASS,
            request_router_kwargs=config.router_options(model_id).to_kwargs(),
        )
    return RequestRouterConfig(request_router_class=entry.ray_router) if entry.ray_router else None


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
    """One model's replicas, bound to their settings, routed by the app's policy. With roles
    (docs/prefill-decode.md) these are its decode replicas, and its prefill replicas are a
    deployment of their own (`-prefill`), bound to the decode one so Serve deploys it with the
    app; nothing routes to it through a handle: decode replicas call its replicas by id."""
    if not config.split:
        return _replicas(config, name, replica_settings(config, config.served_name), config.replicas)
    prefill_name = f"{name}-prefill"
    prefill = replace(replica_settings(config, config.served_name), role="prefill", key_prefix=config.prefill_key_prefix)
    decode = replace(replica_settings(config, config.served_name), role="decode", prefill_deployment=prefill_name)
    return _replicas(config, name, decode, config.decode_replicas,
                     _replicas(config, prefill_name, prefill, config.prefill_replicas, routed=False))


def _replicas(config: AppConfig, name: str, settings: ReplicaSettings, count: int,
              prefill: serve.Application | None = None, routed: bool = True) -> serve.Application:
    model_id = config.served_name
    actor_options = config.engine_spec.actor_options(config)  # the engine's CPUs, GPUs, interpreter
    if config.replica_resources:
        actor_options["resources"] = dict(config.replica_resources)
    options = dict(
        name=name,
        num_replicas=count,
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
    rc = router_config(config, model_id) if routed else None
    if rc is not None:
        options["request_router_config"] = rc
    deployment = serve.deployment(PrefixCacheReplica, **options)
    return deployment.bind(settings.to_dict()) if prefill is None else deployment.bind(settings.to_dict(), prefill)


def replica_settings(config: AppConfig, model_id: str) -> ReplicaSettings:
    """What every replica of the app is built from (passed to each through Serve): its engine's
    settings, built by the engine's spec, and the replica's own."""
    return ReplicaSettings(engine=config.engine_settings(model_id), redis_url=config.redis_url,
                           key_prefix=config.key_prefix, index_buckets=config.index_buckets,
                           publish_depth=config.publish_depth, torch_threads=config.torch_threads,
                           kv_pull_timeout_s=config.kv_pull_timeout_s, handover_timeout_s=config.handover_timeout_s,
                           stream_interval_s=config.stream_interval_ms / 1000, audit_dir=config.audit_dir)


def app_builder(args: dict) -> serve.Application:
    """Entry for `serve run gateway.app:app_builder key=value ...` and Serve config files."""
    check_role_counts(args)
    return build_app(AppConfig.from_dict(args))
