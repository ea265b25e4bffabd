"""Tiers, router side: the index knows where each block lives (device pool, host tier, disk
tier) and the router prices a lower-tier hit. The encoding and the policy math are pure; the
index writer, the lookup's tier split, the vLLM adapter and calibration run against a real
redis-server (and the 3-master cluster, through `redis_url`)."""

from __future__ import annotations

import asyncio
import logging
import random
import uuid

import msgpack
import pytest

from router.costs.transfer_model import TransferModel
from router.index.index_writer import IndexWriter
from router.index.memory_index import InMemoryIndex
from router.index.redis_index import RedisConfig, RedisIndex, ReplicaEntry, open_client, tier_split
from router.policy import AffinityPolicy, AffinityPullPolicy, ReplicaView, RouteRequest
from router.protocol.events import decode_batch
from router.protocol.hashing import block_hashes, chain_seed
from router.protocol.media import (
    DEVICE,
    DISK,
    HOST,
    UnknownMedium,
    check_replica_id,
    entry,
    member,
    parse_medium,
    split_entry,
    split_member,
)
from router.protocol.messages import KvSource
from router.protocol.redis_schema import RedisKeys
from router.sim.index import SimIndex
from router.sim.sim_router import SimClock
from router.vllm_events import EventTranslator
from tests.helpers.index import loads_from_redis, sync_client, vllm_publisher

BS = 16
MODEL = "tier-model"


@pytest.fixture
def prefix():
    return f"tier{uuid.uuid4().hex[:8]}"


# ---- the encoding (router/protocol/media.py) -------------------------------------------------
def test_members_and_entries_round_trip_and_read_old_ones_as_device():
    for medium in (DEVICE, HOST, DISK):
        assert split_member(member("r1", medium)) == ("r1", medium)
        assert split_entry(entry(123, medium)) == (123, medium)
        assert split_entry(entry(123, medium).encode()) == (123, medium)
    assert member("r1") == "r1" and entry(123) == "123"  # an index written before tiers
    assert member("r1", HOST) == "r1|host" and entry(123, DISK) == "123|disk"
    assert split_member("r1|nonsense") == ("r1|nonsense", DEVICE)  # not a medium of ours


def test_parse_medium_maps_vllm_and_lmcache_names():
    assert [parse_medium(m) for m in (None, "", "GPU", "cuda")] == [DEVICE] * 4
    assert [parse_medium(m) for m in ("CPU", "LocalCPUBackend", "host")] == [HOST] * 3
    assert [parse_medium(m) for m in ("disk", "LocalDiskBackend", "NVMe")] == [DISK] * 3
    with pytest.raises(UnknownMedium):
        parse_medium("tape")
    with pytest.raises(ValueError):
        check_replica_id("a|b")


# ---- the index writer on a real Redis --------------------------------------------------------
def test_writer_keeps_both_views_per_medium_and_retract_leaves_nothing(redis_url, prefix):
    keys = RedisKeys(prefix)
    r = sync_client(redis_url)

    def holders(h: int) -> set[str]:
        return {m.decode() for m in r.smembers(keys.block(h))}

    def own(rid: str) -> set[str]:
        return {m.decode() for m in r.smembers(keys.blocks(rid))}

    async def scenario():
        client = await open_client(redis_url, 2.0)
        writer = IndexWriter(client, keys)
        try:
            await writer.apply("ra", [("+", [1, 2, 3], DEVICE), ("+", [4, 5], HOST), ("+", [6], DISK)])
            await writer.apply("rb", [("+", [1], DEVICE), ("+", [4], HOST)])
            assert (holders(1), holders(4), holders(6)) == ({"ra", "rb"}, {"ra|host", "rb|host"}, {"ra|disk"})
            assert own("ra") == {"1", "2", "3", "4|host", "5|host", "6|disk"}
            # a move, as a replica publishes it: removed from the pool, then stored in the host tier
            await writer.apply("ra", [("-", [3], DEVICE), ("+", [3], HOST)])
            assert holders(3) == {"ra|host"} and "3|host" in own("ra") and "3" not in own("ra")
            # a full resync: 2 moved down, 7 new on disk, the rest gone
            stale = await writer.replace("ra", [(1, DEVICE), (2, HOST), (7, DISK)])
            assert stale == 5  # 2 (device), 3, 4, 5 (host), 6 (disk)
            assert own("ra") == {"1", "2|host", "7|disk"}
            assert (holders(2), holders(3), holders(4), holders(7)) == ({"ra|host"}, set(), {"rb|host"}, {"ra|disk"})
            with pytest.raises(ValueError):  # nothing a lookup could decode is written
                await writer.apply("ra", [("+", [8], DEVICE), ("+", [9], "tape")])
            with pytest.raises(ValueError):
                await writer.apply("ra|host", [("+", [8], DEVICE)])
            assert holders(8) == set()
            assert await writer.retract("ra") is True  # registered by the resync
            for h in range(1, 10):
                assert not {m for m in holders(h) if split_member(m)[0] == "ra"}, h
            assert not r.exists(keys.blocks("ra"))
            assert (holders(1), holders(4)) == ({"rb"}, {"rb|host"})  # the other replica untouched
        finally:
            await writer.retract("rb")
            await client.aclose()

    asyncio.run(scenario())
    r.close()


# ---- the lookup's tier split ------------------------------------------------------------------
def test_tier_split_orders_runs_by_depth():
    assert tier_split({DEVICE: 6}) == ReplicaEntry(6)
    assert tier_split({DEVICE: 4, HOST: 10}) == ReplicaEntry(10, tier_blocks={HOST: 6})
    assert tier_split({HOST: 8}) == ReplicaEntry(8, tier_blocks={HOST: 8})  # only seen in the host tier
    assert tier_split({DEVICE: 2, HOST: 4, DISK: 12}) == ReplicaEntry(12, tier_blocks={HOST: 2, DISK: 8})


def test_walk_reads_a_kept_replicas_media_beyond_keep():
    """keep=1: only the deepest replica is reported, but its device end, sampled shallower where
    another replica's match ends, still splits its match."""
    walker = RedisIndex(RedisConfig("redis://unused.invalid/0", sample=4, keep=1))
    cards = {i: 2 if i < 4 else 1 for i in range(10)}
    samples = {i: [] for i in range(10)} | {3: ["rd", "rm"], 9: ["rm|host"]}
    assert walker._walk(10, cards, samples) == {"rm": ReplicaEntry(10, tier_blocks={HOST: 6})}


def test_lookup_splits_each_match_by_medium(redis_url, prefix):
    """rd: 4 blocks in its pool; rm: the same 4 in its pool and 6 more in its host tier; rh: 8
    in its host tier only. rm's device end is sampled where rd's match ends."""
    hashes = block_hashes(list(range(12 * BS)), BS, 7)

    async def scenario():
        index = RedisIndex(RedisConfig(redis_url, prefix, timeout_s=2.0))
        client = await open_client(redis_url, 2.0)
        writer = IndexWriter(client, index.keys)
        try:
            await writer.apply("rd", [("+", hashes[:4], DEVICE)])
            await writer.apply("rm", [("+", hashes[:4], DEVICE), ("+", hashes[4:10], HOST)])
            await writer.apply("rh", [("+", hashes[:8], HOST)])
            look = await index.lookup(hashes, ["rd", "rm", "rh", "rz"])
            assert look.replicas == {
                "rd": ReplicaEntry(4),
                "rm": ReplicaEntry(10, tier_blocks={HOST: 6}),
                "rh": ReplicaEntry(8, tier_blocks={HOST: 8}),
                "rz": ReplicaEntry(0),
            }
            assert list((await index.lookup(hashes)).replicas) == ["rm", "rh", "rd"]  # deepest first
        finally:
            for rid in ("rd", "rm", "rh"):
                await writer.retract(rid)
            await client.aclose()
            await index.close()

    asyncio.run(scenario())


def test_memory_index_carries_the_medium_and_the_sim_lookup_splits_it():
    idx = InMemoryIndex()
    idx.stored("a", [1, 2, 3, 4])
    idx.removed("a", [3, 4])  # a move down, as the engine publishes it
    idx.stored("a", [3, 4], HOST)
    idx.stored("a", [5], DISK)
    idx.stored("b", [1, 2])
    idx.removed("b", [2], HOST)  # not held there: no effect
    assert idx.match([1, 2, 3, 4, 5, 6], ["a", "b"]) == {"a": 5, "b": 2}
    assert idx.match_media([1, 2, 3, 4, 5], ["a", "b", "c"]) == {
        "a": ReplicaEntry(5, tier_blocks={HOST: 2, DISK: 1}), "b": ReplicaEntry(2), "c": ReplicaEntry(0)}
    assert set(idx.holders(3)) == {"a|host"} and set(idx.holders(1)) == {"a", "b"}
    idx.stored("a", [3], DEVICE)  # stored in another medium: moved, one member per block
    assert set(idx.holders(3)) == {"a"}
    # the simulator's lookup samples where matches end: a in its pool at block 2 (where b's
    # match ends) and on disk at block 5, so blocks 3-5 read as disk (pessimistic: 4 is host)
    look = SimIndex(idx, SimClock(0.0), sample=4, keep=12).lookup([1, 2, 3, 4, 5])
    assert look.replicas == {"a": ReplicaEntry(5, tier_blocks={DISK: 3}), "b": ReplicaEntry(2)}
    idx.clear("a")
    assert idx.match([1], ["a"]) == {"a": 0} and set(idx.holders(4)) == set()


# ---- vLLM's media ------------------------------------------------------------------------------
def _stored(hashes, parent, tokens, medium="GPU"):
    return ["BlockStored", hashes, parent, tokens, BS, None, medium]


def _offloaded(hashes, medium="CPU"):
    """What vLLM's offloading connector sends for a CPU copy: the same hashes, no tokens."""
    return ["BlockStored", hashes, None, [], BS, None, medium]


def _batch(*events):
    return decode_batch(msgpack.packb([0.0, list(events), None]))


def test_translator_publishes_the_fastest_medium_vllm_holds():
    t = EventTranslator(MODEL, BS, depth=64)
    tokens = list(range(3 * BS))
    ours = block_hashes(tokens, BS, chain_seed(MODEL))
    a, b, c = (random.getrandbits(63) for _ in range(3))
    assert t.translate(_batch(_stored([a, b, c], None, tokens))) == [("+", ours, DEVICE)]
    assert t.translate(_batch(_offloaded([a, b, c]))) == []  # a CPU copy beside the GPU one
    # the GPU evicts b and c: their CPU copies are what is left, a move to the host tier
    assert t.translate(_batch(["BlockRemoved", [b, c], "GPU"])) == [("-", ours[1:], DEVICE), ("+", ours[1:], HOST)]
    assert t.held() == [(ours[0], 0, DEVICE), (ours[1], 1, HOST), (ours[2], 2, HOST)]
    assert t.leading_held(ours) == 3  # a CPU copy is loaded, not computed
    assert t.translate(_batch(["BlockRemoved", [c], "CPU"])) == [("-", ours[2:], HOST)]
    assert t.num_held == 2
    # b loaded back onto the GPU (vLLM stores it there again, with its tokens)
    assert t.translate(_batch(_stored([b], a, tokens[BS : 2 * BS]))) == [("-", [ours[1]], HOST), ("+", [ours[1]], DEVICE)]
    # a CPU copy of a block never seen stored cannot be re-hashed
    assert t.translate(_batch(_offloaded([random.getrandbits(63)]))) == [] and t.stats.skipped == 1


def test_translator_skips_an_unknown_medium_counts_and_logs_it_once(caplog):
    t = EventTranslator(MODEL, BS, depth=64)
    tokens = list(range(BS))
    with caplog.at_level(logging.WARNING, logger="prefixgate.vllm_events"):
        writes = t.translate(_batch(_stored([1], None, tokens, "tape"), _stored([2], None, tokens, "tape"),
                                    _stored([3], None, tokens, "GPU")))
    assert writes == [("+", block_hashes(tokens, BS, chain_seed(MODEL)), DEVICE)]
    assert t.stats.unknown_media == 2
    assert len([r for r in caplog.records if "tape" in r.getMessage()]) == 1


def test_vllm_cpu_events_land_in_the_host_tier(redis_url, prefix):
    """The vLLM backend's path from an event batch to Redis (without the socket): blocks vLLM
    offloads to CPU and then evicts from the GPU are listed, and matched, in the host tier."""
    tokens = list(range(3 * BS))
    ours = block_hashes(tokens, BS, chain_seed(MODEL))
    theirs = [random.getrandbits(63) for _ in range(3)]
    batches = [_batch(_stored(theirs, None, tokens)), _batch(_offloaded(theirs)), _batch(["BlockRemoved", theirs, "GPU"])]

    async def scenario():
        translator = EventTranslator(MODEL, BS, depth=10**9)
        publisher = vllm_publisher(translator, redis_url, prefix, "vllm-0")
        publisher.start()
        index = RedisIndex(RedisConfig(redis_url, prefix, timeout_s=2.0))
        try:
            while publisher.stats.resyncs < 1:  # registered (nothing held yet); pytest-timeout guards a hang
                assert publisher.stats.errors == 0, "the publisher could not reach Redis"
                await asyncio.sleep(0.01)
            for batch in batches:
                translator.feed(batch, [publisher])
            # the writes: 3 stored on the device, then 3 removed there and 3 stored in the host tier
            while publisher.stats.published < 9:
                assert publisher.stats.errors == 0, "the publisher could not reach Redis"
                await asyncio.sleep(0.01)
            assert (await index.lookup(ours, ["vllm-0"])).replicas["vllm-0"] == ReplicaEntry(3, tier_blocks={HOST: 3})
            assert translator.stats.unknown_media == 0 and publisher.stats.published == 9
        finally:
            await publisher.stop()
            await index.close()

    asyncio.run(scenario())


# ---- pricing ------------------------------------------------------------------------------------
def route() -> RouteRequest:
    return RouteRequest(list(range(16)), 16 * BS + 4, BS)  # 16 full blocks, 4 tokens more


def _hit(rid: str, host: int = 0, disk: int = 0, **load) -> ReplicaView:
    return ReplicaView(rid, matched_blocks=16, host_blocks=host, disk_blocks=disk, **load)


def test_tier_copy_time_is_bytes_over_the_tiers_rate():
    t = TransferModel()
    assert t.tier_s(DEVICE, 1000) == 0.0 and t.tier_s(HOST, 0) == 0.0
    assert t.tier_s(HOST, 1000) == pytest.approx(1000 * t.kv_bytes_per_token / 25e9)
    assert t.tier_s(DISK, 1000) == pytest.approx(1000 * t.kv_bytes_per_token / 4e9)
    assert t.tier_s(HOST, 1000) < t.tier_s(DISK, 1000) < t.prefill_s(1000)  # GPU-like defaults
    assert t.tier_tokens_equiv(HOST, 1000) == pytest.approx(t.tier_s(HOST, 1000) * t.prefill_tokens_per_s)
    with pytest.raises(ValueError):
        TransferModel(host_bytes_per_s=0)
    c = t.calibrated(host_bytes_per_s=5e9, disk_bytes_per_s=0)  # 0: not measured, kept
    assert (c.host_bytes_per_s, c.disk_bytes_per_s, c.fixed_s) == (5e9, t.disk_bytes_per_s, t.fixed_s)


@pytest.mark.parametrize("policy", [AffinityPolicy, AffinityPullPolicy])
def test_device_beats_host_beats_disk_beats_recompute(policy):
    p = policy(seed=0)
    device, host, disk, cold = _hit("d"), _hit("h", host=16), _hit("k", disk=16), ReplicaView("c")
    costs = [p.cost(route(), v) for v in (device, host, disk, cold)]
    assert costs == sorted(costs) and len(set(costs)) == 4
    assert costs[1] == pytest.approx(p.transfer.tier_tokens_equiv(HOST, 16 * BS) + p.miss_weight * 4)
    assert policy(seed=0).choose(route(), [cold, host]).replica_id == "h"  # equally loaded: the host hit
    assert policy(seed=0).choose(route(), [host, device]).replica_id == "d"
    assert policy(seed=0).choose(route(), [disk, host]).replica_id == "h"
    assert policy(seed=0).choose(route(), [cold, disk]).replica_id == "k"


def test_a_partly_lower_tier_match_is_charged_for_that_part_only():
    p = AffinityPolicy(seed=0)
    base = p.cost(route(), _hit("d"))
    assert p.cost(route(), _hit("m", host=6)) - base == pytest.approx(p.transfer.tier_tokens_equiv(HOST, 6 * BS))


@pytest.mark.parametrize("policy", [AffinityPolicy, AffinityPullPolicy])
def test_a_tier_slower_than_recompute_is_priced_as_a_miss(policy):
    """A replica reads a tier back only where that beats recomputing (TransferModel.tier_pays):
    below that rate its hits there are misses, and so is everything past them."""
    slow = TransferModel(disk_bytes_per_s=1e6)
    assert slow.tier_pays(HOST) and not slow.tier_pays(DISK)
    p = policy(seed=0, transfer=slow)
    cold = p.cost(route(), ReplicaView("c"))
    assert p.cost(route(), _hit("k", disk=16)) == pytest.approx(cold)
    assert p.own_hits(route(), ReplicaView("m", matched_blocks=16, host_blocks=4, disk_blocks=8)) == (
        8, pytest.approx(slow.tier_tokens_equiv(HOST, 4 * BS)))


def test_a_block_manager_never_reads_back_a_tier_that_does_not_pay():
    from replica.kvcache.block_manager import BlockManager, BlockTable
    from router.protocol.hashing import block_hashes

    bm = BlockManager(3, BS, host_blocks=4)
    tokens = list(range(2 * BS + 1))
    for prompt in (tokens, [99] * (2 * BS + 1)):  # the second pushes the first's blocks to host
        t = BlockTable(hashes=block_hashes(prompt, BS, 0), token_ids=prompt)
        bm.allocate(t, len(prompt))
        bm.commit(t, prompt, len(prompt), 0)
        bm.free(t)
    bm.tier(HOST).promote = False
    t = BlockTable(hashes=block_hashes(tokens, BS, 0), token_ids=tokens)
    assert bm.allocate(t, len(tokens)) == 0 and t.promoted == {}
    bm.commit(t, tokens, len(tokens), 0)
    assert all(m == DEVICE for h, _, m in bm.held_blocks() if h in t.hashes), "recomputed: the host copy is dropped"


def test_a_pull_source_is_priced_from_its_device_pool_only():
    """A replica exports from its pool: a holder whose match is in its host tier is no source,
    and one with 8 blocks in its pool and 8 in its host tier offers only those 8."""
    busy = {"running": 20, "pending_prefill_tokens": 50_000}
    p = AffinityPullPolicy(seed=0)
    d = p.choose(route(), [_hit("src", host=16, **busy), ReplicaView("idle")])
    assert d.replica_id == "idle" and d.pull is None
    request = route()
    d = p.choose(request, [_hit("src", host=8, **busy), ReplicaView("idle")])
    assert (d.replica_id, d.pull) == ("idle", KvSource("src", 8))
    assert request.fleet_matched == 8


@pytest.mark.parametrize("policy", [AffinityPolicy, AffinityPullPolicy])
def test_tier_rates_are_calibrated_from_the_fleets_heartbeats(redis_server, prefix, policy):
    """Heartbeats in a real Redis -> the load table -> the fleet's median tier rates -> the
    policy's model, as the Ray router calibrates it (`calibrate(**loads.rates())`)."""
    import redis as redis_lib

    keys = RedisKeys(prefix)
    r = redis_lib.Redis.from_url(redis_server.url)
    beats = {"ra": (10e9, 1e9), "rb": (20e9, 0), "rc": (0, 3e9), "rd": (30e9, 2e9)}
    for rid, (host, disk) in beats.items():
        r.hset(keys.heartbeat(rid), mapping={"running": 0, "kv_host_bytes_per_s": int(host),
                                             "kv_disk_bytes_per_s": int(disk), "prefill_tokens_per_s": 1000})

    rates = loads_from_redis(redis_server.url, prefix, list(beats)).rates()
    assert (rates["host_bytes_per_s"], rates["disk_bytes_per_s"]) == (20e9, 2e9)  # medians of the measured
    assert rates["bytes_per_s"] is None  # nobody measured a pull: the default stays
    p = policy(seed=0)
    before = p.own_hits(route(), _hit("h", host=16))[1]
    p.calibrate(**rates)
    t = p.transfer
    assert (t.host_bytes_per_s, t.disk_bytes_per_s, t.prefill_tokens_per_s) == (20e9, 2e9, 1000)
    assert t.bytes_per_s == TransferModel().bytes_per_s
    assert p.own_hits(route(), _hit("h", host=16))[1] < before  # a slower prefill makes a copy relatively cheaper
    r.delete(*(keys.heartbeat(rid) for rid in beats))
    r.close()
