"""Two models behind one gateway, through the real stack (Serve, Redis, HTTP): our engine on the
bundled model with a LoRA adapter, and a simulated-compute replica of the same tokenizer under
another name. Each model has its own replicas and Redis keys; /v1/models lists both and the
adapter; a request reaches only its model's replicas; an unknown model is a 404."""

from __future__ import annotations

import uuid

import httpx
import pytest
import redis

from gateway.config import AppConfig
from router.protocol.redis_schema import RedisKeys
from tests.helpers.lora import ATTENTION, make_adapter
from tests.helpers.stack import side_app

PROMPT = "Tell me about the tides along the northern coast and why they matter to the harbour " * 4


@pytest.fixture(scope="module")
def two_models(stack, default_model_dir, tmp_path_factory):
    tutor = make_adapter(default_model_dir, str(tmp_path_factory.mktemp("models-lora") / "tutor"), ATTENTION, 4, seed=21)
    prefix = f"models-{uuid.uuid4().hex[:6]}"
    config = AppConfig.from_dict({
        "redis_url": stack.config.redis_url, "key_prefix": prefix, "max_model_len": 1024,
        "allow_runtime_lora_updating": True,
        "models": [{"name": "smol", "path": default_model_dir, "replicas": 1, "num_blocks": 128,
                    "lora_adapters": {"tutor": tutor}},
                   {"name": "smol-sim", "path": default_model_dir, "engine": "sim", "replicas": 1}],
    })
    with side_app(stack, "models", config) as url:
        yield url, prefix


def _replicas(prefix: str, model: str, redis_url: str) -> set[str]:
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        return client.smembers(RedisKeys(f"{prefix}:m:{model}").replicas)
    finally:
        client.close()


def complete(url: str, model: str, **extra) -> httpx.Response:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, **extra}
    return httpx.post(f"{url}/v1/completions", json=body, headers={"x-session-id": f"s-{model}"}, timeout=300)


def test_models_lists_every_model_and_adapter(two_models, default_model_dir):
    url, _ = two_models
    data = httpx.get(f"{url}/v1/models", timeout=60).json()["data"]
    by_id = {m["id"]: m for m in data}
    assert set(by_id) == {"smol", "smol-sim", "tutor"}
    assert by_id["tutor"]["parent"] == "smol" and by_id["smol-sim"]["parent"] is None
    assert by_id["smol"]["root"] == default_model_dir and by_id["smol-sim"]["max_model_len"] == 1024


def test_each_model_is_served_by_its_own_replicas(two_models, stack):
    url, prefix = two_models
    mine = {name: _replicas(prefix, name, stack.config.redis_url) for name in ("smol", "smol-sim")}
    assert all(len(ids) == 1 for ids in mine.values()) and not mine["smol"] & mine["smol-sim"], mine
    for model, owner in (("smol", "smol"), ("smol-sim", "smol-sim"), ("tutor", "smol")):
        r = complete(url, model)
        assert r.status_code == 200, r.text
        assert r.json()["model"] == model
        assert r.headers["x-prefixgate-replica"] in mine[owner], (model, r.headers["x-prefixgate-replica"], mine)
    # the repeat hits its own model's cache (its index and sessions are its own keys)
    again = complete(url, "smol")
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    metrics = httpx.get(f"{url}/metrics", timeout=30).text
    for model in ("smol", "smol-sim"):
        assert f'prefixgate_requests_total{{endpoint="completions",model_name="{model}",status="200"}}' in metrics
    health = httpx.get(f"{url}/health", timeout=30).json()
    assert health["models"] == {"smol": "ok", "smol-sim": "ok"} and health["checks"]["replicas"] == "ok"


def test_an_unknown_model_is_404_naming_the_served_ones(two_models):
    url, _ = two_models
    r = complete(url, "gpt-4o")
    assert r.status_code == 404, r.text
    err = r.json()["error"]
    assert err["code"] == "model_not_found" and err["param"] == "model"
    assert "smol" in err["message"] and "smol-sim" in err["message"] and "tutor" in err["message"]


def test_a_runtime_adapter_names_its_base_model(two_models, default_model_dir, tmp_path):
    url, _ = two_models
    path = make_adapter(default_model_dir, str(tmp_path / "late"), ATTENTION, 4, seed=22)
    r = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": path}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "base_model_name", r.text
    r = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": path,
                                                         "base_model_name": "nope"}, timeout=60)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text
    r = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": path,
                                                         "base_model_name": "smol"}, timeout=120)
    assert r.status_code == 200, r.text
    listed = {m["id"]: m for m in httpx.get(f"{url}/v1/models", timeout=60).json()["data"]}
    assert listed["late"]["parent"] == "smol"
    assert complete(url, "late").status_code == 200
    r = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "late"}, timeout=60)
    assert r.status_code == 200, r.text
    assert complete(url, "late").status_code == 404
