"""The messages between gateway, router and replica: one typed definition, checked on entry.

* `GenerateRequest` (gateway -> replica, through the router): built by the gateway, read by
  the router in the gateway's process, and re-validated field by field where it enters the
  replica (`checked_request`), so a malformed request is refused there, not half-run.
* `RouteDecision` (router -> replica): what the router chose and why, including a pull hint.
  It travels beside the request as the `route` keyword of the replica call, never inside
  the request: a retry is a new call, so it can never carry an earlier attempt's decision.
* The stream chunks (replica -> gateway): msgpack-encoded structs, decoded by the gateway
  with `decode_chunk`, which rejects a chunk that does not match its type.
"""

from __future__ import annotations

import uuid
from typing import Any

import msgspec

from router.protocol.lora import AdapterRef
from router.protocol.sampling import SamplingParams
from router.protocol.slo import LatencyPrediction, Objectives

# A replica with nothing else to send for this long sends an AliveChunk, so the gateway can
# tell a request that is slow (queued, long prefill) from a replica that stopped answering
# (frozen, wedged, dead without Ray noticing) and move the request after its stall timeout.
KEEPALIVE_S = 2.0
# A replica sends a stream's tokens in chunks: the first at once, then everything produced since
# the last send, at most once per this interval (the end at once). One chunk costs the same fixed
# work on the way to the client whatever it holds; measured with `prefixgate bench serving`
# (docs/benchmarks.md). 0: one chunk per engine output.
STREAM_INTERVAL_S = 0.05


# How long a replica acting on a pull hint waits for the holder's K/V before it computes the
# prefix itself (docs/kv-pull.md): AppConfig.kv_pull_timeout_s, replica settings, the puller.
KV_PULL_TIMEOUT_S = 5.0
# a decode replica waits this long for a prefill replica's hand-over (its queue, prefill and copy), then computes
HANDOVER_TIMEOUT_S = 60.0


class KvSource(msgspec.Struct, frozen=True):
    """A pull hint (docs/kv-pull.md): another replica holds the prompt's leading blocks, so
    the replica taking the request copies their K/V from it instead of computing them. The
    receiver recomputes the hashes from the prompt itself; a failed pull means recompute."""

    replica_id: str  # the holder, as in the index (Serve's replica unique id)
    num_blocks: int  # leading full blocks of the prompt to pull from it


class RouteDecision(msgspec.Struct, frozen=True, omit_defaults=True):
    """Our router's choice for one request: the one routing decision type. A policy returns it
    (router/policy.py), the router keeps it (router/decider.py `Routed`) and passes it to the
    replica beside the request, the gateway reports it (`as_dict`), and the live audit records
    it (router/protocol/audit_log.py `Decision.route`). Frozen: a change is a new struct
    (`msgspec.structs.replace`)."""

    policy: str  # the policy's canonical name (router/policy_table.py)
    reason: str  # one of router/policy.py REASONS
    replica_id: str  # the replica the policy chose (Ray may place it on a fallback)
    matched_blocks: int = 0  # leading blocks of the prompt the index says that replica holds
    pull: KvSource | None = None  # copy these leading blocks from another replica first
    # a prefill replica (docs/prefill-decode.md) to compute the prompt and hand its K/V over to
    # the decode replica `replica_id`: the prompt's uncached part there passed the threshold
    prefill: KvSource | None = None
    # the router's p90 TTFT and TPOT for the request on `replica_id` (a request with objectives,
    # decided with a warm latency model: router/slo_policy.py); the gateway measures its coverage
    prediction: LatencyPrediction | None = None

    def as_dict(self) -> dict[str, Any]:
        """The decision as the gateway reports it (`prefixgate.route` in responses)."""
        out: dict[str, Any] = {"policy": self.policy, "reason": self.reason, "replica": self.replica_id,
                               "matched_blocks": self.matched_blocks}
        if self.pull is not None:
            out["pull_from"], out["pull_blocks"] = self.pull.replica_id, self.pull.num_blocks
        if self.prefill is not None:
            out["prefill_from"], out["prefill_blocks"] = self.prefill.replica_id, self.prefill.num_blocks
        if self.prediction is not None:
            out["predicted_ttft_ms"] = round(self.prediction.ttft_ms, 1)
            out["predicted_tpot_ms"] = round(self.prediction.tpot_ms, 1)
            out["prediction_calibrated"] = self.prediction.ttft_calibrated
        return out


class GenerateRequest(msgspec.Struct, kw_only=True):
    """One request, from the gateway's parse to the engine's Sequence (vLLM's EngineCoreRequest,
    nano-vllm's Sequence): built once by the gateway (gateway/request_builder.py), checked once
    where it enters a replica process (`checked_request`), and handed as it is to the backend
    (`EngineBackend.generate(request)`) and to the engine core (`EngineCore.add`). The prompt ids
    are never copied on the way; the Sequence takes its one working copy. A field a later
    feature needs (a prefill/decode hand-over) is added here, with a default."""

    prompt_token_ids: list[int]
    params: SamplingParams
    request_id: str = msgspec.field(default_factory=lambda: uuid.uuid4().hex)
    prompt: str = ""  # rendered prompt text: read only by Ray's PrefixCacheAffinityRouter baseline
    session_id: str | None = None
    cache_salt: str | None = None  # tenant salt: tenants never share cached blocks
    # the LoRA adapter the request's `model` names (None: the base model); a replica without it
    # reads it from its path first (adapters loaded at run time reach replicas this way)
    adapter: AdapterRef | None = None
    # vLLM's scheduling priority, lower first: the gateway's service tier, then whether the
    # tenant had other requests in flight (gateway/flow/tiers.py replica_priority)
    priority: int = 0
    # a migrated stream (gateway/migration.py): output another replica generated and the client
    # already got (token ids, and how many characters of their text were sent; None: all of it);
    # the replica continues after them
    prefix_output_token_ids: list[int] = msgspec.field(default_factory=list)
    prefix_text_len: int | None = None
    # the router's pull hint, as the replica that runs the request acts on it: set on entry from
    # the decision that travels beside the request (never by the gateway, so a retry cannot carry
    # an earlier attempt's hint); our engine gets the pulled K/V itself, the sim engine models it
    pull: KvSource | None = None
    # its latency objectives (gateway/flow/slo.py resolves them; None: it has none): the router
    # routes it by them (router/slo_policy.py); a request without them is routed as before
    objectives: Objectives | None = None

    @property
    def continuing(self) -> bool:
        """A stream migrated from another replica (it continues after prefix_output_token_ids)."""
        return bool(self.prefix_output_token_ids)


def checked_request(request: Any) -> GenerateRequest:
    """`request` checked as it enters a replica process: Ray unpickles whatever was sent, so every
    field is re-validated by its type (SamplingParams' rules included), and a wrong one raises
    msgspec.ValidationError naming it. The prompt ids are not copied: the list is checked for its
    type here, and each id against the vocabulary where the engine checks its limits
    (replica/core/engine_types.py `refuse_unfit`), once."""
    if not isinstance(request, GenerateRequest):
        return msgspec.convert(request, GenerateRequest)
    ids = request.prompt_token_ids
    if type(ids) is not list:
        raise msgspec.ValidationError(f"Expected `array`, got `{type(ids).__name__}` - at `$.prompt_token_ids`")
    rest = msgspec.structs.asdict(request)
    rest["prompt_token_ids"] = []
    checked = msgspec.convert(msgspec.to_builtins(rest), GenerateRequest)
    checked.prompt_token_ids = ids
    return checked


# ---- what a replica streams back, one chunk at a time --------------------------------------
class StartChunk(msgspec.Struct, tag="start"):
    """First chunk of every attempt: which replica took the request, and the router's reason."""

    replica: str
    route: RouteDecision | None = None


class DeltaChunk(msgspec.Struct, tag="delta"):
    token_ids: list[int]
    text: str
    # when the request asked for logprobs, one entry per token in token_ids:
    # {"token_id", "token", "bytes", "logprob", "top": [{"token_id", "token", "bytes", "logprob"}]}
    logprobs: list[dict[str, Any]] | None = None


class EndChunk(msgspec.Struct, tag="end"):
    finish_reason: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    # replica failures the gateway survived on the way (gateway/migration.py fills it in)
    migrations: list[dict[str, Any]] = msgspec.field(default_factory=list)


class ErrorChunk(msgspec.Struct, tag="error"):
    code: int  # HTTP status the gateway answers with: 400 bad request, 503 replica failed
    message: str
    retry: bool = False  # the request may continue on another replica (this one is draining or failed)
    exhausted: bool = False  # set by the gateway: every attempt failed (a 503 with Retry-After)


class AliveChunk(msgspec.Struct, tag="alive"):
    """Nothing to send yet, but the replica is working on the request (see KEEPALIVE_S)."""


Chunk = StartChunk | DeltaChunk | EndChunk | ErrorChunk | AliveChunk

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Chunk)


def encode_chunk(chunk: Chunk) -> bytes:
    return _encoder.encode(chunk)


def decode_chunk(data: bytes) -> Chunk:
    """A chunk as it enters the gateway: a malformed one raises msgspec.ValidationError."""
    return _decoder.decode(data)
