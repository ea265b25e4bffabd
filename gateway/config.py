"""Every setting of a served app, defined once: Serve config files' `args`, the `prefixgate serve`
flags (generated from these fields by gateway/config_cli.py), tests and the stack share it.

Each field carries its one default (the engine's and the router's come from where those
components define them: replica/core/engine_types.py, router/router_options.py) and its help text.
Adding a serve option is adding one field here (docs/configuration.md).
"""

from __future__ import annotations

import os
import re
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from replica.backends.engine_protocol import ENGINE_NAMES
from replica.backends.engine_spec import EngineSpec
from replica.backends.engines import EngineSettings, engine_spec
from replica.backends.model_spec import MODEL_DTYPES
from replica.engine_config import (
    KV_CACHE_MB,
    LONG_PREFILL_TOKEN_THRESHOLD,
    MAX_CPU_LORAS,
    MAX_LORA_RANK,
    MAX_LORAS,
    MAX_NUM_BATCHED_TOKENS,
    MAX_NUM_SEQS,
)
from router.protocol.messages import (
    HANDOVER_TIMEOUT_S,
    KEEPALIVE_S,
    KV_PULL_TIMEOUT_S,
    STREAM_INTERVAL_S,
)
from router.registry import aliases as policy_aliases
from router.registry import help_text as policy_help
from router.registry import policy_names
from router.router_options import RouterOptions

_ROUTER = RouterOptions()  # the router's defaults, defined in router/router_options.py


def check_role_counts(given: dict, where: str = "") -> None:
    """`replicas` set beside role counts, as a user gave them (the command line, a Serve config's
    args, a models entry: where they enter, since a config passed on carries every field), is
    refused, naming both: with roles, each role's count is its own."""
    if "replicas" in given and any(given.get(k) for k in ROLE_COUNTS):
        raise ValueError(f"{where}replicas is set together with prefill_replicas / decode_replicas: with roles, give "
                         "each role's count instead of replicas")


def setting(default: Any = MISSING, *, help: str, factory: Any = None, flag: str | None = None,
            cli: str = "auto", choices: tuple[str, ...] | None = None, raw_keys: bool = False) -> Any:
    """A field with its help text. `flag`: its `prefixgate serve` flag when not `--field-name`;
    `cli`: "auto" (a flag), "json-file" (the flag names a JSON file holding the value),
    "path-or-models" (`--model`: PATH, or NAME=PATH per model) or "none";
    `choices`: the values the flag accepts (checked when the command line is parsed); `raw_keys`:
    a dict whose KEY=VALUE keys are taken as written (Ray resource names), not as field names
    (where `decode-step-s` means `decode_step_s`)."""
    metadata = {"help": help, "flag": flag, "cli": cli, "choices": choices, "raw_keys": raw_keys}
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


ENGINE_DTYPES = MODEL_DTYPES  # what our engine loads a model in (replica/backends/model_spec.py)
# what one entry of `models` may set: its name and directory, and the settings of its replicas
# (the rest of the app's settings apply to every model alike)
MODEL_KEYS = ("name", "path", "replicas", "engine", "lora_adapters", "autoscaling", "block_size", "num_blocks",
              "kv_cache_mb", "max_model_len", "max_num_seqs", "prefill_replicas", "decode_replicas")
ROLE_COUNTS = ("prefill_replicas", "decode_replicas")


@dataclass
class AppConfig:
    # the model and its replicas
    model: str | None = setting(None, cli="path-or-models", help="local Hugging Face model directory (default: bundled SmolLM2-135M-Instruct); "
                                "NAME=PATH, repeatable: several models behind one gateway (`models`)")
    model_name: str | None = setting(None, help="served model name and block-hash identity (default: the directory name)")
    models: list[dict] = setting(factory=list, cli="none", help="several models behind one gateway, each its own replicas, "
                                 f"router state and index keys: [{{name, path, {', '.join(MODEL_KEYS[2:])}}}] (docs/models.md)")
    engine: str = setting("model", choices=tuple(ENGINE_NAMES), help="model: our engine; sim: real cache, scheduler and publisher, modelled "
                                        "compute, no torch; vllm: vLLM's engine in each replica (docs/vllm.md)")
    replicas: int = setting(2, help="replica count (replaced by `autoscaling` when that is set)")
    autoscaling: dict | None = setting(None, help="Serve autoscaling_config for the replicas (min_replicas, max_replicas, "
                                                  "target_ongoing_requests, ...); replaces `replicas` (infra/serve-autoscale.yaml)")
    # prefill/decode roles (docs/prefill-decode.md): each role its own deployment; 0 and 0: replicas do both
    prefill_replicas: int = setting(0, help="replicas that only compute prompts and hand their K/V to decode replicas "
                                            "(with decode_replicas; replaces `replicas`)")
    decode_replicas: int = setting(0, help="replicas that take requests and decode, prompts past pd_threshold_tokens "
                                           "handed over from a prefill replica (with prefill_replicas; replaces `replicas`)")
    pd_threshold_tokens: int = setting(_ROUTER.pd_threshold_tokens, help="with roles: a prompt whose part the decode "
                                       "replica does not hold is longer than this is computed on a prefill replica")
    handover_timeout_s: float = setting(HANDOVER_TIMEOUT_S, help="with roles: a decode replica waits this long for a "
                                        "hand-over (the prefill replica's queue, prefill and copy), then computes the prompt itself")
    device: str = setting("cpu", help="torch device of our engine")
    torch_threads: int = setting(1, flag="--replica-threads", help="compute threads per replica (torch's, or vLLM's OMP threads)")
    replica_num_cpus: float = setting(0.5, flag="--replica-cpus", help="Ray CPUs reserved per replica")
    replica_num_gpus: float = setting(0.0, flag="--replica-gpus", help="Ray GPUs reserved per replica")
    replica_resources: dict[str, float] = setting(factory=dict, raw_keys=True, help='custom Ray resources per replica, e.g. {"replica_node": 0.01}')
    # the engine
    block_size: int | None = setting(None, help="tokens per K/V block (default: 16; 32 on engine vllm, whose CPU backend needs a multiple of 32)")
    num_blocks: int | None = setting(None, help="K/V blocks per replica (default: from kv_cache_mb)")
    kv_cache_mb: int = setting(KV_CACHE_MB, help="K/V pool per replica, MiB, when num_blocks is not given")
    kv_host_mb: int = setting(0, help="host-memory K/V tier per replica, MiB: what the pool evicts moves there and "
                                      "is moved back on a hit instead of recomputed (0: none; docs/kv-tiers.md)")
    kv_disk_mb: int = setting(0, help="local-disk K/V tier per replica, MiB, below the host tier (0: none)")
    kv_disk_dir: str | None = setting(None, help="directory of the disk tier's file (default: the temp directory)")
    dtype: str | None = setting(None, choices=ENGINE_DTYPES,
                                help="our engine's weights and K/V dtype (default: float32 on CPU, bf16 on GPU)")
    compile: bool = setting(False, help="our engine: torch.compile the model's forward at replica start (cached across "
                                        "restarts under ~/.cache/prefixgate/inductor; docs/benchmarks.md)")
    max_num_seqs: int = setting(MAX_NUM_SEQS, help="sequences running at once per replica")
    max_num_batched_tokens: int = setting(MAX_NUM_BATCHED_TOKENS, help="tokens per engine step (the prefill chunk, decodes included)")
    long_prefill_token_threshold: int = setting(LONG_PREFILL_TOKEN_THRESHOLD, help="our and the sim engine: most prompt tokens of one "
                                                "request per step while others wait, so a short prompt starts within one "
                                                "step of a long prefill (0: no cap; vLLM's: --vllm engine_args='{\"long_prefill_token_threshold\": N}')")
    max_model_len: int | None = setting(4096, help="longest prompt + output, tokens (None: the model's)")
    # LoRA adapters (docs/lora.md)
    lora: dict[str, str] = setting(factory=dict, raw_keys=True, help="LoRA adapters served from the start, NAME=PATH (a PEFT "
                                   "adapter directory; a request's `model` names the adapter)")
    enable_lora: bool = setting(False, help="run requests under LoRA adapters even with none at start (adapters loaded at run time)")
    max_loras: int = setting(MAX_LORAS, help="LoRA adapters in one batch per replica")
    max_lora_rank: int = setting(MAX_LORA_RANK, help="largest LoRA rank served (higher: refused)")
    max_cpu_loras: int = setting(MAX_CPU_LORAS, help="LoRA adapters resident in host memory per replica (the rest "
                                                     "read from disk when a request needs them, least recently used out)")
    allow_runtime_lora_updating: bool = setting(False, help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter "
                                                            "(vLLM's; with API keys, only for keys with admin: true)")
    vllm: dict = setting(factory=dict, help="engine vllm: VllmSettings overrides (replica/backends/vllm_settings.py)")
    vllm_python: str | None = setting(None, help="engine vllm: the replicas' interpreter (default: .venv-vllm beside the checkout)")
    time_scale: float = setting(1.0, help="engine sim: run the service model this many times faster in wall time")
    sim_service: dict[str, float] = setting(factory=dict, help="engine sim: ServiceModel field overrides (router/costs/service.py)")
    sim_transfer: dict[str, float] = setting(factory=dict, help="engine sim: pull, tier and adapter-read model (SimEngineConfig kv_bytes_per_token, pull_*, "
                                                                  "host_blocks, disk_blocks, kv_host_bytes_per_s, kv_disk_bytes_per_s, lora_load_ms)")
    sim_replica_num_cpus: float = setting(0.05, flag="--sim-replica-cpus", help="engine sim: Ray CPUs reserved per replica (many fit on a core)")
    # routing (router/router_options.py defines these defaults)
    policy: str = setting(_ROUTER.policy, choices=(*policy_names(), *policy_aliases()), help=f"routing policy (docs/policies.md): {policy_help()}")
    policy_options: dict = setting(factory=dict, help="the policy class's keyword arguments (router/policy.py), e.g. miss_weight=8")
    sampled_replicas: int = setting(_ROUTER.sampled_replicas, help="replicas scored for load alone, besides the matched and the session's")
    publish_depth: int = setting(_ROUTER.publish_depth, help="leading blocks of a prompt that are hashed, published and matched")
    session_ttl_s: int = setting(_ROUTER.session_ttl_s, help="how long a session's last replica is remembered (sliding)")
    load_refresh_s: float = setting(_ROUTER.load_refresh_s, help="each router re-reads the replicas' heartbeats this often")
    lora_aware: bool = setting(_ROUTER.lora_aware, help="route a LoRA adapter's requests by its own prefixes and by which "
                               "replicas hold it (false: as the base model's, as routers that do not know adapters "
                               "do; a baseline for `prefixgate bench lora-routing`)")
    seed: int | None = setting(_ROUTER.seed, help="seed of the policies' random draws (None: unseeded)")
    audit_dir: str | None = setting(_ROUTER.audit_dir, help="write the live routing audit's records here: each router "
                                    "its decisions, each replica its block events and outcomes (docs/routing-audit.md; "
                                    "read them with `prefixgate loadtest audit DIR`)")
    # Redis and the index
    redis_url: str | None = setting("redis://127.0.0.1:6379/0", cli="none",
                                    help="the index's Redis (serve: --redis-url, else $REDIS_URL, else a local one it starts)")
    key_prefix: str = setting(_ROUTER.key_prefix, help="Redis key prefix: several deployments can share one Redis")
    index_buckets: int = setting(_ROUTER.index_buckets, help="hash tags of the block index; replicas and routers get this one value")
    redis_timeout_s: float = setting(_ROUTER.redis_timeout_s, help="per routing lookup; a lost connection or 3 timeouts "
                                                                   "in a row: Redis skipped for 1 s. Also each shared "
                                                                   "rate-limit admission's budget when above 0.25 s")
    # the gateway
    gateways: int = setting(1, help="ingress replicas, each with its own router (they share only Redis)")
    gateway_num_cpus: float = setting(0.25, help="Ray CPUs reserved per gateway")
    gateway_resources: dict[str, float] = setting(factory=dict, raw_keys=True, help='custom Ray resources per gateway, e.g. {"head_node": 0.01}')
    max_ongoing_requests: int = setting(32, help="per replica, in flight at once (Ray Serve's bound)")
    max_queued_requests: int = setting(64, help="per gateway and model: flow control on, the queue's size (past it the "
                                               "newest of the lowest tier's most over-share tenant gets a 429 with "
                                               "Retry-After); off, the requests in flight beyond what the replicas run")
    default_max_tokens: int = setting(256, help="max_tokens of a request that gives none")
    max_body_bytes: int = setting(4 * 2**20, help="largest request body accepted (413 beyond)")
    api_keys: dict[str, str | dict] = setting(factory=dict, cli="json-file",
                                              help="API key -> tenant, each tenant its own cache salt; set: 401 for others "
                                                   "(serve: a JSON file). A key may instead map to {tenant, weight, "
                                                   "service_tier, max_service_tier, rpm, tpm, admin} (docs/flow-control.md)")
    first_token_timeout_s: float = setting(300.0, help="a request not routed and started by then gets a 504")
    retry_attempts: int = setting(6, help="replica calls per request when replicas fail (retry / stream migration)")
    retry_budget_s: float = setting(90.0, help="from a request's first replica failure: then 503 with Retry-After")
    stall_timeout_s: float = setting(30.0, help="a replica silent this long mid-request (not even a keepalive) is taken "
                                                "for frozen and the request moves on (0: off)")
    stream_interval_ms: float = setting(STREAM_INTERVAL_S * 1000, help="a replica sends a stream's tokens at most once per "
                                        "interval, all produced since the last send (the first and the last at once; 0: every output)")
    drain_timeout_s: float = setting(20.0, help="a stopping replica's requests get this long to finish; the rest move on")
    kv_pull_timeout_s: float = setting(KV_PULL_TIMEOUT_S, help="a replica acting on a pull hint waits this long for the holder, then computes")
    # flow control (gateway/flow/, docs/flow-control.md)
    flow_control: bool = setting(True, help="hold requests in the gateway while the replicas are saturated and send them "
                                           "by service tier, then fair share of tokens between tenants (false: send "
                                           "up to replicas x max_ongoing_requests + max_queued_requests, then 429)")
    queue_wait_priority_s: float = setting(30.0, help="longest a service_tier=priority request waits in the gateway's queue (then 429)")
    queue_wait_default_s: float = setting(30.0, help="longest a default (or auto) tier request waits in the gateway's queue (then 429)")
    queue_wait_flex_s: float = setting(300.0, help="longest a service_tier=flex request waits in the gateway's queue (then 429)")
    # latency objectives (gateway/flow/slo.py, docs/flow-control.md "Latency objectives")
    slo_ttft_ms: dict[str, int] = setting(factory=dict, help="default time-to-first-token objective per service tier, "
                                          "ms (priority, default, flex; e.g. priority=500), for requests whose header "
                                          "(x-slo-ttft-ms) and API key state none: measured, routed by, ordering the "
                                          "queue and, with slo_shed, shedding")
    slo_tpot_ms: dict[str, int] = setting(factory=dict, help="default time-per-output-token objective per service tier, "
                                          "ms (as slo_ttft_ms; header x-slo-tpot-ms)")
    slo_shed: bool = setting(True, help="flow control on: refuse (429 with Retry-After) a default or flex request "
                                        "whose TTFT objective the replicas' latency models say no replica can meet, or "
                                        "whose objective's deadline passed while it waited (priority requests wait instead; "
                                        "false: objectives order the queue and route, never shed)")
    flow_prefill_tokens: int | None = setting(None, help="per replica: prompt tokens sent and not yet started (pending "
                                                         "prefill) past which requests wait in the gateway; a replica "
                                                         "whose heartbeat shows as many is full (default: 2 x max_num_batched_tokens)")
    flow_replica_waiting: int = setting(2, help="a replica whose heartbeat shows this many requests in its own queue is full")
    flow_kv_free_min: float = setting(0.02, help="a replica with less than this fraction of its K/V blocks free (or "
                                                 "holding cached K/V no request uses) is full")

    @classmethod
    def from_dict(cls, d: dict | None) -> AppConfig:
        d = dict(d or {})
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown settings: {sorted(unknown)}; valid: {sorted(known)}")
        if isinstance(d.get("redis_url"), str):  # Serve config files: redis://${HEAD_IP}:6379
            d["redis_url"] = os.path.expandvars(d["redis_url"])
            unset = re.findall(r"\$\{?(\w+)", d["redis_url"])
            if unset:  # e.g. a Ray head started without ~/.prefixgate/redis.env (docs/deploy.md)
                raise ValueError(f"redis_url names unset environment variables: {', '.join(unset)}")
        return cls(**d)

    def __post_init__(self) -> None:
        from router.registry import resolve

        self.policy = resolve(self.policy)  # unknown: ValueError listing the valid names
        spec = self.engine_spec  # unknown: ValueError listing the engines
        self._block_size_defaulted = self.block_size is None
        if self.block_size is None:
            self.block_size = spec.default_block_size
        # a working replica sends a keepalive every KEEPALIVE_S (K/V pulls included): a guard
        # shorter than two of them would move healthy requests
        if self.stall_timeout_s != 0 and self.stall_timeout_s <= 2 * KEEPALIVE_S:
            raise ValueError(f"stall_timeout_s must be 0 (off) or above {2 * KEEPALIVE_S:g} s (two keepalives), "
                             f"got {self.stall_timeout_s}")
        if not self.first_token_timeout_s > 0:  # 0 or less would answer every request 504
            raise ValueError(f"first_token_timeout_s must be > 0, got {self.first_token_timeout_s}")
        # a send per interval bounds how long a token waits; one at most a keepalive apart keeps the guard's view
        if not 0 <= self.stream_interval_ms <= KEEPALIVE_S * 1000:
            raise ValueError(f"stream_interval_ms must be in [0, {KEEPALIVE_S * 1000:g}], got {self.stream_interval_ms}")
        if self.kv_host_mb < 0 or self.kv_disk_mb < 0:
            raise ValueError("kv_host_mb and kv_disk_mb must be >= 0")
        # the engine's own rules (replica/backends/*_spec.py): the tiers, dtype and compile it
        # takes, its block sizes and LoRA ranks, its own knobs
        spec.check(self)
        self.check_lora()
        self.check_models()
        from gateway.flow.keys import parse_keys

        parse_keys(self.api_keys)  # the key file's format and fields (ValueError naming the key and field)
        for tier in ("priority", "default", "flex"):
            if not getattr(self, f"queue_wait_{tier}_s") > 0:
                raise ValueError(f"queue_wait_{tier}_s must be > 0, got {getattr(self, f'queue_wait_{tier}_s')}")
        self.check_slo()
        if self.flow_prefill_tokens is not None and self.flow_prefill_tokens < 1:
            raise ValueError(f"flow_prefill_tokens must be >= 1, got {self.flow_prefill_tokens}")
        if self.flow_replica_waiting < 1 or not 0 <= self.flow_kv_free_min < 1:
            raise ValueError("flow_replica_waiting must be >= 1 and flow_kv_free_min in [0, 1)")
        if self.long_prefill_token_threshold < 0:
            raise ValueError(f"long_prefill_token_threshold must be >= 0, got {self.long_prefill_token_threshold}")
        if self.max_queued_requests < 0:
            raise ValueError(f"max_queued_requests must be >= 0, got {self.max_queued_requests}")
        for name in ("sim_service", "sim_transfer", "replica_resources", "gateway_resources"):
            bad = {k: v for k, v in getattr(self, name).items() if isinstance(v, bool) or not isinstance(v, (int, float))}
            if bad:
                raise ValueError(f"{name} takes numbers, got {bad}")
        self.check_roles()
        self.router_options(self.model_name or "check")  # the router's own rules, checked at load

    @property
    def split(self) -> bool:
        """Prefill and decode on replicas of their own."""
        return self.prefill_replicas > 0 or self.decode_replicas > 0

    def check_roles(self) -> None:
        """Role counts: both or neither, with fixed counts (whether the engine hands over: its spec's rule)."""
        if self.prefill_replicas < 0 or self.decode_replicas < 0:
            raise ValueError("prefill_replicas and decode_replicas must be >= 0")
        if not self.split:
            return
        if self.prefill_replicas < 1 or self.decode_replicas < 1:
            raise ValueError(f"prefill_replicas ({self.prefill_replicas}) and decode_replicas ({self.decode_replicas}) "
                             "go together: a model with roles needs at least one replica of each")
        if self.autoscaling:
            raise ValueError("prefill_replicas / decode_replicas take fixed counts: autoscaling is not available with roles")
        if self.pd_threshold_tokens < 0 or not self.handover_timeout_s > 0:
            raise ValueError("pd_threshold_tokens must be >= 0 and handover_timeout_s > 0")

    @property
    def routed_replicas(self) -> int:
        """The replicas requests are routed to (and flow control counts the seats of): the decode
        replicas with roles, else all of them."""
        return self.decode_replicas if self.split else self.replicas

    @property
    def prefill_key_prefix(self) -> str:
        """The prefill replicas' own index, heartbeats and registrations (router/prefill_pick.py)."""
        return f"{self.key_prefix}:prefill"

    def check_slo(self) -> None:
        """slo_ttft_ms / slo_tpot_ms: tier -> a whole number of ms in [1, one hour] (ValueError naming both)."""
        from gateway.flow.slo import check_ms
        from gateway.flow.tiers import TIERS

        for name in ("slo_ttft_ms", "slo_tpot_ms"):
            for tier, value in getattr(self, name).items():
                if tier not in TIERS:
                    raise ValueError(f"{name}: unknown service tier {tier!r} (tiers: {', '.join(TIERS)})")
                check_ms(f"{name}[{tier}]", value)

    @property
    def engine_spec(self) -> EngineSpec:
        """The engine's rules and builders (replica/backends/engines.py)."""
        return engine_spec(self.engine)

    def engine_settings(self, model_id: str) -> EngineSettings:
        """What each replica's engine is built from: one engine's settings (a tagged union),
        built by its spec from the flat settings here."""
        return self.engine_spec.settings(self, model_id)

    @property
    def lora_enabled(self) -> bool:
        return self.enable_lora or bool(self.lora) or self.allow_runtime_lora_updating

    def check_lora(self) -> None:
        """Each adapter directory is checked at load, naming the file (its tensors are checked
        against the model when a replica starts: our engine's, or vLLM's, docs/lora.md)."""
        from router.protocol.lora import adapter_ref

        if self.max_loras < 1 or self.max_lora_rank < 1 or self.max_cpu_loras < self.max_loras:
            raise ValueError(f"need max_loras >= 1, max_lora_rank >= 1 and max_cpu_loras >= max_loras, got "
                             f"{self.max_loras}, {self.max_lora_rank}, {self.max_cpu_loras}")
        for name, path in self.lora.items():
            if not isinstance(path, str):
                raise ValueError(f"lora {name!r}: expected a directory path, got {path!r}")
            adapter_ref(name, path)
            if name == self.model_name:
                raise ValueError(f"lora {name!r}: an adapter cannot have the model's own name")

    @property
    def served_name(self) -> str:
        """The name requests give in `model`, and the model's block-hash identity."""
        if self.model_name:
            return self.model_name
        if self.model:
            return Path(self.model).name
        from replica.default_model import DEFAULT_MODEL_NAME

        return DEFAULT_MODEL_NAME

    def check_models(self) -> None:
        """`models` entries: known keys, a unique name each, no adapter named like a model; each
        model's own settings checked as its replicas get them (model_configs)."""
        if not self.models:
            return
        if self.model is not None or self.model_name is not None or self.lora:
            raise ValueError("with `models`, give each model's path and adapters in its entry "
                             "(model, model_name and lora are for one model)")
        names: set[str] = set()
        for i, spec in enumerate(self.models):
            if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) or not spec["name"]:
                raise ValueError(f"models[{i}]: expected an object with a non-empty string `name`, got {spec!r}")
            unknown = set(spec) - set(MODEL_KEYS)
            if unknown:
                raise ValueError(f"models[{i}] ({spec['name']}): unknown keys {sorted(unknown)}; valid: {list(MODEL_KEYS)}")
            if spec["name"] in names:
                raise ValueError(f"models: {spec['name']!r} named twice")
            check_role_counts(spec, f"models[{i}] ({spec['name']}): ")
            names.add(spec["name"])
        for cfg in self.model_configs():
            clash = names & set(cfg.lora)
            if clash:
                raise ValueError(f"models: adapter {sorted(clash)[0]!r} of {cfg.model_name} has a model's name")
            names |= set(cfg.lora)  # adapter names are unique across models: a request's `model` finds one

    def model_configs(self) -> list[AppConfig]:
        """One config per served model: the app's settings, with the model's own from its `models`
        entry, and Redis keys of its own (its index, sessions, heartbeats and adapters)."""
        if not self.models:
            return [self]
        out = []
        for spec in self.models:
            own = {k: v for k, v in spec.items() if k not in ("name", "path", "lora_adapters")}
            if "engine" in own and "block_size" not in own and self._block_size_defaulted:
                own["block_size"] = None  # the model's engine picks its default
            try:
                out.append(replace(self, models=[], model=spec.get("path"), model_name=spec["name"],
                                   lora=dict(spec.get("lora_adapters") or {}),
                                   key_prefix=f"{self.key_prefix}:m:{spec['name']}", **own))
            except (TypeError, ValueError) as e:
                raise ValueError(f"models ({spec['name']}): {e}") from None
        return out

    def router_options(self, model_id: str) -> RouterOptions:
        """What each gateway's router is built from (every RouterOptions field has a setting here)."""
        return RouterOptions(
            policy=self.policy, policy_options=dict(self.policy_options), model_id=model_id,
            block_size=self.block_size, publish_depth=self.publish_depth, redis_url=self.redis_url,
            key_prefix=self.key_prefix, redis_timeout_s=self.redis_timeout_s, session_ttl_s=self.session_ttl_s,
            seed=self.seed, sampled_replicas=self.sampled_replicas, index_buckets=self.index_buckets,
            load_refresh_s=self.load_refresh_s, lora_aware=self.lora_aware, audit_dir=self.audit_dir,
            prefill_key_prefix=self.prefill_key_prefix if self.split else None,
            pd_threshold_tokens=self.pd_threshold_tokens,
        )

    def to_dict(self) -> dict:
        return asdict(self)
