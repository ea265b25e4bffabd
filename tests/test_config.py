"""Configuration defined once: AppConfig's fields are the serve flags and the Serve config's
args, each with one default, and every router option can be set from a config file."""

from __future__ import annotations

import ast
import json
from dataclasses import fields

import pytest

from gateway.app import router_config
from gateway.cli import config_from_args, main
from gateway.config import AppConfig
from replica.backends.vllm_spec import VllmEngineSettings
from replica.engine_config import EngineConfig
from replica.serve.replica_settings import ReplicaSettings
from router.router_options import RouterOptions


def engine_config(config: AppConfig, model_id: str) -> EngineConfig:
    """The EngineConfig a replica of our engine (or vLLM's) is built from."""
    return config.engine_settings(model_id).config


def _parse(*argv: str):
    import argparse

    from gateway.cli import _serve_args

    p = argparse.ArgumentParser()
    _serve_args(p)
    return config_from_args(p.parse_args(list(argv)))


def test_every_setting_is_a_flag_and_a_flag_sets_it(tmp_path):
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"k1": "tenant-1"}))
    config = _parse("--sampled-replicas", "7", "--policy", "power-of-two", "--policy-options", "miss_weight=8",
                    "--sim-service", "decode_step_s=0.02", "--sim-service", '{"prefill_s_per_token": 0.001}',
                    "--replica-resources", '{"replica_node": 1}', "--replica-resources", "my-res=2",
                    "--sim-service", "decode-step-ms-unused=1", "--max-model-len", "none", "--api-keys", str(keys),
                    "--stall-timeout-s", "12.5", "--index-buckets", "8", "--replica-threads", "3")
    assert config.sampled_replicas == 7 and config.policy == "pow2"  # an alias, stored canonical
    assert config.policy_options == {"miss_weight": 8}
    assert config.sim_service == {"decode_step_s": 0.02, "prefill_s_per_token": 0.001, "decode_step_ms_unused": 1}
    # field-name keys take dashes for underscores; Ray resource names stay as written
    assert config.replica_resources == {"replica_node": 1, "my-res": 2} and config.max_model_len is None
    assert config.api_keys == {"k1": "tenant-1"} and config.stall_timeout_s == 12.5
    assert config.index_buckets == 8 and config.torch_threads == 3
    # flags not given leave the defaults (one default: the dataclass's)
    default = AppConfig()
    untouched = {"kv_cache_mb", "max_num_seqs", "publish_depth", "retry_attempts", "gateways", "engine"}
    assert all(getattr(config, n) == getattr(default, n) for n in untouched)
    # and every field has a flag (the Redis URL its own: --redis-url, else $REDIS_URL, else auto)
    import argparse

    from gateway.cli import _serve_args

    p = argparse.ArgumentParser()
    _serve_args(p)
    dests = {a.dest for a in p._actions}
    assert {f.name for f in fields(AppConfig)} - {"models"} <= dests  # models: --model NAME=PATH (below)


def test_bad_settings_are_refused_with_the_setting_named(capsys):
    with pytest.raises(SystemExit) as e:
        main(["serve", "--engine", "torch"])
    assert e.value.code == 2 and "--engine" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["serve", "--policy-options", "no-equals-sign"])
    assert "KEY=VALUE" in capsys.readouterr().err
    with pytest.raises(ValueError, match="sampled_replicas"):
        AppConfig(sampled_replicas=-1)
    with pytest.raises(ValueError, match="unknown settings"):
        AppConfig.from_dict({"sampled_replica": 3})
    with pytest.raises(ValueError, match="stall_timeout_s"):  # within two keepalives
        AppConfig(stall_timeout_s=3)
    AppConfig(stall_timeout_s=30, kv_pull_timeout_s=120)  # pulls send keepalives too
    AppConfig(stall_timeout_s=0)  # off
    with pytest.raises(ValueError, match="first_token_timeout_s must be > 0"):
        AppConfig.from_dict({"first_token_timeout_s": 0})
    with pytest.raises(ValueError, match="sim_service takes numbers"):
        AppConfig(sim_service={"decode_step_s": "fast"})
    with pytest.raises(ValueError, match="api_keys"):
        AppConfig(api_keys={"k": 3})
    with pytest.raises(ValueError, match="compile is our engine's"):
        AppConfig(engine="vllm", compile=True)
    with pytest.raises(ValueError, match="dtype must be one of"):
        AppConfig.from_dict({"dtype": "fp8"})
    with pytest.raises(ValueError, match="dtype is our engine's"):
        AppConfig(engine="vllm", dtype="bfloat16")
    engine = engine_config(AppConfig(compile=True, dtype="bfloat16"), "m")  # what the replicas are built from
    assert engine.compile and engine.dtype == "bfloat16"


def test_long_prefill_threshold_flag_reaches_both_engines(capfd):
    config = _parse("--long-prefill-token-threshold", "64")
    assert engine_config(config, "m").long_prefill_token_threshold == 64
    sim = _parse("--engine", "sim", "--long-prefill-token-threshold", "32").engine_settings("m")
    assert sim.config.long_prefill_token_threshold == 32
    assert main(["serve", "--long-prefill-token-threshold", "-1"]) == 2  # refused before anything starts
    assert "long_prefill_token_threshold must be >= 0" in capfd.readouterr().err


def test_one_default_per_setting():
    """The served defaults are the engine's and the router's own, not copies that drift."""
    app, engine, router = AppConfig(), EngineConfig(), RouterOptions()
    assert app.max_num_seqs == engine.max_num_seqs
    assert app.max_num_batched_tokens == engine.max_num_batched_tokens
    assert app.kv_cache_mb * 2**20 == engine.kv_cache_bytes and app.block_size == engine.block_size
    for f in fields(RouterOptions):
        if f.name not in ("model_id", "block_size", "redis_url", "prefill_key_prefix"):  # the app's own choices
            assert getattr(app, f.name) == getattr(router, f.name), f.name
    assert ReplicaSettings().key_prefix == app.key_prefix and ReplicaSettings().index_buckets == app.index_buckets
    assert ReplicaSettings().publish_depth == app.publish_depth


# Settings that more than one process's config carries, by class and field: each default must be
# a named constant (or an expression of one), never a literal written again in another class.
_SHARED_DEFAULTS = {
    "gateway.config.AppConfig": ("kv_cache_mb", "max_num_seqs", "max_num_batched_tokens", "publish_depth",
                                 "key_prefix", "index_buckets", "stream_interval_ms", "kv_pull_timeout_s",
                                 "redis_timeout_s", "policy"),
    "router.router_options.RouterOptions": ("policy", "block_size", "publish_depth", "key_prefix",
                                            "index_buckets", "redis_timeout_s"),
    "replica.serve.replica_settings.ReplicaSettings": ("key_prefix", "index_buckets", "publish_depth",
                                                       "kv_pull_timeout_s", "stream_interval_s"),
    "replica.engine_config.EngineConfig": ("block_size", "max_num_seqs", "max_num_batched_tokens"),
    "replica.engine_config.SimEngineConfig": ("block_size", "max_num_seqs"),
    "replica.kv_io.kv_pull.KvPullConfig": ("timeout_s",),
}


def _field_defaults(dotted: str) -> dict[str, ast.expr | None]:
    """Each field's default expression as written in the class's source (setting(...)'s first
    argument for AppConfig's), None when it has none."""
    import importlib
    import inspect

    module, name = dotted.rsplit(".", 1)
    tree = ast.parse(inspect.getsource(importlib.import_module(module)))
    cls = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == name)
    out: dict[str, ast.expr | None] = {}
    for stmt in cls.body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            value = stmt.value
            if isinstance(value, ast.Call) and getattr(value.func, "id", "") in ("setting", "field") and value.args:
                value = value.args[0]
            out[stmt.target.id] = value
    return out


def test_shared_defaults_are_defined_once():
    """Not equal values but one definition: every shared default names its constant."""
    for dotted, names in _SHARED_DEFAULTS.items():
        defaults = _field_defaults(dotted)
        for name in names:
            expr = defaults[name]
            assert expr is not None, f"{dotted}.{name} has no default"
            named = any(isinstance(n, (ast.Name, ast.Attribute)) for n in ast.walk(expr))
            assert named, f"{dotted}.{name} = {ast.unparse(expr)}: a literal; name the shared constant instead"


def test_every_router_option_reaches_the_router_from_a_config_file():
    """Each RouterOptions field set away from its default in a Serve config's args arrives in
    the RequestRouterConfig Serve builds our router from; the bucket count reaches the replicas."""
    changed = {"policy": "affinity", "policy_options": {"miss_weight": 9.0}, "publish_depth": 32,
               "key_prefix": "cfg", "redis_timeout_s": 0.2, "session_ttl_s": 60, "seed": 5,
               "sampled_replicas": 2, "index_buckets": 4, "load_refresh_s": 0.5, "block_size": 32,
               "redis_url": "redis://127.0.0.1:1/0", "lora_aware": False, "audit_dir": "/tmp/audit",
               "pd_threshold_tokens": 100}
    # the prefill replicas' index: derived from key_prefix where the model has roles
    assert set(changed) | {"model_id", "prefill_key_prefix"} == {f.name for f in fields(RouterOptions)}
    config = AppConfig.from_dict(changed)
    kwargs = router_config(config, "my-model").request_router_kwargs
    assert kwargs == {**changed, "model_id": "my-model", "prefill_key_prefix": None}
    RouterOptions(**kwargs)  # what PrefixGateRouter.initialize_state builds
    roles = {**changed, "engine": "sim", "prefill_replicas": 1, "decode_replicas": 2, "handover_timeout_s": 7.5}
    assert router_config(AppConfig.from_dict(roles), "m").request_router_kwargs["prefill_key_prefix"] == "cfg:prefill"

    from gateway.app import build_app

    app = build_app(AppConfig.from_dict({**changed, "engine": "sim"}))
    replica = next(d for d in _deployments(app) if d.name == "PrefixCacheReplica")
    settings = ReplicaSettings.from_dict(replica.init_args[0])
    assert settings.index_buckets == 4 and settings.key_prefix == "cfg" and settings.publish_depth == 32
    assert settings.audit_dir == "/tmp/audit"  # the replicas record their side of the audit there
    assert settings.role == "both"
    # with roles: the decode replicas are the routed deployment; the prefill ones beside it, their own index
    split = {d.name: d for d in _deployments(build_app(AppConfig.from_dict(roles)))}
    decode = ReplicaSettings.from_dict(split["PrefixCacheReplica"].init_args[0])
    prefill = ReplicaSettings.from_dict(split["PrefixCacheReplica-prefill"].init_args[0])
    assert (decode.role, decode.prefill_deployment, decode.key_prefix) == ("decode", "PrefixCacheReplica-prefill", "cfg")
    assert decode.handover_timeout_s == 7.5  # the setting reaches the replicas that wait on it
    assert (prefill.role, prefill.key_prefix) == ("prefill", "cfg:prefill")


def _deployments(app):
    """Every deployment of a built (not running) Serve application."""
    seen, todo = [], [app]
    while todo:
        d = todo.pop()._bound_deployment
        seen.append(d)
        args = [*d.init_args, *d.init_kwargs.values()]
        args += [v for a in args if isinstance(a, dict) for v in a.values()]  # the gateway's {model: replicas}
        todo += [a for a in args if hasattr(a, "_bound_deployment")]
    return seen


def test_stream_interval_flag_reaches_the_replicas():
    """`--stream-interval-ms` (a replica sends a stream's tokens at most once per interval) is
    what each replica's settings carry; out of [0, two keepalives] it is refused, named."""
    from gateway.app import replica_settings

    assert replica_settings(_parse("--stream-interval-ms", "5"), "m").stream_interval_s == 0.005
    assert replica_settings(_parse("--stream-interval-ms", "0"), "m").stream_interval_s == 0
    assert replica_settings(AppConfig(), "m").stream_interval_s == ReplicaSettings().stream_interval_s
    with pytest.raises(ValueError, match="stream_interval_ms"):
        _parse("--stream-interval-ms", "5000")
    with pytest.raises(ValueError, match="stream_interval_ms"):
        AppConfig(stream_interval_ms=-1)


def test_lora_flags_and_config_keys_reach_the_engine(tmp_path):
    adapter = tmp_path / "sql"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4}))
    (adapter / "adapter_model.safetensors").write_bytes(b"weights")
    config = _parse("--lora", f"sql-v1={adapter}", "--lora", f"Sql.2={adapter}", "--max-loras", "3",
                    "--max-lora-rank", "32", "--max-cpu-loras", "5", "--allow-runtime-lora-updating", "true",
                    "--enable-lora", "true")
    assert config.lora == {"sql-v1": str(adapter), "Sql.2": str(adapter)}  # names as written
    assert config.allow_runtime_lora_updating and config.enable_lora
    engine = engine_config(config, "m")
    assert (engine.lora_adapters, engine.max_loras, engine.max_lora_rank, engine.max_cpu_loras) == (
        config.lora, 3, 32, 5) and engine.lora
    # a Serve config file's args
    served = AppConfig.from_dict({"lora": {"sql": str(adapter)}, "max_loras": 2, "max_cpu_loras": 2})
    assert engine_config(served, "m").lora_adapters == {"sql": str(adapter)}
    assert not engine_config(AppConfig(), "m").lora
    for bad, says in [({"lora": {"x": str(tmp_path / "none")}}, "does not exist"),
                      ({"lora": {"bad name": str(adapter)}}, "must match"),
                      ({"max_loras": 4, "max_cpu_loras": 2}, "max_cpu_loras >= max_loras")]:
        with pytest.raises(ValueError, match=says):
            AppConfig.from_dict(bad)


def test_several_models_from_the_command_line_and_a_serve_config(tmp_path):
    import yaml

    from gateway.app import replica_settings

    config = _parse("--model", "chat=/models/a", "--model", "code=/models/b", "--engine", "sim", "--replicas", "3")
    assert config.models == [{"name": "chat", "path": "/models/a"}, {"name": "code", "path": "/models/b"}]
    assert [(c.served_name, c.model, c.replicas, c.engine) for c in config.model_configs()] == [
        ("chat", "/models/a", 3, "sim"), ("code", "/models/b", 3, "sim")]
    assert _parse("--model", "/models/a").model == "/models/a" and not _parse("--model", "/models/a").models
    with pytest.raises(ValueError, match="NAME=PATH"):
        _parse("--model", "chat=/models/a", "--model", "/models/b")
    # a Serve config file: each model its replicas, engine, adapters and Redis keys
    adapter = tmp_path / "sql"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4}))
    (adapter / "adapter_model.safetensors").write_bytes(b"weights")
    args = yaml.safe_load(f"""
key_prefix: pg
models:
  - {{name: chat, path: /models/a, replicas: 2, lora_adapters: {{sql: {adapter}}}}}
  - {{name: vl, path: /models/b, engine: vllm, replicas: 1, max_model_len: 2048}}
""")
    chat, vl = AppConfig.from_dict(args).model_configs()
    assert (chat.replicas, chat.lora, chat.key_prefix, chat.block_size) == (2, {"sql": str(adapter)}, "pg:m:chat", 16)
    assert (vl.engine, vl.block_size, vl.max_model_len, vl.key_prefix) == ("vllm", 32, 2048, "pg:m:vl")
    settings = replica_settings(chat, chat.served_name)
    assert settings.engine.config.model_id == "chat" and settings.key_prefix == "pg:m:chat" and settings.engine.config.lora
    assert router_config(vl, vl.served_name).request_router_kwargs["key_prefix"] == "pg:m:vl"
    from gateway.app import build_app

    built = {d.name: d for d in _deployments(build_app(AppConfig.from_dict(args)))}
    assert set(built) == {"Gateway", "PrefixCacheReplica-chat", "PrefixCacheReplica-vl"}
    assert built["PrefixCacheReplica-chat"].num_replicas == 2 and built["PrefixCacheReplica-vl"].num_replicas == 1
    assert isinstance(ReplicaSettings.from_dict(built["PrefixCacheReplica-vl"].init_args[0]).engine, VllmEngineSettings)
    assert "runtime_env" in built["PrefixCacheReplica-vl"].ray_actor_options  # vLLM's interpreter, from its spec
    assert "runtime_env" not in built["PrefixCacheReplica-chat"].ray_actor_options
    for bad, says in [({"models": [{"name": "a", "gpu": 1}]}, "unknown keys"),
                      ({"models": [{"name": "a"}, {"name": "a"}]}, "named twice"),
                      ({"models": [{"path": "/x"}]}, "non-empty string `name`"),
                      ({"models": [{"name": "a"}], "model": "/x"}, "with `models`"),
                      ({"models": [{"name": "a"}, {"name": "b", "lora_adapters": {"a": str(adapter)}}]}, "has a model's name"),
                      ({"models": [{"name": "a", "engine": "torch"}]}, "unknown engine")]:
        with pytest.raises(ValueError, match=says):
            AppConfig.from_dict(bad)


def test_a_stack_pointed_at_a_silent_redis_refuses_to_start():
    """A redis_url nobody answers is an error before anything starts, not a stack whose every
    route is `stale` and whose flow control sees no heartbeats ('auto': the stack's own Redis)."""
    from gateway.local_redis import free_port
    from gateway.stack import LocalStack

    url = f"redis://127.0.0.1:{free_port()}/0"
    stack = LocalStack(AppConfig(engine="sim", redis_url=url), port=free_port())
    with pytest.raises(RuntimeError, match=f"no Redis answers at {url}"):
        stack.start(timeout_s=5)
    assert stack.redis is None
