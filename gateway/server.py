"""The OpenAI-compatible HTTP front, as the Ray Serve ingress deployment.

It applies the chat template and tokenises once, validates everything it can before a replica
sees the request (so bad input is a 4xx, never a 500 or a hang), admits up to a queue bound
(beyond it: 429 with Retry-After), and streams the replica's tokens back as SSE. A request
whose replica dies or drains is rerun on another replica, or continued there from the tokens
already sent (gateway/migration.py); only when no replica can finish it does it get a 503.
"""


import asyncio
import json
import logging
import time
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
from gateway.health import readiness
from gateway.migration import MigrationPolicy, ResilientStream
from gateway.openai_models import ChatCompletionRequest, CompletionRequest, routing_session
from gateway.request_run import RequestRun
from gateway.tokenization import PromptBuilder
from router.protocol.messages import GenerateRequest
from router.protocol.sampling import InvalidParam, SamplingParams

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


@serve.deployment
@serve.ingress(app)
class Gateway:
    def __init__(self, replicas: DeploymentHandle, config: dict) -> None:
        self.config = AppConfig.from_dict(config)
        self.replicas = replicas
        self.prompts = PromptBuilder(self.config)
        self.model_name = self.prompts.model_name
        self.in_flight = 0
        most = (self.config.autoscaling or {}).get("max_replicas", self.config.replicas)
        self.capacity = most * self.config.max_ongoing_requests + self.config.max_queued_requests
        m.start(self)  # Ray metrics: rare-event counters at 0, in-flight gauge kept fresh
        self._redis = None

    # ---- plumbing -------------------------------------------------------------------------
    async def _parse(self, request: Request, schema):
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
        try:
            body = schema.model_validate(data)
        except ValidationError as e:
            raise bad_request(_describe(e.errors())) from None
        except RecursionError:
            raise bad_request("request body is nested too deeply") from None
        if body.model != self.model_name:
            raise APIError(404, f"model '{body.model}' does not exist; this gateway serves '{self.model_name}'",
                           param="model", code="model_not_found")
        return body

    def _tenant(self, request: Request) -> str | None:
        if not self.config.api_keys:
            return None
        auth = request.headers.get("authorization", "")
        key = auth[7:].strip() if auth.lower().startswith("bearer ") else ""
        tenant = self.config.api_keys.get(key)
        if tenant is None:
            raise APIError(401, "missing or invalid API key", "authentication_error", code="invalid_api_key")
        return tenant

    def _admit(self, n: int) -> None:
        if self.in_flight + n > self.capacity:
            m.REJECTED.inc()
            raise APIError(429, "replicas are saturated; retry shortly", "rate_limit_error",
                           code="server_overloaded", headers={"Retry-After": "1"})

    def _replica_stream(self, req: GenerateRequest) -> AsyncIterator[dict]:
        """Chunks of one request; retried or continued on another replica whenever one fails
        (see gateway/migration.py)."""
        handle = self.replicas.options(stream=True, **({"session_id": req.session_id} if req.session_id else {}))
        policy = MigrationPolicy(self.config.retry_attempts, self.config.retry_budget_s,
                                 stall_timeout_s=self.config.stall_timeout_s)
        return ResilientStream(handle.generate.remote, req, policy, RETRYABLE).__aiter__()

    async def _generate(self, body, prompt_ids: list[int], prompt_text: str, session: str | None,
                        tenant: str | None) -> list[AsyncIterator[dict]]:
        max_tokens = self.prompts.check_length(prompt_ids, body.requested_max_tokens())
        streams = []
        for i in range(body.n):
            params = {"max_tokens": max_tokens, "stop": list(body.stop or [])}
            if body.temperature is not None:
                params["temperature"] = body.temperature
            if body.top_p is not None:
                params["top_p"] = body.top_p
            if body.top_k is not None and body.top_k > 0:
                params["top_k"] = body.top_k
            if body.seed is not None:
                params["seed"] = (body.seed + i) % 2**63
            if body.n > 1 and body.temperature is None:
                params["temperature"] = 1.0  # n copies of a greedy answer would be identical
            params.update(body.engine_params())  # penalties, logprobs, response_format
            try:  # the replicas' own rules, checked here: a bad value is a 400 naming its field
                sampling = SamplingParams(**params)
            except InvalidParam as e:
                raise bad_request(str(e), param=e.param) from None
            req = GenerateRequest(prompt_token_ids=list(prompt_ids), params=sampling, prompt=prompt_text,
                                  session_id=session, cache_salt=tenant)
            streams.append(self._replica_stream(req))
        return streams

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
        try:
            tenant = self._tenant(request)
            body = await self._parse(request, schema)
            await self.prompts.ready(self.replicas)  # model facts from a replica, once
            if chat:
                prompt_ids, prompt_text = self.prompts.chat(body)
            else:
                prompt_ids, prompt_text = self.prompts.completion(body)
            # the routing session key: x-session-id > prompt_cache_key (OpenAI's field for it) > user
            session = routing_session(request.headers.get("x-session-id"), body)
            if session and tenant:
                session = f"{tenant}/{session}"  # one tenant cannot steer another's sessions
            self._admit(body.n)
            streams = await self._generate(body, prompt_ids, prompt_text, session, tenant)
        except APIError as e:
            m.REQUESTS.labels(endpoint, str(e.status)).inc()
            raise
        self.in_flight += body.n
        m.IN_FLIGHT.set(self.in_flight)
        run = RequestRun(self, body, streams, chat, arrival, len(prompt_ids))
        try:
            headers = await asyncio.wait_for(run.start(), self.config.first_token_timeout_s)
        except TimeoutError:
            run.close()
            m.REQUESTS.labels(endpoint, "504").inc()
            raise APIError(504, "no replica started this request in time", "server_error", code="timeout") from None
        except APIError as e:
            run.close()
            m.REQUESTS.labels(endpoint, str(e.status)).inc()
            raise
        except BaseException:
            run.close()
            raise
        m.REQUESTS.labels(endpoint, "200").inc()
        if body.stream:
            return StreamingResponse(run.sse(), media_type="text/event-stream", headers=headers)
        try:
            return JSONResponse(await run.collect(), headers=headers)
        finally:
            run.close()

    @app.get("/v1/models")
    async def models(self, request: Request):
        self._tenant(request)
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0, "owned_by": "prefixgate"}]}

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
