"""The OpenAI-compatible HTTP front, as the Ray Serve ingress deployment.

It applies the chat template and tokenises once, validates everything it can before a replica
sees the request (so bad input is a 4xx, never a 500 or a hang), applies the tenant's rate limits,
holds the request in its queue while the replicas are saturated (by service tier, then fair
share between tenants, then deadline: gateway/flow/; a full queue, a maximum wait or a latency
objective it cannot meet is a 429 with Retry-After),
and streams the replica's tokens back as SSE. A request
whose replica dies or drains is rerun on another replica, or continued there from the tokens
already sent (gateway/migration.py); only when no replica can finish it does it get a 503.
"""


import asyncio
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator

import ray
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError
from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException as StarletteHTTPException

from gateway import metrics as m
from gateway.config import AppConfig
from gateway.errors import APIError, bad_request, http_error
from gateway.flow.admission import Ticket
from gateway.flow.keys import KeySpec, TenantSpec, parse_keys
from gateway.flow.rate_limit import RateLimiter
from gateway.flow.slo import header_objectives, resolve, tier_defaults
from gateway.flow.tiers import TIERS, replica_priority, request_tier
from gateway.health import readiness
from gateway.migration import MigrationPolicy, ResilientStream
from gateway.openai_models import ChatCompletionRequest, CompletionRequest, routing_session
from gateway.request_builder import build_requests
from gateway.request_run import RequestRun
from gateway.served_model import ServedModel
from gateway.slo_watch import SloWatch
from router.protocol.lora import AdapterError, AdapterRef, adapter_ref
from router.protocol.messages import GenerateRequest
from router.protocol.redis_schema import RedisKeys

log = logging.getLogger("prefixgate.gateway")
RETRYABLE = (ray.exceptions.RayError, serve.exceptions.BackPressureError)  # the replica, not the request

app = FastAPI(title="prefixgate", description="OpenAI-compatible gateway with prefix-cache-aware routing")


@app.exception_handler(APIError)
async def _api_error(_: Request, exc: APIError) -> JSONResponse:
    return exc.response()


@app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """Unknown paths (404), wrong methods (405) and other routing errors, in OpenAI's shape."""
    where = f"{request.method} {request.url.path}"
    return http_error(exc.status_code, exc.detail, exc.headers, where).response()


@app.exception_handler(RequestValidationError)
async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
    return bad_request(_describe(exc.errors())).response()


@app.exception_handler(Exception)
async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
    log.exception("unexpected error")
    return APIError(500, "internal error", "server_error").response()


def model_not_found(name: str, served: list[str]) -> APIError:
    return APIError(404, f"The model `{name}` does not exist. Served: {', '.join(served)}", param="model",
                    code="model_not_found")


def _describe(errors) -> str:
    first = errors[0] if errors else {}
    where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
    return f"{where}: {first.get('msg', 'invalid request')}" if where else first.get("msg", "invalid request")


_SCHEMA_DEFS: dict[str, dict] = {}


def _schema(model) -> dict:
    """Request body schema for routes that parse the body themselves; its nested models are
    hoisted into components.schemas (see _openapi) so every $ref resolves."""
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    _SCHEMA_DEFS.update(schema.pop("$defs", {}))
    _SCHEMA_DEFS[model.__name__] = schema
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


def _openapi() -> dict:
    if app.openapi_schema is None:
        from fastapi.openapi.utils import get_openapi

        doc = get_openapi(title=app.title, version="1", description=app.description, routes=app.routes)
        doc.setdefault("components", {}).setdefault("schemas", {}).update(_SCHEMA_DEFS)
        app.openapi_schema = doc
    return app.openapi_schema


app.openapi = _openapi


def _app_name() -> str | None:
    try:
        return serve.get_replica_context().app_name
    except Exception:
        return None


# defined before the class: Serve serializes it when it is decorated, with the globals it names
class _FlowRun(RequestRun):
    """A RequestRun that gives its tenant's seats back to the queue when it closes."""

    ticket: Ticket | None = None

    def close(self) -> None:
        if not self._closed and self.ticket is not None:
            self.model.flow.done(self.ticket)
        super().close()


_CHUNK_START = 'data: {"id": '


async def _with_tier(sse: AsyncIterator[str], tier: str) -> AsyncIterator[str]:
    """The stream's chunks with `service_tier` in each, as OpenAI sends it (error events and
    [DONE] as they are)."""
    field = f'data: {{"service_tier": "{tier}", "id": '
    try:
        async for event in sse:
            yield field + event[len(_CHUNK_START):] if event.startswith(_CHUNK_START) else event
    finally:
        await sse.aclose()


def _app_deleting() -> bool:
    """Whether Serve is deleting this gateway's application (serve.delete, serve.shutdown):
    polled by the queue while requests wait, so they get a 503 at once, not at Serve's timeout."""
    name = _app_name()
    if name is None:
        return False
    mine = serve.status().applications.get(name)
    return mine is None or str(getattr(mine.status, "value", mine.status)).rsplit(".", 1)[-1] == "DELETING"


@serve.deployment
@serve.ingress(app)
class Gateway:
    def __init__(self, replicas: dict[str, DeploymentHandle], config: dict) -> None:
        self.config = AppConfig.from_dict(config)
        # which gateway answered (x-prefixgate-gateway on every completion response, refusals
        # included); also its field in the models' flow-seats hashes
        self.gateway_id = uuid.uuid4().hex[:12]
        self.keys = parse_keys(self.config.api_keys)
        # every model of the app: its replicas, tokenizer, queue and adapters (gateway/served_model.py)
        self.served = {cfg.served_name: ServedModel(cfg, replicas[cfg.served_name], self.keys, _app_deleting,
                                                    self.config.gateways, self.gateway_id)
                       for cfg in self.config.model_configs()}
        keys = RedisKeys(self.config.key_prefix, self.config.index_buckets)
        # an admission's Redis budget: the limiter's own, or the app's Redis timeout when that is longer
        self.limiter = RateLimiter(self.config.redis_url, keys, share=1 / max(self.config.gateways, 1),
                                   timeout_s=max(RateLimiter.TIMEOUT_S, self.config.redis_timeout_s))
        m.start(self)  # Ray metrics: rare-event counters at 0, in-flight gauge kept fresh
        for model in self.served.values():
            model.flow.start()  # its gauges at 0 from the start, when constructed on the event loop
            m.zero_slo(model.name, tuple(self.keys.tenants) or ("anonymous",), TIERS)
        # each tier's default latency objectives (gateway/flow/slo.py): header > key > these
        self.tier_objectives = tier_defaults(self.config.slo_ttft_ms, self.config.slo_tpot_ms, TIERS)
        self._redis = None

    @property
    def in_flight(self) -> int:
        """Requests sent to replicas and not finished, every model's (RequestRun.close lowers it)."""
        return sum(model.flow.ledger.in_flight for model in self.served.values())

    async def __del__(self) -> None:
        """Serve stops this gateway: nothing queued here waits for a replica any more (503)."""
        for model in self.served.values():
            await model.aclose()
        await self.limiter.close()

    # ---- plumbing -------------------------------------------------------------------------
    async def _parse(self, request: Request, schema):
        data = await self._json_object(request)
        try:
            body = schema.model_validate(data)
        except ValidationError as e:
            raise bad_request(_describe(e.errors())) from None
        except RecursionError:
            raise bad_request("request body is nested too deeply") from None
        return body

    async def _json_object(self, request: Request) -> dict:
        """The body as a JSON object: 413 past max_body_bytes, 400 for anything else."""
        length = request.headers.get("content-length")
        if length and length.isdigit() and int(length) > self.config.max_body_bytes:
            raise APIError(413, f"request body over {self.config.max_body_bytes} bytes", code="body_too_large")
        raw = await request.body()
        if len(raw) > self.config.max_body_bytes:
            raise APIError(413, f"request body over {self.config.max_body_bytes} bytes", code="body_too_large")
        try:
            # strict UTF-8 first: json.loads(bytes) would let encoded surrogates through
            data = json.loads(raw.decode("utf-8"))
            json.dumps(data, ensure_ascii=False).encode("utf-8")  # escaped lone surrogates ("\ud800")
        except (ValueError, RecursionError):
            raise bad_request("request body is not valid JSON in UTF-8") from None
        if not isinstance(data, dict):
            raise bad_request("request body must be a JSON object")
        return data

    async def _model(self, name: str) -> tuple[ServedModel, AdapterRef | None]:
        """The served model a request's `model` names, and the LoRA adapter when it names one of
        that model's; 404 `model_not_found` for neither."""
        served = self.served.get(name)
        if served is not None:
            return served, None
        for served in self.served.values():
            ref = await served.adapters.resolve(name) if served.config.lora_enabled else None
            if ref is not None:
                return served, ref
        raise model_not_found(name, [n for s in self.served.values() for n in (s.name, *sorted(s.adapters.known()))])

    def _key(self, request: Request) -> KeySpec | None:
        """The request's API key (None when the app has none configured); 401 for a wrong one."""
        if not self.keys.keys:
            return None
        auth = request.headers.get("authorization", "")
        key = auth[7:].strip() if auth.lower().startswith("bearer ") else ""
        spec = self.keys.keys.get(key)
        if spec is None:
            raise APIError(401, "missing or invalid API key", "authentication_error", code="invalid_api_key")
        return spec

    async def _limit(self, model: str, tenant: TenantSpec, tokens: int) -> dict[str, str]:
        """The tenant's rate limits for a request of `tokens`: OpenAI's x-ratelimit-* headers,
        or a 429 `rate_limit_exceeded` carrying them (gateway/flow/rate_limit.py)."""
        verdict = await self.limiter.admit(tenant, tokens)
        if verdict.allowed:
            return verdict.headers
        m.SHED.labels(model, "rate_limit", tenant.name).inc()
        kind = verdict.refused_by
        unit = "requests per min (RPM)" if kind == "requests" else "tokens per min (TPM)"
        headers = dict(verdict.headers)
        if verdict.retry_after_ms < 0:  # more tokens than the limit itself: waiting never helps
            message = (f"Request too large for {tenant.name} on {unit}: Limit {verdict.limit}, Requested {tokens}. "
                       "Lower max_tokens or the prompt.")
        else:
            wait_s = verdict.retry_after_ms / 1000
            headers["Retry-After"] = str(max(1, math.ceil(wait_s)))
            message = f"Rate limit reached for {tenant.name} on {unit}: Limit {verdict.limit}. Please try again in {wait_s:.3g}s."
        raise APIError(429, message, kind, code="rate_limit_exceeded", headers=headers)

    def _replica_stream(self, served: ServedModel, req: GenerateRequest) -> AsyncIterator[dict]:
        """Chunks of one request; retried or continued on another replica of its model whenever
        one fails (see gateway/migration.py)."""
        handle = served.replicas.options(stream=True, **({"session_id": req.session_id} if req.session_id else {}))
        policy = MigrationPolicy(self.config.retry_attempts, self.config.retry_budget_s,
                                 stall_timeout_s=self.config.stall_timeout_s)
        return ResilientStream(handle.generate.remote, req, policy, RETRYABLE).__aiter__()

    def _generate(self, served: ServedModel, body, prompt_ids: list[int], prompt_text: str, session: str | None,
                  tenant: str | None, max_tokens: int, adapter: AdapterRef | None
                  ) -> tuple[list[AsyncIterator[dict]], list[GenerateRequest]]:
        """The request's n replica streams, not started: nothing reaches a replica before one is
        read; and their requests, whose priority is set once admission has sent them."""
        reqs = build_requests(body, prompt_ids, prompt_text, max_tokens=max_tokens,
                              vocab_size=served.prompts.vocab_size, session=session, tenant=tenant, adapter=adapter)
        return [self._replica_stream(served, req) for req in reqs], reqs

    # ---- endpoints ------------------------------------------------------------------------
    @app.post("/v1/chat/completions", openapi_extra=_schema(ChatCompletionRequest))
    async def chat_completions(self, request: Request):
        return await self._serve(request, ChatCompletionRequest, chat=True)

    @app.post("/v1/completions", openapi_extra=_schema(CompletionRequest))
    async def completions(self, request: Request):
        return await self._serve(request, CompletionRequest, chat=False)

    async def _serve(self, request: Request, schema, chat: bool):
        endpoint = "chat" if chat else "completions"
        arrival = time.monotonic()
        limit_headers: dict[str, str] = {"x-prefixgate-gateway": self.gateway_id}
        label = "none"  # the model_name of its metrics: a served model's, once it names one
        watch: SloWatch | None = None  # its latency objectives' timings, from the queue on
        try:
            key = self._key(request)
            tenant = key.tenant if key is not None else None
            asked = header_objectives(request.headers)  # x-slo-*-ms: a 400 naming the header
            body = await self._parse(request, schema)
            served, adapter = await self._model(body.model)
            label = served.name
            tier = request_tier(body.service_tier, body.priority, *((key.service_tier, key.max_service_tier) if key else ()))
            prompts = served.prompts
            await prompts.ready(served.replicas)  # model facts from a replica, once
            if chat:
                prompt_ids, prompt_text = prompts.chat(body)
            else:
                prompt_ids, prompt_text = prompts.completion(body)
            # the routing session key: x-session-id > prompt_cache_key (OpenAI's field for it) > user
            try:
                session = routing_session(request.headers.get("x-session-id"), body)
            except ValueError as e:
                raise bad_request(str(e), param="x-session-id") from None
            if session and tenant:
                session = f"{tenant}/{session}"  # one tenant cannot steer another's sessions
            max_tokens = prompts.check_length(prompt_ids, body.requested_max_tokens())
            streams, reqs = self._generate(served, body, prompt_ids, prompt_text, session, tenant, max_tokens, adapter)
            cost = len(prompt_ids) + body.n * max_tokens  # tokens: the prompt and the most it may produce
            if key is not None:
                limit_headers |= await self._limit(served.name, self.keys.tenants[tenant], cost)
            objectives = resolve(asked, key.objectives if key is not None else None, self.tier_objectives[tier])
            # the TTFT objective orders the queue and may shed the request (gateway/flow/slo_admission.py)
            ticket = Ticket(tier, tenant, cost, body.n, len(prompt_ids), arrival, ttft_ms=objectives.ttft_ms)
            if objectives.any:  # measured, and routed by (router/slo_policy.py)
                watch = SloWatch(objectives, served.name, tenant or "anonymous", tier, arrival, body.n)
            await served.flow.acquire(ticket)  # waits while the model's replicas are saturated
            for req in reqs:  # the replica's queue keeps the tier, and a tenant's only request goes first
                req.priority = replica_priority(tier, ticket.crowded)
                req.objectives = objectives if objectives.any else None  # the router reads them
        except APIError as e:
            if watch is not None:  # refused by the queue (or shed for its objective): its objectives were missed
                watch.failed(e.status)
            e.headers = {**limit_headers, **e.headers}
            m.REQUESTS.labels(label, endpoint, str(e.status)).inc()
            raise
        m.IN_FLIGHT.set(self.in_flight)
        run = _FlowRun(self, served, body, streams, chat, arrival, len(prompt_ids))
        run.ticket, run.slo = ticket, watch
        try:
            headers = await asyncio.wait_for(run.start(), self.config.first_token_timeout_s)
        except TimeoutError:
            if watch is not None:
                watch.failed(504)
            run.close()
            m.REQUESTS.labels(label, endpoint, "504").inc()
            raise APIError(504, "no replica started this request in time", "server_error", code="timeout",
                           headers=limit_headers) from None
        except APIError as e:
            run.close()
            e.headers = {**limit_headers, **e.headers}
            m.REQUESTS.labels(label, endpoint, str(e.status)).inc()
            raise
        except BaseException:
            run.close()
            raise
        finally:
            served.flow.started(ticket)  # its prompt is no longer pending prefill
        m.REQUESTS.labels(label, endpoint, "200").inc()
        headers |= limit_headers
        if body.stream:
            return StreamingResponse(_with_tier(run.sse(), tier), media_type="text/event-stream", headers=headers)
        try:
            result = await run.collect()
            result["service_tier"] = tier  # the tier that served it, as OpenAI answers
            return JSONResponse(result, headers=headers)
        finally:
            run.close()

    @app.get("/v1/models")
    async def models(self, request: Request):
        """Every model and every adapter, as vLLM lists them (an adapter's parent is its model)."""
        self._key(request)
        data = []
        for served in self.served.values():
            await served.adapters.refresh()
            await served.prompts.ready(served.replicas)  # max_model_len from a replica, once
            data += served.card()
        return {"object": "list", "data": data}

    @app.get("/v1/models/{model_id:path}")
    async def retrieve_model(self, request: Request, model_id: str):
        """OpenAI's retrieve-model: the one card `/v1/models` lists under this id (a model or an
        adapter; ids may hold slashes), else 404 `model_not_found`."""
        listed = await self.models(request)
        for card in listed["data"]:
            if card["id"] == model_id:
                return card
        raise model_not_found(model_id, [card["id"] for card in listed["data"]])

    # ---- LoRA adapters at run time (vLLM's admin endpoints) -------------------------------
    def _admin(self, request: Request) -> None:
        if not self.config.allow_runtime_lora_updating:
            raise APIError(404, f"Invalid URL ({request.method} {request.url.path}): run-time LoRA updating is off "
                           "(--allow-runtime-lora-updating true)", code="not_found")
        key = self._key(request)
        if key is not None and not key.admin:
            raise APIError(403, "this API key may not load or unload adapters (admin: true in the key file)",
                           "permission_error", code="forbidden")

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(self, request: Request):
        """Check the adapter on a replica (its tensors against the model), then serve it from
        every gateway; replicas read it when a request first needs it."""
        self._admin(request)
        data = await self._json_object(request)
        name, path = data.get("lora_name"), data.get("lora_path")
        if not isinstance(name, str) or not isinstance(path, str):
            raise bad_request("lora_name and lora_path are required strings", param="lora_name")
        served = self._base_model(data.get("base_model_name"))
        if name in self.served or any(name in s.adapters.static for s in self.served.values()):
            raise bad_request(f"{name!r} is a model or an adapter configured at start", param="lora_name")
        others = [s.name for s in self.served.values() if s is not served and name in s.adapters.known()]
        if others:
            raise bad_request(f"{name!r} is an adapter of {others[0]}; unload it there first", param="lora_name")
        try:
            ref = adapter_ref(name, path)
        except AdapterError as e:
            raise bad_request(str(e), param="lora_path") from None
        refused = await served.replicas.options(stream=False).add_adapter.remote(ref)
        if refused is not None:
            raise bad_request(refused, param="lora_path")
        await served.adapters.add(ref)
        return Response(f"Success: LoRA adapter '{name}' added successfully.", media_type="text/plain")

    def _base_model(self, name) -> ServedModel:
        """The model an adapter loaded at run time belongs to: `base_model_name` (vLLM's word for it
        in --lora-modules), which may be left out when one model is served."""
        if name is None and len(self.served) == 1:
            return next(iter(self.served.values()))
        if name is None:
            raise bad_request(f"base_model_name is required with several models: one of {', '.join(self.served)}",
                              param="base_model_name")
        served = self.served.get(name) if isinstance(name, str) else None
        if served is None:
            raise APIError(404, f"The model `{name}` does not exist. Served: {', '.join(self.served)}",
                           param="base_model_name", code="model_not_found")
        return served

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(self, request: Request):
        self._admin(request)
        data = await self._json_object(request)
        name = data.get("lora_name")
        if not isinstance(name, str):
            raise bad_request("lora_name is a required string", param="lora_name")
        if any(name in s.adapters.static for s in self.served.values()):
            raise bad_request(f"{name!r} was configured at start and cannot be unloaded", param="lora_name")
        removed = [await s.adapters.remove(name) for s in self.served.values()]
        if not any(removed):
            raise APIError(404, f"The lora adapter '{name}' cannot be found.", param="lora_name", code="model_not_found")
        return Response(f"Success: LoRA adapter '{name}' removed successfully.", media_type="text/plain")

    @app.get("/health")
    @app.get("/health/ready")
    async def health(self):
        """Readiness from fresh state: 200 while a replica answers (`degraded` with named causes when
        Redis is away), 503 only when this gateway cannot serve (gateway/health.py)."""
        ready, body = await readiness(self, _app_name())
        return JSONResponse(body, status_code=200 if ready else 503)

    @app.get("/health/live")
    async def live(self):
        """Liveness: this gateway's event loop answers (dependencies are /health's business)."""
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics(self):
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

