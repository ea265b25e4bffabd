"""vLLM KV events -> our index, over a real ZMQ PUB socket on loopback and a real Redis
(standalone and cluster).

The installed Ray (2.60) ships no copy of vLLM's event structs (its KV-aware router delegates
to Dynamo), so the publishing side here is an independent encoding of vLLM's wire format
written with the plain `msgpack` library: [ts, [["BlockStored", hashes, parent, token_ids,
block_size, lora_id, medium], ...], dp_rank] after a topic frame and an 8-byte big-endian
sequence number. Our msgspec structs must produce exactly those bytes. vLLM's hashes are
random here (seeded per process, as vLLM's are): the adapter must re-hash from token ids.
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid

import msgpack
import zmq
import zmq.asyncio

from gateway.local_redis import free_port
from router.index.redis_index import RedisConfig, RedisIndex
from router.protocol.events import BlockRemoved, BlockStored, KVEventBatch, encode_batch
from router.protocol.hashing import block_hashes, chain_seed
from router.protocol.media import DEVICE
from router.vllm_events import EventTranslator, pump_events
from tests.helpers.index import vllm_publisher

BS = 4
MODEL = "vllm-model"


def vllm_payload(ts: float, events: list[list]) -> bytes:
    """What vLLM's ZmqEventPublisher puts in a message's payload frame (dp rank None)."""
    return msgpack.packb([ts, events, None])


def stored(hashes, parent, tokens):
    return ["BlockStored", hashes, parent, tokens, BS, None, None]


def test_our_structs_encode_vllms_wire_format():
    ours = KVEventBatch(ts=1.25, events=[BlockStored([7, 8], None, list(range(8)), BS), BlockRemoved([8])])
    array_form = [*stored([7, 8], None, list(range(8))), None, None]  # lora_name, extra_keys
    assert encode_batch(ours) == vllm_payload(1.25, [array_form, ["BlockRemoved", [8], None]])


def test_map_shaped_events_of_vllm_0_32_decode_with_the_tenant_salt():
    """vLLM 0.32 sends each event as a map tagged by "type", with fields we do not use (measured
    on its CPU build); a salted prompt's first block carries the salt in extra_keys, and the
    translator chains that prompt from the tenant's own root, as our router hashes it."""
    from router.protocol.events import decode_batch

    tokens = list(range(200, 208))
    a, b = random.getrandbits(63), random.getrandbits(63)
    event = {"type": "BlockStored", "block_hashes": [a, b], "parent_block_hash": None, "token_ids": tokens,
             "block_size": BS, "lora_id": None, "medium": "GPU", "lora_name": None,
             "extra_keys": [["tenant-a"], None], "group_idx": 0, "kv_cache_spec_kind": "full_attention"}
    batch = decode_batch(msgpack.packb([2.5, [event, {"type": "BlockRemoved", "block_hashes": [b], "medium": "GPU"},
                                              {"type": "AllBlocksCleared"}], 0]))
    assert [type(e).__name__ for e in batch.events] == ["BlockStored", "BlockRemoved", "AllBlocksCleared"]
    assert batch.events[0].medium == "GPU" and batch.events[0].cache_salt() == "tenant-a"
    t = EventTranslator(MODEL, BS, depth=64)
    writes = t.translate(batch)
    salted = block_hashes(tokens, BS, chain_seed(MODEL, "tenant-a"))
    assert writes == [("+", salted, DEVICE), ("-", salted[1:], DEVICE), ("clear", [], DEVICE)]
    assert salted != block_hashes(tokens, BS, chain_seed(MODEL))


def test_translator_rehashes_with_our_spec_and_skips_orphans():
    from router.protocol.events import decode_batch

    t = EventTranslator(MODEL, BS, depth=64)
    tokens = list(range(100, 116))  # 4 blocks
    ours = block_hashes(tokens, BS, chain_seed(MODEL))
    a, b = random.getrandbits(63), random.getrandbits(63)
    writes = t.translate(decode_batch(vllm_payload(0.0, [stored([a, 1, 2], None, tokens[:12]), stored([b], 2, tokens[12:])])))
    assert writes == [("+", ours[:3], DEVICE), ("+", ours[3:], DEVICE)]
    orphan = t.translate(decode_batch(vllm_payload(0.0, [stored([9], 12345, [1, 2, 3, 4])])))
    assert orphan == [] and t.stats.skipped == 1
    assert t.translate(decode_batch(vllm_payload(0.0, [["BlockRemoved", [b], None]]))) == [("-", ours[3:], DEVICE)]


def test_vllm_stream_feeds_the_index(redis_url):
    """vLLM's events over a real ZMQ socket, through the vLLM backend's own receiving loop
    (`pump_events`) and a replica's publisher, into Redis, matched under our hashes."""
    prefix = f"v{uuid.uuid4().hex[:8]}"
    port = free_port()
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind(f"tcp://127.0.0.1:{port}")
    seq = 0

    def send(events):
        nonlocal seq
        pub.send_multipart([b"kv", seq.to_bytes(8, "big", signed=True), vllm_payload(time.time(), events)])
        seq += 1

    async def scenario():
        nonlocal seq
        translator = EventTranslator(MODEL, BS, depth=10**9)  # as the vLLM backend makes it
        publisher = vllm_publisher(translator, redis_url, prefix, "vllm-0")
        publisher.start()
        sub = zmq.asyncio.Context.instance().socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(f"tcp://127.0.0.1:{port}")
        pump = asyncio.get_running_loop().create_task(pump_events(sub, translator, [publisher]))
        index = RedisIndex(RedisConfig(redis_url, prefix, timeout_s=0.5))
        try:
            async def until(check, what):
                deadline = time.monotonic() + 10
                while not await check():
                    assert time.monotonic() < deadline, what
                    await asyncio.sleep(0.05)

            async def connected():  # ZMQ drops what a PUB sends before the SUB has joined
                send([["AllBlocksCleared"]])
                return translator.stats.batches > 0

            await until(connected, "the loop never received a batch")
            system, question = list(range(1000, 1012)), [5, 6, 7, 8, 9, 10, 11, 12]
            ours = block_hashes(system + question, BS, chain_seed(MODEL))  # what the router computes
            vllm = [random.getrandbits(63) for _ in range(5)]  # vLLM's own per-process hashes
            send([stored(vllm[:3], None, system)])
            send([stored(vllm[3:], vllm[2], question)])

            async def matched(n):
                look = await index.lookup(ours, ["vllm-0"], None)
                return look.replicas["vllm-0"].matched_blocks == n

            await until(lambda: matched(5), "stored blocks not routable under our hashes")
            send([["BlockRemoved", [vllm[4]], None]])
            await until(lambda: matched(4), "removed block still matched")
            send([["AllBlocksCleared"]])
            await until(lambda: matched(0), "cleared blocks still matched")
            assert translator.stats.gaps == 0 and translator.stats.bad_messages == 0
            pub.send_multipart([b"kv", seq.to_bytes(8, "big"), b"\xc1 not msgpack"])
            await until(lambda: _true(translator.stats.bad_messages == 1), "bad payload not counted")
            seq += 4  # four sequence numbers never arrived (the bad message's counts among them)
            send([["AllBlocksCleared"]])
            await until(lambda: _true(translator.stats.gaps == 4), "missed sequence numbers not counted")
        finally:
            pump.cancel()
            sub.close()
            await publisher.stop()
            await index.close()

    try:
        asyncio.run(scenario())
    finally:
        pub.close()
        ctx.term()


async def _true(value: bool) -> bool:
    return value
