"""LoRA adapters through the real stack (Serve, Redis, our engine on the bundled model, HTTP):
/v1/models lists them, a request's `model` runs its adapter with PeftModel's greedy output,
identical prompts never hit across adapters but do under one, routing follows an adapter's
prefix, unknown models are 404, and vLLM's run-time load/unload endpoints with an admin key."""

from __future__ import annotations

import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from gateway.config import AppConfig
from replica.default_model import DEFAULT_MODEL_NAME
from router.protocol.redis_schema import RedisKeys
from tests.helpers.lora import ATTENTION, ATTENTION_MLP, make_adapter, peft_model
from tests.helpers.stack import side_app

PROMPT = "The history of the lighthouse keepers on the northern coast began when " * 8
KEYS = {"sk-admin": {"tenant": "ops", "admin": True}, "sk-user": "acme"}
ADMIN = {"authorization": "Bearer sk-admin"}
USER = {"authorization": "Bearer sk-user"}


@pytest.fixture(scope="module")
def lora_dirs(default_model_dir, tmp_path_factory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("serve-lora")
    return {
        "tutor": make_adapter(default_model_dir, str(d / "tutor"), ATTENTION, 8, seed=11),
        "poet": make_adapter(default_model_dir, str(d / "poet"), ATTENTION_MLP, 4, seed=12, rslora=True),
        "late": make_adapter(default_model_dir, str(d / "late"), ["q_proj", "v_proj"], 4, seed=13),
    }


@pytest.fixture(scope="module")
def lora_config(stack, lora_dirs) -> AppConfig:
    return AppConfig(
        redis_url=stack.config.redis_url, key_prefix=f"lora-{uuid.uuid4().hex[:6]}", replicas=2,
        num_blocks=256, max_model_len=1024, api_keys=KEYS, allow_runtime_lora_updating=True,
        lora={"tutor": lora_dirs["tutor"], "poet": lora_dirs["poet"]}, max_loras=2, max_cpu_loras=2,
        redis_timeout_s=1.0,  # as the suite's other live apps: routing asserted, never a `stale` lookup
    )


@pytest.fixture(scope="module")
def lora_app(stack, lora_config):
    with side_app(stack, "lora", lora_config) as url:
        yield url


def complete(url: str, model: str, session: str, prompt: str = PROMPT, max_tokens: int = 8) -> httpx.Response:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    return httpx.post(f"{url}/v1/completions", json=body, headers={**USER, "x-session-id": session}, timeout=300)


def cached(r: httpx.Response) -> int:
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_models_lists_the_base_and_every_adapter(lora_app, lora_dirs):
    data = httpx.get(f"{lora_app}/v1/models", headers=USER, timeout=60).json()["data"]
    by_id = {m["id"]: m for m in data}
    assert set(by_id) == {DEFAULT_MODEL_NAME, "tutor", "poet"}
    assert by_id["tutor"]["parent"] == DEFAULT_MODEL_NAME and by_id[DEFAULT_MODEL_NAME]["parent"] is None
    assert by_id["poet"]["root"] == lora_dirs["poet"] and by_id["poet"]["max_model_len"] == 1024
    for name in by_id:  # OpenAI's retrieve-model answers each with the card the list holds
        r = httpx.get(f"{lora_app}/v1/models/{name}", headers=USER, timeout=60)
        assert r.status_code == 200 and r.json() == by_id[name], r.text


def test_adapter_output_equals_peft_model(lora_app, lora_dirs, default_model_dir):
    from transformers import AutoTokenizer

    from tests.helpers.engine import reference_greedy

    tok = AutoTokenizer.from_pretrained(default_model_dir)
    ids = tok.encode(PROMPT)
    for name in ("tutor", "poet"):
        r = complete(lora_app, name, f"parity-{name}")
        assert r.status_code == 200, r.text
        assert r.json()["model"] == name
        ref = reference_greedy(peft_model(default_model_dir, lora_dirs[name]), ids, 8, stop_at_eos=False)
        assert r.json()["choices"][0]["text"] == tok.decode(ref, skip_special_tokens=True), name
    base = complete(lora_app, DEFAULT_MODEL_NAME, "parity-base").json()["choices"][0]["text"]
    assert base != r.json()["choices"][0]["text"]


def test_no_hit_across_adapters_a_hit_under_one_and_routing_by_adapter_prefix(lora_app, lora_config):
    import redis

    keys = RedisKeys(lora_config.key_prefix)
    client = redis.Redis.from_url(lora_config.redis_url)
    held = {rid: client.scard(keys.blocks(rid)) for rid in client.smembers(keys.replicas)}
    session = f"s-{uuid.uuid4().hex[:6]}"
    prompt = f"{uuid.uuid4().hex} " + PROMPT  # fresh: nothing cached anywhere
    first = complete(lora_app, "tutor", session, prompt)
    assert cached(first) == 0
    home = first.headers["x-prefixgate-replica"]
    # the replica publishes its new blocks asynchronously: wait until all the prompt's full blocks
    # but the last are in the index (what the next request's match needs), not merely the first
    blocks = first.json()["usage"]["prompt_tokens"] // 16 - 1
    deadline = time.monotonic() + 60  # a hang guard only
    while client.scard(keys.blocks(home)) < held.get(home.encode(), 0) + blocks:
        assert time.monotonic() < deadline, "the first request's blocks never reached the index"
        time.sleep(0.1)
    assert cached(complete(lora_app, "poet", session, prompt)) == 0  # same replica (session), other adapter
    assert cached(complete(lora_app, DEFAULT_MODEL_NAME, session, prompt)) == 0
    again = complete(lora_app, "tutor", session, prompt)
    assert cached(again) >= 64
    # a new session with the same adapter and prompt goes where that adapter's prefix is
    other = complete(lora_app, "tutor", f"s-{uuid.uuid4().hex[:6]}", prompt)
    assert cached(other) >= 64, (dict(other.headers), home, other.json())
    # found by the adapter's prefix: sent to its holder, or (when the router's load view still
    # counts the previous request there: tests/test_router_e2e.py) to the other replica with a
    # pull of those blocks from the holder; either way the hit above is the adapter-keyed match
    route = other.headers["x-prefixgate-route"]
    assert (other.headers["x-prefixgate-replica"], route) == (home, "prefix") or route == "pull", dict(other.headers)


def test_unknown_model_is_a_404(lora_app):
    r = complete(lora_app, "nope", "s")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert "tutor" in r.json()["error"]["message"]


def test_load_and_unload_at_run_time(lora_app, lora_dirs, tmp_path, tiny_model_dirs):
    load = {"lora_name": "late", "lora_path": lora_dirs["late"]}
    assert httpx.post(f"{lora_app}/v1/load_lora_adapter", json=load, headers=USER, timeout=60).status_code == 403
    assert complete(lora_app, "late", "s-late").status_code == 404
    r = httpx.post(f"{lora_app}/v1/load_lora_adapter", json=load, headers=ADMIN, timeout=120)
    assert r.status_code == 200, r.text
    # both replicas serve it, though only the one that checked it has read it: the router prefers
    # that one while it is idle, so requests go in concurrent rounds until the load spreads them
    replicas: set[str] = set()
    with ThreadPoolExecutor(4) as pool:
        for _ in range(6):  # bounded: one round has done it in every run seen
            replies = list(pool.map(lambda i: complete(lora_app, "late", f"late-{uuid.uuid4().hex[:8]}",
                                                       f"{i} {uuid.uuid4().hex} " + PROMPT, max_tokens=24), range(4)))
            for r in replies:
                assert r.status_code == 200, r.text
                replicas.add(r.headers["x-prefixgate-replica"])
            if len(replicas) == 2:
                break
    assert len(replicas) == 2, replicas
    assert "late" in {m["id"] for m in httpx.get(f"{lora_app}/v1/models", headers=USER, timeout=60).json()["data"]}
    # refusals: another model's adapter (judged by shapes on a replica), a missing directory, a static name
    wrong = make_adapter(tiny_model_dirs["llama"], str(tmp_path / "tiny"), ATTENTION, 4, seed=1)
    for body, status, says in [({"lora_name": "tiny", "lora_path": wrong}, 400, "another model"),
                               ({"lora_name": "gone", "lora_path": str(tmp_path / "none")}, 400, "does not exist"),
                               ({"lora_name": "tutor", "lora_path": lora_dirs["late"]}, 400, "configured at start"),
                               ({"lora_path": lora_dirs["late"]}, 400, "lora_name")]:
        r = httpx.post(f"{lora_app}/v1/load_lora_adapter", json=body, headers=ADMIN, timeout=120)
        assert r.status_code == status and says in r.json()["error"]["message"], r.text
    r = httpx.post(f"{lora_app}/v1/unload_lora_adapter", json={"lora_name": "late"}, headers=ADMIN, timeout=60)
    assert r.status_code == 200, r.text
    assert complete(lora_app, "late", "s-late").status_code == 404
    r = httpx.post(f"{lora_app}/v1/unload_lora_adapter", json={"lora_name": "late"}, headers=ADMIN, timeout=60)
    assert r.status_code == 404
    assert complete(lora_app, "tutor", "s-after").status_code == 200  # the others still serve


def test_runtime_endpoints_are_off_by_default(stack):
    r = httpx.post(f"{stack.url}/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/tmp"}, timeout=30)
    assert r.status_code == 404 and "off" in r.json()["error"]["message"]
    assert complete(stack.url, "tutor", "s").status_code == 404


def test_replicas_export_vllm_lora_requests_info(lora_app, stack):
    from tests.helpers.metrics import scrape

    assert complete(lora_app, "poet", f"m-{uuid.uuid4().hex[:6]}").status_code == 200
    deadline = time.monotonic() + 120  # Ray's agents export about every 10 s
    while True:
        series = scrape(stack.metrics_port).get("ray_vllm_lora_requests_info", [])
        mine = [labels for labels, _ in series if labels.get("application") == "lora"]
        if any(labels["max_lora"] == "2" for labels in mine):
            break
        assert time.monotonic() < deadline, f"no vllm_lora_requests_info from the LoRA app: {series}"
        time.sleep(2)
    assert {"running_lora_adapters", "waiting_lora_adapters", "model_name"} <= set(mine[0])


def test_heartbeats_list_the_resident_adapters(lora_app, lora_config, lora_dirs):
    """A replica's heartbeat names the adapters in its host memory (their identities, which the
    router compares with a request's) and its measured time to read one from disk."""
    import redis

    from router.protocol.lora import adapter_ref

    keys = RedisKeys(lora_config.key_prefix)
    client = redis.Redis.from_url(lora_config.redis_url, decode_responses=True)
    tutor = adapter_ref("tutor", lora_dirs["tutor"]).identity
    r = complete(lora_app, "tutor", f"hb-{uuid.uuid4().hex[:6]}")
    home = r.headers["x-prefixgate-replica"]
    # a hang guard only: a heartbeat comes every half second, but a loaded 2-core machine (the
    # suite's other worker starting a stack) has held the publisher's loop for over 30 s
    deadline = time.monotonic() + 180
    while tutor not in (hb := client.hgetall(keys.heartbeat(home))).get("lora_resident", "").split():
        assert time.monotonic() < deadline, hb
        time.sleep(0.2)
    assert len(hb["lora_resident"].split()) <= lora_config.max_cpu_loras and int(hb["lora_load_ms"]) > 0, hb
