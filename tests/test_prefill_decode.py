"""Prefill and decode on replicas of their own (docs/prefill-decode.md): the roles' settings as a
user sets them, the router's prefill pick on a real Redis, and live apps beside the session
stack: sim replicas (the hand-over decided, made and recovered from when the prefill replica is
killed) and the real model (greedy output equal to colocated serving, the K/V bytes handed over,
no block left pinned on the prefill replica).

Waits are on events (a route, a counter, a heartbeat) with hang guards only."""

from __future__ import annotations

import asyncio
import os
import random
import uuid
from types import SimpleNamespace

import httpx
import pytest
import redis

from gateway.app import app_builder
from gateway.config import AppConfig
from replica.default_model import DEFAULT_MODEL_NAME
from replica.kv_io.kv_pull import ReplicaCaller
from replica.serve.replica_settings import ReplicaSettings
from router.index.redis_index import RedisConfig, RedisIndex
from router.latency_model import StepFit
from router.load_table import LoadTable
from router.prefill_pick import PrefillPicker
from router.protocol import audit_log
from router.protocol.hashing import block_hashes, chain_seed
from router.protocol.redis_schema import Heartbeat, RedisKeys
from tests.helpers.stack import side_app, wait_until

BS = 16
FIT = StepFit((0.01, 0.0002, 0.0005, 0.0, 0.02), q=0.002, prefill_per_step=64.0, started_per_step=0.1,
              budget=512, samples=50)


# ---- settings -----------------------------------------------------------------------------------
def test_roles_from_a_serve_config_and_their_refusals():
    cfg = AppConfig.from_dict({"engine": "sim", "prefill_replicas": 1, "decode_replicas": 2, "pd_threshold_tokens": 128})
    assert AppConfig.from_dict(cfg.to_dict()).split  # passed on whole (replicas included), as the gateway gets it
    assert cfg.split and cfg.router_options("m").prefill_key_prefix == f"{cfg.key_prefix}:prefill"
    assert cfg.router_options("m").pd_threshold_tokens == 128
    assert cfg.routed_replicas == 2  # the decode replicas: what flow control counts the seats of
    assert AppConfig.from_dict({"engine": "sim"}).router_options("m").prefill_key_prefix is None  # colocated
    refused = {
        "replicas": {"engine": "sim", "replicas": 2, "prefill_replicas": 1, "decode_replicas": 1},
        "go together": {"engine": "sim", "prefill_replicas": 1},
        "another connector is not supported": {"engine": "vllm", "prefill_replicas": 1, "decode_replicas": 1,
                                               "vllm": {"engine_args": {"kv_transfer_config": {"kv_connector": "X"}}}},
        "autoscaling is not available": {"engine": "sim", "prefill_replicas": 1, "decode_replicas": 1,
                                         "autoscaling": {"min_replicas": 1, "max_replicas": 2}},
    }
    for why, given in refused.items():
        with pytest.raises(ValueError, match=why):
            app_builder(given)  # as Serve builds the app from a config file's args
    models = {"engine": "sim", "models": [{"name": "a", "prefill_replicas": 1, "decode_replicas": 1},
                                          {"name": "b", "replicas": 1}]}
    a, b = AppConfig.from_dict(models).model_configs()
    assert a.split and a.prefill_key_prefix.endswith(":m:a:prefill") and not b.split
    with pytest.raises(ValueError, match=r"models\[0\] \(a\): replicas is set together"):
        AppConfig.from_dict({"engine": "sim", "models": [{"name": "a", "replicas": 2, "prefill_replicas": 1,
                                                           "decode_replicas": 1}]})


def test_a_replicas_role_is_checked_where_it_enters_the_replica():
    import msgspec

    assert ReplicaSettings.from_dict({"role": "decode", "prefill_deployment": "P-prefill"}).role == "decode"
    for bad in ({"role": "prefil"}, {"role": "decode"}, {"role": "prefill", "prefill_deployment": "x"}):
        with pytest.raises(msgspec.ValidationError):
            ReplicaSettings.from_dict(bad)


def test_the_role_flags_as_a_user_passes_them():
    """`prefixgate serve` flags: the counts reach the config; --replicas beside them is refused
    by name before anything starts."""
    from gateway.cli import build_parser, config_from_args

    parse = build_parser().parse_args
    cfg = config_from_args(parse(["serve", "--engine", "sim", "--prefill-replicas", "1", "--decode-replicas", "3",
                                  "--pd-threshold-tokens", "64", "--handover-timeout-s", "9"]))
    assert (cfg.prefill_replicas, cfg.decode_replicas, cfg.pd_threshold_tokens, cfg.handover_timeout_s) == (1, 3, 64, 9.0)
    with pytest.raises(ValueError, match="replicas is set together"):
        config_from_args(parse(["serve", "--engine", "sim", "--replicas", "2", "--prefill-replicas", "1",
                                "--decode-replicas", "1"]))


# ---- the router's pick, on a real Redis ------------------------------------------------------------
def _publish(client: redis.Redis, keys: RedisKeys, rid: str, hashes: list[int], pending: int) -> None:
    client.sadd(keys.replicas, rid)
    client.hset(keys.heartbeat(rid), mapping=Heartbeat(pending_prefill_tokens=pending, capacity_blocks=100).to_redis())
    for h in hashes:
        client.sadd(keys.block(h), rid)


def test_the_prefill_pick_weighs_held_blocks_against_queued_prefill(redis_server):
    prefix = f"pdpick-{uuid.uuid4().hex[:6]}"
    keys = RedisKeys(prefix)
    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    prompt = list(range(1000, 1000 + 40 * BS + 3))
    hashes = block_hashes(prompt[: 40 * BS], BS, chain_seed("m", None, None))

    async def pick(threshold: int, decode_matched: int, fit: StepFit | None = None):
        index = RedisIndex(RedisConfig(redis_server.url, prefix, timeout_s=1.0))
        picker = PrefillPicker(index, LoadTable(index, 0.05), threshold)
        if fit is not None:  # as if each prefill replica's steps had been learned from its heartbeats
            picker.loads.latency.fit = lambda rid: fit
        try:
            return await picker.pick(hashes, len(prompt), decode_matched, BS), picker
        finally:
            await picker.loads.close()
            await index.close()

    none, _ = asyncio.run(pick(64, 0))
    assert none.source is None and none.why == "no_replica"  # no prefill replica registered: the decode replica computes it
    _publish(client, keys, "holder", hashes[:30], pending=200)  # 480 of the prompt's 643 tokens held, 200 queued
    _publish(client, keys, "idle", [], pending=0)  # nothing held, nothing queued
    chosen, picker = asyncio.run(pick(64, 0))
    assert (chosen.source.replica_id, chosen.source.num_blocks) == ("holder", 40)  # (643 - 480) + 200 < 643
    # what the audit records: why, and each prefill replica's price (tokens: no step model yet)
    assert chosen.why == "picked" and chosen.unit == "tokens" and chosen.costs == {"holder": 363, "idle": 643}
    client.hset(keys.heartbeat("holder"), "pending_prefill_tokens", 600)
    assert asyncio.run(pick(64, 0))[0].source.replica_id == "idle"  # 763 > 643
    short, picker = asyncio.run(pick(64, 38))  # the decode replica holds all but 35 tokens
    assert short.source is None and short.why == "short" and picker.skipped["short"] == 1
    # ten requests waiting at the holder, no prefill pending: in tokens it is the cheaper (163 < 643);
    # priced by the step models, their starts (20 ms each) make it the slower to this prompt's end
    client.hset(keys.heartbeat("holder"), mapping={"pending_prefill_tokens": 0, "waiting": 10})
    assert asyncio.run(pick(64, 0))[0].source.replica_id == "holder"
    timed = asyncio.run(pick(64, 0, FIT))[0]
    assert timed.source.replica_id == "idle" and timed.unit == "s" and timed.costs["holder"] > timed.costs["idle"] > 0
    client.delete(keys.heartbeat("idle"), keys.heartbeat("holder"))  # no heartbeat: not a candidate
    none, picker = asyncio.run(pick(64, 0))
    assert none.source is None and none.why == "no_replica" and picker.skipped["no_replica"] == 1
    # two idle replicas holding nothing: the picks spread over both (by id, all went to one)
    _publish(client, keys, "twin-a", [], pending=0)
    _publish(client, keys, "twin-b", [], pending=0)
    picked = {asyncio.run(pick(64, 0))[0].source.replica_id for _ in range(24)}
    assert picked == {"twin-a", "twin-b"}


# ---- live: sim replicas ---------------------------------------------------------------------------
SIM_APP = "pd-sim"


@pytest.fixture(scope="module")
def sim_app(stack, redis_server, tmp_path_factory):
    from ray.serve._private.common import DeploymentID

    prefix = f"pdsim-{uuid.uuid4().hex[:6]}"
    # prefills slow enough (4 ms a token: 1.3 s for 320) that a hand-over is still running when the
    # test kills its prefill replica; a 10 s timeout well past that (a loaded machine must not
    # time those out) and well short of a 4,000-token prompt's 16 s
    config = AppConfig(engine="sim", prefill_replicas=1, decode_replicas=1, redis_url=redis_server.url,
                       key_prefix=prefix, num_blocks=2048, block_size=BS, max_model_len=4096, redis_timeout_s=1.0,
                       pd_threshold_tokens=64, handover_timeout_s=10.0, sim_service={"prefill_s_per_token": 0.004},
                       audit_dir=str(tmp_path_factory.mktemp("pd-audit")))
    with side_app(stack, SIM_APP, config) as base:
        yield SimpleNamespace(url=base, keys=RedisKeys(prefix), prefill_keys=RedisKeys(f"{prefix}:prefill"),
                              audit_dir=config.audit_dir,
                              redis=redis.Redis.from_url(redis_server.url, decode_responses=True),
                              decode=ReplicaCaller(DeploymentID(name="PrefixCacheReplica", app_name=SIM_APP)),
                              prefill_deployment=DeploymentID(name="PrefixCacheReplica-prefill", app_name=SIM_APP))


def _prompt(n: int) -> list[int]:
    rng = random.Random(os.urandom(8))  # fresh every run: nothing of it is cached anywhere
    return [rng.randrange(200, 30000) for _ in range(n)]


def _complete(url: str, prompt: list[int], max_tokens: int = 4) -> dict:
    r = httpx.post(f"{url}/v1/completions", timeout=180,
                   json={"model": DEFAULT_MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                         "ignore_eos": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["completion_tokens"] == max_tokens
    return body


def _handover_stats(app, rid: str) -> dict:
    return asyncio.run(app.decode.call(rid, "info"))["stats"]["handover"]


def _prefill_beats(app) -> dict[str, dict]:
    return {rid: hb for rid in app.redis.smembers(app.prefill_keys.replicas)
            if (hb := app.redis.hgetall(app.prefill_keys.heartbeat(rid)))}


def test_a_long_prompt_is_handed_over_and_a_short_one_is_not(sim_app):
    def handed() -> dict | None:
        route = _complete(sim_app.url, _prompt(20 * BS))["prefixgate"]["route"]
        return route if "prefill_from" in route else None

    route = wait_until("a long prompt routed with a prefill replica", handed, timeout_s=180)
    assert route["prefill_blocks"] == (20 * BS - 1) // BS
    assert route["prefill_from"] in _prefill_beats(sim_app)  # a replica of the prefill deployment
    stats = _handover_stats(sim_app, route["replica"])
    assert stats["ok"] >= 1 and stats["tokens"] >= route["prefill_blocks"] * BS
    short = _complete(sim_app.url, _prompt(40))["prefixgate"]["route"]  # 40 tokens: under the 64-token threshold
    assert "prefill_from" not in short
    # the routing audit records both picks and why (a Decision is written once Ray reports where it went)
    def audited() -> dict[str, list[audit_log.Decision]] | None:
        found: dict[str, list[audit_log.Decision]] = {}
        for record in audit_log.read_dir(sim_app.audit_dir):
            if isinstance(record, audit_log.Decision):
                found.setdefault(record.prefill_why, []).append(record)
        return found if "picked" in found and "short" in found else None

    decisions = wait_until("decisions with a prefill pick and a short prompt audited", audited, timeout_s=60)
    picked = decisions["picked"][-1]
    assert picked.route.prefill is not None and picked.route.prefill.replica_id in picked.prefill_costs
    assert picked.prefill_unit in ("s", "tokens") and all(c >= 0 for c in picked.prefill_costs.values())
    assert all(d.route.prefill is None and not d.prefill_costs for d in decisions["short"])
    health = httpx.get(f"{sim_app.url}/health", timeout=30)
    assert health.status_code == 200 and health.json()["roles"] == {DEFAULT_MODEL_NAME: {"prefill": 1, "decode": 1}}
    assert asyncio.run(sim_app.decode.call(route["replica"], "info"))["role"] == "decode"


def test_a_prefill_replica_killed_mid_hand_over_loses_no_request(sim_app):
    """The prefill replica is killed while it computes a hand-over's prompt: that request completes
    all the same (the decode replica computes the prompt itself), the failure is counted, and
    hand-overs resume on the replica Serve starts in its place."""
    import threading

    import ray
    from ray.serve._private.common import ReplicaID
    from ray.serve._private.constants import SERVE_NAMESPACE

    def routed() -> dict | None:
        route = _complete(sim_app.url, _prompt(20 * BS))["prefixgate"]["route"]
        return route if "prefill_from" in route else None

    first = wait_until("a hand-over before the kill", routed, timeout_s=180)
    decode, victim = first["replica"], first["prefill_from"]
    before = _handover_stats(sim_app, decode)
    done: dict = {}
    sender = threading.Thread(target=lambda: done.update(body=_complete(sim_app.url, _prompt(20 * BS))))
    sender.start()

    def computing() -> bool:  # the decode replica asked, and the victim has the prompt in hand
        if _handover_stats(sim_app, decode)["asked"] == before["asked"]:
            return False
        hb = sim_app.redis.hgetall(sim_app.prefill_keys.heartbeat(victim))
        return bool(hb) and int(hb.get("running", 0)) + int(hb.get("waiting", 0)) > 0

    wait_until("the prefill replica computing the hand-over's prompt", computing, timeout_s=60)
    actor = ray.get_actor(ReplicaID(victim, sim_app.prefill_deployment).to_full_id_str(), namespace=SERVE_NAMESPACE)
    ray.kill(actor, no_restart=True)
    sender.join(timeout=180)
    assert "body" in done, "the request whose prefill replica died did not complete"
    assert done["body"]["prefixgate"]["route"]["prefill_from"] == victim  # it was handed over to the victim
    after_kill = _handover_stats(sim_app, decode)
    assert after_kill["failed"] + after_kill["timeouts"] == before["failed"] + before["timeouts"] + 1

    def resumed() -> dict | None:
        route = _complete(sim_app.url, _prompt(20 * BS))["prefixgate"]["route"]
        return route if route.get("prefill_from") not in (None, victim) else None

    wait_until("hand-overs from the replacement prefill replica", resumed, timeout_s=300)
    assert _handover_stats(sim_app, decode)["ok"] > before["ok"]


def _prefill_stats(app, rid: str) -> dict | None:
    """A prefill replica's engine stats; None for one that is gone (a heartbeat outlives it)."""
    try:
        return asyncio.run(ReplicaCaller(app.prefill_deployment).call(rid, "info"))["stats"]
    except Exception:
        return None


def test_a_hand_over_past_its_timeout_stops_on_the_prefill_replica(sim_app):
    """A prompt whose prefill takes longer than the hand-over timeout (16 s modelled against
    10 s): the decode replica gives up and computes it itself (the client gets its answer), and
    the prefill replica's request is cancelled (ReplicaCaller cancels the Ray call), ending there
    without its one output token instead of running on unread. (A client that leaves cancels the
    decode replica's request, and Ray cancels the calls it made with it.)"""
    import threading

    def routed() -> dict | None:
        route = _complete(sim_app.url, _prompt(20 * BS))["prefixgate"]["route"]
        return route if "prefill_from" in route else None

    decode = wait_until("a hand-over to learn the decode replica from", routed, timeout_s=180)["replica"]
    start = _handover_stats(sim_app, decode)

    def decode_beat() -> dict[str, str]:
        return sim_app.redis.hgetall(sim_app.keys.heartbeat(decode))

    # the decode replica's heartbeat while the hand-over is in flight: sampled from before it is
    # sent until it has timed out, so no part of its 10 s is missed
    beats_in_flight: list[dict[str, str]] = []
    sampled = threading.Event()

    def sample() -> None:
        while not sampled.is_set():
            if int((b := decode_beat()).get("handovers_in_flight", 0)) >= 1:
                beats_in_flight.append(b)
            sampled.wait(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    done: dict = {}
    sender = threading.Thread(target=lambda: done.update(body=_complete(sim_app.url, _prompt(250 * BS))))
    sender.start()

    def computing() -> tuple[str, dict] | None:  # asked of a prefill replica, which has it in hand
        if _handover_stats(sim_app, decode)["asked"] == start["asked"]:
            return None
        for rid in _prefill_beats(sim_app):
            stats = _prefill_stats(sim_app, rid)
            if stats is not None and stats["running"] > 0:
                return rid, stats
        return None

    busy, before = wait_until("the prefill replica computing the long prompt", computing, timeout_s=120)
    wait_until("the hand-over timed out", lambda: _handover_stats(sim_app, decode)["timeouts"] > start["timeouts"],
               timeout_s=120)
    sampled.set()
    sampler.join(timeout=30)
    # the decode replica's heartbeat counted the request waiting on the hand-over (not in its engine
    # yet) as waiting, and drops it once the hand-over is given up on
    assert beats_in_flight, "no decode heartbeat counted the hand-over in flight"
    assert all(int(b["waiting"]) >= int(b["handovers_in_flight"]) for b in beats_in_flight), beats_in_flight[-1]
    wait_until("the decode replica's heartbeat without it", lambda: int(decode_beat().get("handovers_in_flight", 0)) == 0,
               timeout_s=60)

    def idle() -> dict | None:
        stats = _prefill_stats(sim_app, busy)
        return stats if stats is not None and stats["running"] + stats["waiting"] == 0 else None

    after = wait_until("the prefill replica idle again", idle, timeout_s=120)
    assert after["generated_tokens"] == before["generated_tokens"]  # stopped before its one token
    sender.join(timeout=300)
    assert "body" in done, "the request whose hand-over timed out did not complete"


# ---- live: the real model --------------------------------------------------------------------------
MODEL_APP = "pd-model"


@pytest.fixture(scope="module")
def model_app(stack, redis_server):
    from ray.serve._private.common import DeploymentID

    prefix = f"pdm-{uuid.uuid4().hex[:6]}"
    config = AppConfig(prefill_replicas=1, decode_replicas=1, redis_url=redis_server.url, key_prefix=prefix,
                       kv_cache_mb=64, max_model_len=2048, redis_timeout_s=1.0, pd_threshold_tokens=64,
                       handover_timeout_s=120.0)  # the hand-over is under test: a loaded machine must not time it out
    with side_app(stack, MODEL_APP, config) as base:
        yield SimpleNamespace(url=base, prefill_keys=RedisKeys(f"{prefix}:prefill"),
                              redis=redis.Redis.from_url(redis_server.url, decode_responses=True),
                              decode=ReplicaCaller(DeploymentID(name="PrefixCacheReplica", app_name=MODEL_APP)))


def test_greedy_output_after_a_hand_over_equals_colocated_serving(stack, model_app):
    prompt = _prompt(12 * BS + 5)
    colocated = _complete(stack.url, prompt, max_tokens=8)
    reference = colocated["choices"][0]["text"]

    def handed(p: list[int]) -> dict | None:
        body = _complete(model_app.url, p, max_tokens=8)
        return body if "prefill_from" in body["prefixgate"]["route"] else None

    # the router needs the prefill replica's heartbeat first: warm it with prompts of their own
    wait_until("a hand-over on the model app", lambda: handed(_prompt(12 * BS + 5)), timeout_s=300)
    body = wait_until("the reference prompt handed over", lambda: handed(prompt), timeout_s=120)
    route = body["prefixgate"]["route"]
    assert body["choices"][0]["text"] == reference
    stats = _handover_stats(model_app, route["replica"])
    assert stats["ok"] >= 1 and stats["bytes"] > 0

    def idle() -> dict | None:  # every block of the prefill replica free or cached: none left pinned
        beats = _prefill_beats(model_app)
        done = [hb for hb in beats.values()
                if int(hb["free_blocks"]) + int(hb["cached_blocks"]) == int(hb["capacity_blocks"])]
        return beats if beats and len(done) == len(beats) else None

    wait_until("the prefill replica's pool with nothing in use", idle, timeout_s=60)
