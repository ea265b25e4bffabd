"""One model behind the gateway: its replicas, its tokenizer, its queue and its LoRA adapters.

A gateway serves every model of the app (`models`, or the one `model`); each has its own
replica deployment (with its own router state and Redis keys) and its own flow controller,
since one model's saturated replicas say nothing about another's. Tenants' rate limits span
the models (gateway/flow/rate_limit.py is the gateway's, not a model's).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable

from ray.serve.handle import DeploymentHandle

from gateway.adapters import AdapterRegistry
from gateway.config import AppConfig
from gateway.flow.admission import FlowController
from gateway.flow.keys import KeyTable
from gateway.flow.saturation import HEADROOM_PER_REPLICA, Capacity, HeartbeatReader
from gateway.flow.slo_admission import TtftFloor
from gateway.tokenization import PromptBuilder
from router.protocol.lora import adapter_ref
from router.protocol.redis_schema import RedisKeys


class ServedModel:
    def __init__(self, config: AppConfig, replicas: DeploymentHandle, keys: KeyTable,
                 shutting_down: Callable[[], bool], gateways: int, gateway_id: str = "") -> None:
        self.config = config  # the model's own: model_configs() of the app's
        self.name = config.served_name
        self.replicas = replicas
        self.prompts = PromptBuilder(config)
        most = (config.autoscaling or {}).get("max_replicas", config.routed_replicas)
        self.capacity = most * config.max_ongoing_requests + config.max_queued_requests
        self.flow = self._flow_controller(most, keys, shutting_down, gateways, gateway_id)
        redis_keys = RedisKeys(config.key_prefix, config.index_buckets)
        static = {name: adapter_ref(name, path) for name, path in config.lora.items()}
        self.adapters = AdapterRegistry(static, config.redis_url, redis_keys.lora_adapters)

    def _flow_controller(self, most: int, keys: KeyTable, shutting_down: Callable[[], bool], gateways: int,
                         gateway_id: str) -> FlowController:
        c = self.config
        prefill = c.flow_prefill_tokens or 2 * c.max_num_batched_tokens
        # flow control off: the old bound (replicas x max_ongoing_requests + max_queued_requests in
        # flight); on: the replicas' seats, shared between the gateways (Serve's proxies spread
        # requests over them), so K gateways together send what the replicas run, not K times it
        seats = -(-most * c.max_ongoing_requests // max(gateways, 1)) if c.flow_control else self.capacity
        # the replicas' seat more each (gateway/app.py), shared the same way: for tenants within their share
        headroom = -(-most * HEADROOM_PER_REPLICA // max(gateways, 1)) if c.flow_control else 0
        # rounded up, the gateways' shares can add up to more than the replicas take: bound the sum too
        shared = c.flow_control and gateways > 1
        fleet_seats, fleet_headroom = (most * c.max_ongoing_requests, most * HEADROOM_PER_REPLICA) if shared else (0, 0)
        reader = floor = None
        if c.flow_control and c.redis_url:
            reader = HeartbeatReader(c.redis_url, RedisKeys(c.key_prefix, c.index_buckets), c.load_refresh_s)
            # the replicas' step models on the heartbeats it reads: the TTFT floor admission sheds by
            floor = TtftFloor()
            reader.on_read = floor.observe
        tenants = keys.tenants
        controller = FlowController(
            Capacity(seats, prefill, c.flow_replica_waiting, c.flow_kv_free_min, shared=gateways > 1,
                     headroom=headroom, fleet_max_in_flight=fleet_seats, fleet_headroom=fleet_headroom),
            c.max_queued_requests,
            {"priority": c.queue_wait_priority_s, "default": c.queue_wait_default_s, "flex": c.queue_wait_flex_s},
            c.routed_replicas, weight=lambda flow: tenants[flow].weight if flow in tenants else 1.0, reader=reader,
            tenants=tuple(tenants) or ("anonymous",), shutting_down=shutting_down, enabled=c.flow_control,
            model=self.name, forecast=floor.best_ttft_s if floor is not None else None, slo_shed=c.slo_shed,
        )
        if reader is not None and gateways > 1:  # tenants' shares judged over every gateway's seats
            reader.share, reader.gateway_id = controller.ledger.seats, gateway_id or uuid.uuid4().hex
        return controller

    def card(self) -> list[dict]:
        """This model and its adapters as /v1/models lists them (vLLM's fields: an adapter's
        parent is its base model); after `prompts.ready`."""
        limit = self.prompts.max_model_len
        base = {"id": self.name, "object": "model", "created": 0, "owned_by": "prefixgate",
                "root": self.config.model or self.name, "parent": None, "max_model_len": limit}
        adapters = [{"id": ref.name, "object": "model", "created": 0, "owned_by": "prefixgate", "root": ref.path,
                     "parent": self.name, "max_model_len": limit}
                    for ref in sorted(self.adapters.known().values(), key=lambda r: r.name)]
        return [base, *adapters]

    async def aclose(self) -> None:
        await self.flow.aclose()
        await self.adapters.close()
