"""Pulling a prefix's K/V from the replica that holds it (docs/kv-pull.md).

Engine level: two LLMEngine instances of the same model, blocks exported from one and imported
into the other; greedy output must equal a plain recompute for every tiny family. Block
manager level: pinning and importing keep ref counts, LRU and events as a computed block would.
"""

from __future__ import annotations

import numpy as np
import pytest

from replica.kv_io import kv_transfer
from replica.kvcache.block_manager import BlockManager, BlockTable
from router.protocol.hashing import block_hashes
from router.protocol.sampling import SamplingParams
from tests.helpers.engine import TINY_FAMILIES

BS = 4


class Listener:
    def __init__(self) -> None:
        self.stored_events: list[tuple[list[int], list[int]]] = []
        self.removed_events: list[int] = []

    def stored(self, hashes, positions) -> None:
        self.stored_events.append((list(hashes), list(positions)))

    def removed(self, hashes) -> None:
        self.removed_events.extend(hashes)

    def cleared(self) -> None:
        pass


def _engine(path: str, num_blocks: int = 64):
    from replica.engine import LLMEngine

    return LLMEngine(path, block_size=BS, num_blocks=num_blocks)


def _prompt(n: int, seed: int = 0) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(3, 380, size=n)]


GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def _run(engine, prompt, kv=None):
    rid = engine.add_request(prompt, GREEDY, kv_prefix=kv)
    while True:
        for out in engine.step():
            if out.request_id == rid and out.finished:
                return out


# ---- engine level: pulled == recomputed, every family ------------------------------------------
@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_pulled_prefix_gives_recompute_output(tiny_model_dirs, family):
    holder, puller = _engine(tiny_model_dirs[family]), _engine(tiny_model_dirs[family])
    listener = Listener()
    puller.add_listener(listener)
    prompt = _prompt(42, seed=1)
    recomputed = _run(holder, prompt)  # cold: every token computed; leaves the prompt cached
    assert recomputed.num_cached_tokens == 0

    assert holder.blocks.cached_hashes(), "the holder caches the prompt's full blocks"
    hashes = block_hashes(prompt, BS, puller.hash_seed(None))
    kv = kv_transfer.export_prefix(holder, hashes, prompt)
    assert kv.num_blocks == len(hashes) == 42 // BS
    assert kv.hashes == hashes
    # the holder's pins were released: every block is back in its LRU, none in use
    assert holder.blocks.num_used == 0

    pulled = _run(puller, prompt, kv)
    assert kv.nbytes == 0  # the payload's arrays were released once copied into the pool
    usable = (len(prompt) - 1) // BS  # the last prompt token is always computed
    assert pulled.num_cached_tokens == usable * BS
    assert pulled.token_ids == recomputed.token_ids
    assert puller.kv_imported_blocks == usable
    # announced to the index listeners exactly as computed blocks are: hashes with their positions
    imported = [(h, p) for hs, ps in listener.stored_events for h, p in zip(hs, ps, strict=True)]
    assert imported[:usable] == [(hashes[i], i) for i in range(usable)]


def test_pull_of_the_blocks_past_what_the_puller_holds(tiny_model_dirs):
    """The puller holds the first blocks already (a shared system prompt): only the rest travel."""
    holder, puller = _engine(tiny_model_dirs["qwen2"]), _engine(tiny_model_dirs["qwen2"])
    prompt = _prompt(42, seed=5)
    recomputed = _run(holder, prompt)
    _run(puller, prompt[:13] + _prompt(6, seed=6))  # caches blocks 0-2 of the prompt on the puller
    hashes = block_hashes(prompt, BS, holder.hash_seed(None))
    kv = kv_transfer.export_prefix(holder, hashes, prompt, first=3)
    assert kv.first == 3 and kv.num_blocks == len(hashes) - 3 and kv.hashes == hashes[3:]
    pulled = _run(puller, prompt, kv)
    assert pulled.num_cached_tokens == (len(prompt) - 1) // BS * BS
    assert pulled.token_ids == recomputed.token_ids


def test_bf16_pool_and_read_only_payload(tiny_model_dirs):
    """bf16 travels as its bits (numpy has no bf16); a read-only payload (zero-copy out of Ray's
    object store) imports as well."""
    from replica.engine import LLMEngine

    holder, puller = (LLMEngine(tiny_model_dirs["mistral"], block_size=BS, num_blocks=64, dtype="bfloat16") for _ in range(2))
    prompt = _prompt(33, seed=7)
    recomputed = _run(holder, prompt)
    kv = kv_transfer.export_prefix(holder, block_hashes(prompt, BS, holder.hash_seed(None)), prompt)
    assert kv.dtype == "bfloat16" and kv.k.dtype == np.int16
    kv.k.flags.writeable = False
    kv.v.flags.writeable = False
    pulled = _run(puller, prompt, kv)
    assert pulled.num_cached_tokens == 32 and pulled.token_ids == recomputed.token_ids


def test_corrupted_payload_changes_output(tiny_model_dirs):
    """Control: the parity above could fail. Same hashes, K/V scaled: another greedy output."""
    holder, puller = _engine(tiny_model_dirs["llama"]), _engine(tiny_model_dirs["llama"])
    prompt = _prompt(42, seed=1)
    recomputed = _run(holder, prompt)
    kv = kv_transfer.export_prefix(holder, block_hashes(prompt, BS, holder.hash_seed(None)), prompt)
    kv.k = kv.k * -3.0
    kv.v = kv.v * -3.0
    pulled = _run(puller, prompt, kv)
    assert pulled.num_cached_tokens > 0
    assert pulled.token_ids != recomputed.token_ids


def test_incompatible_payload_is_recomputed(tiny_model_dirs):
    """Blocks of another shape or dtype are refused, and the request is simply computed."""
    holder, puller = _engine(tiny_model_dirs["llama"]), _engine(tiny_model_dirs["llama"])
    prompt = _prompt(30, seed=2)
    recomputed = _run(holder, prompt)
    kv = kv_transfer.export_prefix(holder, block_hashes(prompt, BS, holder.hash_seed(None)), prompt)
    kv.dtype = "float16"
    pulled = _run(puller, prompt, kv)
    assert pulled.num_cached_tokens == 0 and pulled.token_ids == recomputed.token_ids
    assert puller.kv_import_failures == 1 and puller.blocks.num_used == 0


def test_payload_torch_refuses_is_recomputed(tiny_model_dirs):
    """A payload that passes the shape check but makes torch raise on the copy (float64 arrays
    labelled float32): the request is computed, the failure counted, nothing left behind."""
    holder, puller = _engine(tiny_model_dirs["llama"]), _engine(tiny_model_dirs["llama"])
    prompt = _prompt(30, seed=13)
    recomputed = _run(holder, prompt)
    kv = kv_transfer.export_prefix(holder, block_hashes(prompt, BS, holder.hash_seed(None)), prompt)
    kv.k, kv.v = kv.k.astype(np.float64), kv.v.astype(np.float64)
    seeded = SamplingParams(max_tokens=12, temperature=0.8, seed=7, ignore_eos=True)  # sampler state per request
    rid = puller.add_request(prompt, seeded, kv_prefix=kv)
    assert puller.kv_import_failures == 1 and kv.nbytes == 0
    assert puller.blocks.num_cached == 0 and not puller.blocks.hash_to_block  # nothing half-imported
    out = None
    while out is None:
        out = next((o for o in puller.step() if o.request_id == rid and o.finished), None)
    assert out.num_cached_tokens == 0 and len(out.token_ids) == 12
    assert puller.blocks.num_used == 0 and not puller.sampler._generators  # finished: nothing kept
    assert _run(puller, prompt).token_ids == recomputed.token_ids  # the engine still serves


def test_foreign_hashes_are_never_imported(tiny_model_dirs):
    """A payload for another prompt (or tenant) shares no hash with this prompt: nothing enters."""
    holder, puller = _engine(tiny_model_dirs["llama"]), _engine(tiny_model_dirs["llama"])
    other = _prompt(30, seed=3)
    _run(holder, other)
    kv = kv_transfer.export_prefix(holder, block_hashes(other, BS, holder.hash_seed(None)), other)
    prompt = _prompt(30, seed=4)
    pulled = _run(puller, prompt, kv)
    assert pulled.num_cached_tokens == 0 and puller.kv_imported_blocks == 0


# ---- block manager: pin, import ---------------------------------------------------------------
def _cache(bm: BlockManager, hashes: list[int]) -> list[int]:
    """Compute-and-free a sequence whose blocks get `hashes` (no tokens: the simulator's way)."""
    table = BlockTable()
    bm.allocate(table, len(hashes) * BS + 1)
    table.hashes = list(hashes)
    table.num_registered = 0
    for i, h in enumerate(hashes):
        block = table.block_ids[i]
        bm.hash_to_block[h] = block
        bm.block_hash[block] = h
    table.num_registered = len(hashes)
    blocks = table.block_ids[: len(hashes)]
    bm.free(table)
    return blocks


def test_pinned_blocks_survive_eviction_pressure():
    bm = BlockManager(num_blocks=8, block_size=BS)
    blocks = _cache(bm, [11, 12, 13])
    pinned = bm.pin_prefix([11, 12, 99, 13])  # the leading run only: stops at the first miss
    assert pinned == blocks[:2]
    assert all(bm.ref_count[b] == 1 for b in pinned)
    # take every block that can be taken: the pinned ones are not among them
    table = BlockTable()
    bm.allocate(table, bm.num_available * BS)
    assert not set(table.block_ids) & set(pinned)
    assert bm.hash_to_block[11] == pinned[0] and bm.hash_to_block[12] == pinned[1]
    bm.unpin(pinned)
    assert bm.num_cached == 2 and all(bm.ref_count[b] == 0 for b in pinned)


def test_pin_checks_tokens_against_collisions():
    bm = BlockManager(num_blocks=8, block_size=BS)
    table = BlockTable(token_ids=list(range(9)))
    bm.allocate(table, 9)
    bm.commit(table, list(range(9)), 8, seed=5)
    hashes = list(table.hashes)
    bm.free(table)
    run = bm.pin_prefix(hashes, list(range(9)))
    assert len(run) == 2
    bm.unpin(run)  # balanced: back to zero references
    assert bm.num_used == 0
    wrong = [0, 1, 2, 3, 40, 41, 42, 43, 8]  # block 1 holds other tokens under the same hash
    run = bm.pin_prefix(hashes, wrong)
    assert len(run) == 1
    bm.unpin(run)
    assert bm.num_used == 0


def test_import_registers_blocks_like_computed_ones():
    bm = BlockManager(num_blocks=6, block_size=BS)
    listener = Listener()
    bm.listeners.append(listener)
    _cache(bm, [1])  # block for hash 1 already held: skipped
    pairs = bm.begin_import([1, 2, 3])
    assert [i for i, _ in pairs] == [1, 2]
    assert bm.finish_import(pairs, [1, 2, 3], None) == 2
    assert listener.stored_events[-1] == ([2, 3], [1, 2])
    assert {h for h, _ in bm.cached_hashes()} == {1, 2, 3}
    assert bm.num_used == 0 and bm.num_cached == 3
    # a later request hits all three, exactly as for computed blocks
    table = BlockTable(hashes=[1, 2, 3])
    assert bm.allocate(table, 3 * BS + 1) == 3 * BS


def test_import_never_evicts_the_prompts_own_blocks_and_stops_when_full():
    bm = BlockManager(num_blocks=4, block_size=BS)
    listener = Listener()
    bm.listeners.append(listener)
    _cache(bm, [1])  # the oldest LRU entry: evicting it would break the prompt's chain
    _cache(bm, [7, 8])  # another prompt, newer
    pairs = bm.begin_import([1, 2, 3, 4, 5])
    assert len(pairs) == 3  # all the pool has besides block 1
    assert 1 in bm.hash_to_block
    bm.finish_import(pairs, [1, 2, 3, 4, 5], None)
    assert {h for h, _ in bm.cached_hashes()} == {1, 2, 3, 4}
    assert sorted(listener.removed_events) == [7, 8]


def test_aborted_import_registers_nothing():
    bm = BlockManager(num_blocks=4, block_size=BS)
    pairs = bm.begin_import([5, 6])
    bm.abort_import(pairs)
    assert bm.num_free == 4 and bm.num_cached == 0 and not bm.hash_to_block


# ---- the replica's export: pinned on the engine thread, read off it, released as next to evict --
def test_export_through_the_engine_loop_demotes_the_holders_copy(tiny_model_dirs):
    import asyncio

    from replica.async_engine import AsyncLLMEngine
    from replica.kv_io.kv_pull import KvPuller

    engine = _engine(tiny_model_dirs["llama"])
    prompt, other = _prompt(42, seed=8), _prompt(42, seed=9)
    _run(engine, prompt)
    _run(engine, other)  # newer in the LRU than the prompt's blocks
    hashes = block_hashes(prompt, BS, engine.hash_seed(None))
    looped = AsyncLLMEngine(engine)
    try:
        puller = KvPuller(looped, "holder")
        kv = asyncio.run(puller.export(hashes, prompt, 2))
        missing = asyncio.run(puller.export(block_hashes(_prompt(20, seed=10), BS, engine.hash_seed(None)), None, 0))
    finally:
        looped.shutdown()
    assert kv.first == 2 and kv.hashes == hashes[2:] and missing is None
    assert engine.blocks.num_used == 0  # every pin released
    # the exported blocks are now the next to evict (last block first), ahead of the older-used prompt's head
    lru = list(engine.blocks.pool.lru)
    exported = [engine.blocks.hash_to_block[h] for h in hashes[2:]]
    assert lru[: len(exported)] == exported[::-1]
    assert puller.snapshot().exports == 1 and puller.stats.exported_bytes == kv.nbytes


def test_slow_or_failing_holder_means_recompute(tiny_model_dirs):
    """The puller's fallbacks (a holder that answers too late, or with an error): no payload,
    counted by outcome; hints for itself or for blocks it holds need no round trip."""
    import asyncio

    from replica.async_engine import AsyncLLMEngine
    from replica.kv_io.kv_pull import KvPullConfig, KvPuller
    from router.protocol.messages import KvSource

    class Holder:  # stands in for the transport: what the holder's side answers
        def __init__(self, delay_s: float = 0.0, error: Exception | None = None) -> None:
            self.delay_s, self.error, self.calls = delay_s, error, 0

        async def call(self, replica_id, method, *args):
            self.calls += 1
            await asyncio.sleep(self.delay_s)
            if self.error:
                raise self.error
            return None

    engine = _engine(tiny_model_dirs["llama"])
    prompt = _prompt(42, seed=11)
    looped = AsyncLLMEngine(engine)
    try:
        slow = KvPuller(looped, "me", KvPullConfig(timeout_s=0.05), caller=Holder(delay_s=30))
        assert asyncio.run(slow.pull(KvSource("other", 8), prompt, None)) is None
        broken = KvPuller(looped, "me", caller=Holder(error=RuntimeError("actor died")))
        assert asyncio.run(broken.pull(KvSource("other", 8), prompt, None)) is None
        empty = KvPuller(looped, "me", caller=Holder())
        assert asyncio.run(empty.pull(KvSource("other", 8), prompt, None)) is None
        assert asyncio.run(empty.pull(KvSource("me", 8), prompt, None)) is None  # the holder is itself
        assert asyncio.run(empty.pull(KvSource("other", 8), [-1] * 40, None)) is None  # not token ids: no pull
        _run(engine, prompt)
        assert asyncio.run(empty.pull(KvSource("other", 8), prompt, None)) is None  # held here already
    finally:
        looped.shutdown()
    assert (slow.stats.timeouts, slow.stats.pulls) == (1, 1)
    assert broken.stats.failed == 1 and "actor died" in broken.stats.last_error
    assert (empty.stats.empty, empty.stats.skipped, empty.caller.calls) == (1, 3, 1)


def test_export_cancelled_after_the_pin_ran_releases_the_pins(tiny_model_dirs):
    """The asker gives up (timeout, death) after the engine thread pinned the blocks but before
    the export's task saw the block ids: the pins must still go, or the blocks leak forever.
    The engine thread is held by two commands around the pin, so the cancel lands in that window."""
    import asyncio
    import threading

    from replica.async_engine import AsyncLLMEngine
    from replica.kv_io.kv_pull import KvPuller

    engine = _engine(tiny_model_dirs["llama"])
    prompt = _prompt(42, seed=12)
    _run(engine, prompt)
    hashes = block_hashes(prompt, BS, engine.hash_seed(None))
    looped = AsyncLLMEngine(engine)
    holding, before, after, pinned_ran = (threading.Event() for _ in range(4))

    async def scenario() -> list[int]:
        puller = KvPuller(looped, "holder")
        looped.post(lambda e: (holding.set(), before.wait(10)))  # holds the engine thread
        assert await asyncio.to_thread(holding.wait, 10)  # the pin will queue behind it
        export = asyncio.ensure_future(puller.export(hashes, prompt, 0))
        for _ in range(1000):  # until the export has posted its pin
            await asyncio.sleep(0)
            if looped._inbox:
                break
        assert looped._inbox, "the export never posted its pin"

        def hold(e) -> None:  # runs right after the pin, in the same drain: results not yet delivered
            pinned_ran.set()
            after.wait(10)

        looped.post(hold)
        before.set()
        assert await asyncio.to_thread(pinned_ran.wait, 10)
        assert engine.blocks.num_used == len(hashes)  # pinned by the export
        export.cancel()
        await asyncio.sleep(0)
        after.set()
        with pytest.raises(asyncio.CancelledError):
            await export
        refs: list[int] = []
        for _ in range(200):  # the release is posted once the pin's answer arrives
            refs = await looped.submit(lambda e: list(e.blocks.ref_count))
            if not any(refs):
                break
            await asyncio.sleep(0.05)
        return refs

    try:
        refs = asyncio.run(scenario())
    finally:
        before.set()
        after.set()
        looped.shutdown()
    assert not any(refs), "blocks stay pinned after a cancelled export"
    assert engine.blocks.num_cached >= len(hashes)


# ---- what the heartbeat says about pulls -------------------------------------------------------
def test_pulls_in_flight_count_in_the_heartbeat_load(tiny_model_dirs):
    """A request waiting for its holder is queued work: waiting +1 and its prompt pending, until
    the pull ends (whatever its outcome)."""
    import asyncio

    from replica.async_engine import AsyncLLMEngine
    from replica.kv_io.kv_pull import KvPuller
    from replica.kv_io.pull_load import add_pull_load
    from router.protocol.messages import KvSource

    class GatedHolder:
        def __init__(self) -> None:
            self.asked = asyncio.Event()
            self.answer = asyncio.Event()

        async def call(self, replica_id, method, *args):
            self.asked.set()
            await self.answer.wait()
            return None

    looped = AsyncLLMEngine(_engine(tiny_model_dirs["llama"]))
    prompt = _prompt(42, seed=14)

    async def scenario() -> tuple[dict, dict]:
        holder = GatedHolder()
        puller = KvPuller(looped, "me", caller=holder)
        pulling = asyncio.ensure_future(puller.pull(KvSource("other", 8), prompt, None))
        await asyncio.wait_for(holder.asked.wait(), 10)
        during = add_pull_load({"waiting": 2, "pending_prefill_tokens": 100}, puller)
        holder.answer.set()
        assert await pulling is None
        return during, add_pull_load({"waiting": 2, "pending_prefill_tokens": 100}, puller)

    try:
        during, after = asyncio.run(scenario())
    finally:
        looped.shutdown()
    assert (during["waiting"], during["pending_prefill_tokens"]) == (3, 100 + len(prompt))
    assert (after["waiting"], after["pending_prefill_tokens"]) == (2, 100)


def test_measured_pull_rate_expires_to_not_measured():
    """One slow pull must not price pulls out for good: with no pull for rate_ttl_s the rate
    reads 0 (the router's default applies), and the next pull is measured afresh."""
    from replica.kv_io.kv_pull import KvPullConfig, KvPuller

    now = [1000.0]
    puller = KvPuller(None, "me", KvPullConfig(rate_ttl_s=60.0), clock=lambda: now[0])  # type: ignore[arg-type]
    assert puller.heartbeat()["kv_pull_bytes_per_s"] == 0
    puller.record_rate(1_000_000, 10.0)  # a slow pull: 100 KB/s
    now[0] += 59.0
    assert puller.heartbeat()["kv_pull_bytes_per_s"] == 100_000
    now[0] += 2.0
    assert puller.heartbeat()["kv_pull_bytes_per_s"] == 0
    assert puller.snapshot().bytes_per_s == 0
    puller.record_rate(50_000_000, 0.01)  # fast again: only this pull counts
    assert puller.heartbeat()["kv_pull_bytes_per_s"] == 5_000_000_000


def test_every_pull_pricing_field_is_a_heartbeat_field():
    """The routers read only LOAD_FIELDS: a misspelt key would silently leave the router
    on its defaults. Covers the puller's measured rates, the sim engine's modelled ones and the
    K/V size per token, as the replica's heartbeat assembles them."""
    from replica.backends.sim_engine import SimEngine
    from replica.kv_io.kv_pull import KvPuller
    from replica.kv_io.pull_load import add_pull_load
    from router.protocol.redis_schema import LOAD_FIELDS, Heartbeat

    puller = KvPuller(None, "me")  # type: ignore[arg-type]
    puller.record_rate(1_000, 1.0)
    modelled = SimEngine().pull_rates()
    written = add_pull_load({}, puller, kv_bytes_per_token=46_080, modelled_rates=modelled)
    assert set(puller.heartbeat()) | set(modelled) | {"kv_bytes_per_token"} <= set(written)
    assert set(written) <= set(LOAD_FIELDS), set(written) - set(LOAD_FIELDS)
    Heartbeat(**written)  # and the typed heartbeat takes every one of them
    assert "kv_bytes_per_token" in written and all(written[k] > 0 for k in modelled)
