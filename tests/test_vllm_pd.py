"""Prefill and decode on vLLM replicas (docs/vllm.md, "Prefill and decode on vLLM replicas"), for
real: one prefill and one decode replica of vLLM's CPU engine beside the session stack, the
hand-over through vLLM's own KV connector (replica/backends/vllm_connector.py). A long prompt is
handed over and the decode replica's vLLM loads its K/V (its connector's hit count and the
request's cached tokens say so, not only our counts), its greedy output equals vLLM serving the
prompt alone, the hand-over's files are deleted once loaded, and a short prompt is not handed over.

One app for the module; waits are on events with hang guards only."""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import uuid
from types import SimpleNamespace

import httpx
import pytest
import redis

from gateway.config import AppConfig
from replica.backends.vllm_settings import vllm_python
from replica.default_model import DEFAULT_MODEL_NAME
from replica.kv_io.kv_pull import ReplicaCaller
from router.protocol.redis_schema import RedisKeys
from tests.helpers.stack import side_app, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

APP = "vllm-pd"
BS = 32
MAX_TOKENS = 16
_RNG = random.Random(os.urandom(8))  # fresh every run: nothing of these prompts is cached anywhere


def _prompt(n: int) -> list[int]:
    return [_RNG.randrange(200, 30000) for _ in range(n)]


# the prompt compared with vLLM alone: 10 blocks and 1 token (a length ExampleConnector itself missed)
REFERENCE_PROMPT = _prompt(10 * BS + 1)


def _vllm_python() -> str:
    py = vllm_python()
    assert "vllm" in py and os.path.exists(py), f"the vLLM venv is missing ({py}): run `make install` (scripts/bootstrap.sh)"
    return py


@pytest.fixture(scope="module")
def reference(default_model_dir, tmp_path_factory):
    """vLLM serving REFERENCE_PROMPT alone (tests/vllm_reference.py), started beside the app."""
    job = {"model": default_model_dir, "prompts": [REFERENCE_PROMPT], "max_tokens": MAX_TOKENS, "ignore_eos": True,
           "block_size": BS, "num_blocks": 96}
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "PYTEST"))}
    logs = tmp_path_factory.mktemp("vllm-pd-reference")
    (logs / "job.json").write_text(json.dumps(job))
    with open(logs / "job.json") as stdin, open(logs / "out", "w") as stdout, open(logs / "err", "w") as stderr:
        proc = subprocess.Popen([_vllm_python(), "-m", "tests.vllm_reference"], stdin=stdin, stdout=stdout,
                                stderr=stderr, cwd=os.path.dirname(os.path.dirname(__file__)), env=env)

    def outputs() -> list[int]:
        assert proc.wait(timeout=600) == 0, (logs / "err").read_text()[-3000:]
        # vLLM logs to stdout too
        [line] = [x for x in (logs / "out").read_text().splitlines() if x.startswith("REFERENCE ")]
        return json.loads(line.removeprefix("REFERENCE "))["outputs"][0]

    try:
        yield outputs
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def pd_app(stack, reference):
    from ray.serve._private.common import DeploymentID

    prefix = f"vpd-{uuid.uuid4().hex[:6]}"
    # handover_timeout_s: the hand-over is under test, a loaded machine must not time it out
    config = AppConfig(engine="vllm", prefill_replicas=1, decode_replicas=1, num_blocks=96, max_model_len=2048,
                       redis_url=stack.config.redis_url, key_prefix=prefix, redis_timeout_s=1.0,
                       pd_threshold_tokens=64, handover_timeout_s=120.0)
    with side_app(stack, APP, config) as url:
        yield SimpleNamespace(url=url, config=config, prefill_keys=RedisKeys(f"{prefix}:prefill"),
                              redis=redis.Redis.from_url(stack.config.redis_url, decode_responses=True),
                              decode=ReplicaCaller(DeploymentID(name="PrefixCacheReplica", app_name=APP)))


def _complete(url: str, prompt: list[int], max_tokens: int = 4) -> dict:
    r = httpx.post(f"{url}/v1/completions", timeout=300,
                   json={"model": DEFAULT_MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                         "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()


def _info(app, rid: str) -> dict:
    return asyncio.run(app.decode.call(rid, "info"))


def test_a_long_prompt_is_handed_over_through_vllms_connector(pd_app, reference, default_model_dir):
    def handed(prompt: list[int]) -> dict | None:
        body = _complete(pd_app.url, prompt, max_tokens=MAX_TOKENS)
        return body if "prefill_from" in body["prefixgate"]["route"] else None

    # the router needs the prefill replica's heartbeat first: warm it with prompts of their own
    wait_until("a hand-over on the vLLM app", lambda: handed(_prompt(9 * BS + 5)), timeout_s=300)
    body = wait_until("the reference prompt handed over", lambda: handed(REFERENCE_PROMPT), timeout_s=120)
    route, rid = body["prefixgate"]["route"], body["prefixgate"]["replica"]
    saved = (len(REFERENCE_PROMPT) - 1) // BS * BS  # every full block but the last token's: 320 tokens
    assert route["prefill_blocks"] == saved // BS, route
    # loaded, not computed: the decode replica never saw this prompt, and vLLM reports it cached
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] >= saved, body["usage"]
    info = _info(pd_app, rid)
    assert info["role"] == "decode"
    stats, connector = info["stats"]["handover"], info["kv_connector"]
    assert stats["ok"] >= 2 and stats["failed"] == 0 and stats["timeouts"] == 0, stats
    assert stats["tokens"] >= 2 * saved - BS and stats["bytes"] > 0, stats
    # vLLM's own count of tokens its KV connector loaded (SchedulerStats.connector_prefix_cache_stats)
    assert connector["hit_tokens"] >= stats["tokens"] and connector["loaded"] == stats["ok"], connector
    assert connector["missed"] == 0, connector
    # the files go once loaded: nothing is left in the model's directory
    wait_until("the hand-overs' files deleted", lambda: not os.listdir(connector["dir"]), timeout_s=30)
    assert connector["deleted"] == stats["ok"], connector

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_dir)
    ref_ids = reference()
    assert body["usage"]["completion_tokens"] == len(ref_ids) == MAX_TOKENS
    assert body["choices"][0]["text"] == tok.decode(ref_ids, skip_special_tokens=True), (body["choices"], ref_ids)


def test_a_short_prompt_is_not_handed_over(pd_app):
    before = {rid: _info(pd_app, rid)["stats"]["handover"]["asked"]
              for rid in pd_app.redis.smembers(RedisKeys(pd_app.config.key_prefix).replicas)}
    body = _complete(pd_app.url, _prompt(40))  # 40 tokens: under the 64-token threshold
    assert "prefill_from" not in body["prefixgate"]["route"], body["prefixgate"]
    rid = body["prefixgate"]["replica"]
    assert _info(pd_app, rid)["stats"]["handover"]["asked"] == before.get(rid, 0)
    health = httpx.get(f"{pd_app.url}/health", timeout=30)
    assert health.status_code == 200 and health.json()["roles"] == {DEFAULT_MODEL_NAME: {"prefill": 1, "decode": 1}}
