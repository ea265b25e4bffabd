"""Shared fixtures: tiny random models of several families, and the real default model."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch

torch.set_num_threads(min(2, os.cpu_count() or 1))

TINY_FAMILIES = ["llama", "qwen2", "qwen3", "mistral"]


def _tiny_config(family: str):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common = dict(
        vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
    )
    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config, "mistral": MistralConfig}[family]
    if family == "qwen3":
        common["head_dim"] = 16
    return cls(**common)


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory) -> dict[str, str]:
    """Randomly initialised, seeded models saved to disk (the engine loads from a directory)."""
    from transformers import AutoModelForCausalLM

    dirs = {}
    for family in TINY_FAMILIES:
        torch.manual_seed(1234)
        model = AutoModelForCausalLM.from_config(_tiny_config(family))
        path = tmp_path_factory.mktemp(f"tiny-{family}")
        model.save_pretrained(path)
        dirs[family] = str(path)
    return dirs


@pytest.fixture(scope="session")
def default_model_dir() -> str:
    from replica.default_model import default_model_dir as locate

    return str(locate())


@pytest.fixture(scope="session")
def hf_reference(default_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(default_model_dir, attn_implementation="sdpa").eval()


def reference_greedy(model, prompt: list[int], max_new_tokens: int, stop_at_eos: bool = True) -> list[int]:
    """Plain transformers greedy decoding: the ground truth the engine must match."""
    kwargs = {} if stop_at_eos else {"eos_token_id": None}
    out = model.generate(
        torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
        pad_token_id=0, attention_mask=torch.ones(1, len(prompt), dtype=torch.long), **kwargs,
    )
    return out[0, len(prompt):].tolist()


# ---- real services --------------------------------------------------------------------------
@pytest.fixture(scope="session")
def redis_server():
    """A private redis-server on a free loopback port, for the whole test session."""
    from gateway.local_redis import LocalRedis

    server = LocalRedis().start()
    yield server
    server.cleanup()


@pytest.fixture(scope="session")
def stack(redis_server):
    """The real stack: local Ray, Serve, 2 replicas of the default model, router, gateway."""
    import uuid

    from gateway.config import AppConfig
    from gateway.local_redis import free_port
    from gateway.stack import LocalStack

    config = AppConfig(
        redis_url=redis_server.url, key_prefix=f"test-{uuid.uuid4().hex[:6]}", replicas=2,
        kv_cache_mb=64, max_model_len=2048, default_max_tokens=32,
        kv_host_mb=128,  # a host K/V tier (2x the pool) below each pool: tests/test_kv_tiers.py, the tier metrics
        stall_timeout_s=10,  # tests/test_faults.py freezes a replica: wait 10 s for it, not 30
    )
    s = LocalStack(config, port=free_port(), metrics_port=free_port()).start()  # metrics: tests/test_metrics.py
    yield s
    s.stop()


@pytest.fixture(scope="session")
def redis_cluster():
    """A real 3-master Redis Cluster on loopback ports, for the whole test session."""
    from gateway.local_redis_cluster import LocalRedisCluster

    cluster = LocalRedisCluster().start()
    yield cluster
    cluster.cleanup()


@pytest.fixture(params=["standalone", "cluster"])
def redis_url(request) -> str:
    """The index tests run against both: a standalone redis-server and a 3-master cluster."""
    server = request.getfixturevalue("redis_server" if request.param == "standalone" else "redis_cluster")
    return server.url


@contextlib.contextmanager
def side_app(stack, name: str, config):
    """A second Serve app beside the session stack at /name, fresh (an app left by an earlier run
    is deleted first) and deleted on exit; yields its base URL."""
    from ray import serve

    if name in serve.status().applications:
        serve.delete(name)
    url = stack.deploy(config, name=name, route_prefix=f"/{name}")
    try:
        yield url
    finally:
        serve.delete(name)
