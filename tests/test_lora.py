"""LoRA adapters in our engine: parity with transformers + PeftModel, mixed batches, the adapter
in the cache key, slots and host residency, and every refusal (replica/model/lora.py)."""

from __future__ import annotations

import json
import shutil

import pytest

from replica.core.adapter_slots import AdapterSlots
from router.protocol.hashing import block_hashes, chain_seed
from router.protocol.lora import AdapterError, adapter_ref, parse_spec
from tests.helpers.engine import TINY_FAMILIES, reference_greedy
from tests.helpers.lora import ATTENTION, ATTENTION_MLP, make_adapter, peft_model

PROMPT = list(range(5, 45))  # 40 tokens: two full blocks of 16
N = 12


@pytest.fixture(scope="module")
def adapters(tiny_model_dirs, tmp_path_factory) -> dict[str, dict[str, str]]:
    """Per tiny family: an attention-only rank-4 adapter and an attention+MLP rank-8 rsLoRA one."""
    out = {}
    for family in TINY_FAMILIES:
        d = tmp_path_factory.mktemp(f"lora-{family}")
        model = tiny_model_dirs[family]
        out[family] = {
            "attn": make_adapter(model, str(d / "attn"), ATTENTION, 4, seed=1),
            "mlp": make_adapter(model, str(d / "mlp"), ATTENTION_MLP, 8, seed=2, alpha=8, rslora=True),
        }
    return out


def engine_for(model_dir: str, adapters: dict[str, str], **kwargs):
    from replica.engine import EngineConfig, LLMEngine

    return LLMEngine(config=EngineConfig(model=model_dir, num_blocks=64, lora_adapters=adapters, **kwargs))


def greedy(max_tokens: int = N):
    from replica.engine import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def run(engine, requests: list[tuple[list[int], str | None]]) -> list:
    """Submit all, step to the end together; the finished outputs in submission order."""
    ids = [engine.add_request(p, greedy(), adapter=a) for p, a in requests]
    done = {}
    while len(done) < len(ids):
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return [done[i] for i in ids]


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_greedy_output_equals_peft_model(family, tiny_model_dirs, adapters):
    model = tiny_model_dirs[family]
    engine = engine_for(model, adapters[family])
    for name, path in adapters[family].items():
        ref = reference_greedy(peft_model(model, path), PROMPT, N, stop_at_eos=False)
        [out] = run(engine, [(PROMPT, name)])
        assert out.token_ids == ref, name


def test_base_and_two_adapters_in_one_batch_equal_each_alone(tiny_model_dirs, adapters):
    model, ads = tiny_model_dirs["llama"], adapters["llama"]
    alone = {a: run(engine_for(model, ads), [(PROMPT, a)])[0].token_ids for a in (None, "attn", "mlp")}
    assert len({tuple(t) for t in alone.values()}) == 3  # each adapter changes the output
    engine = engine_for(model, ads)
    other = list(range(100, 137))
    mixed = run(engine, [(PROMPT, None), (PROMPT, "attn"), (other, "mlp"), (PROMPT, "mlp"), (other, None)])
    assert [o.token_ids for o in mixed[:2]] + [mixed[3].token_ids] == [alone[None], alone["attn"], alone["mlp"]]
    assert mixed[2].token_ids == run(engine_for(model, ads), [(other, "mlp")])[0].token_ids


def test_no_cache_hit_across_adapters_and_a_hit_under_the_same_one(tiny_model_dirs, adapters):
    engine = engine_for(tiny_model_dirs["llama"], adapters["llama"])
    [first] = run(engine, [(PROMPT, "attn")])
    assert first.num_cached_tokens == 0
    [other] = run(engine, [(PROMPT, "mlp")])
    [base] = run(engine, [(PROMPT, None)])
    assert other.num_cached_tokens == 0 and base.num_cached_tokens == 0
    [again] = run(engine, [(PROMPT, "attn")])
    assert again.num_cached_tokens == 32 and again.token_ids == first.token_ids


def test_one_slot_and_one_resident_adapter_reload_with_the_same_output(tiny_model_dirs, adapters):
    model, ads = tiny_model_dirs["qwen2"], adapters["qwen2"]
    engine = engine_for(model, ads, max_loras=1, max_cpu_loras=1)
    reads = engine.lora_store.disk_reads
    first = {a: run(engine, [(PROMPT, a)])[0].token_ids for a in ("attn", "mlp")}
    # both at once: one batch slot, so they run one after the other, each still right
    both = run(engine, [(list(range(60, 90)), "attn"), (list(range(60, 90)), "mlp"), (PROMPT, "attn")])
    assert both[2].token_ids == first["attn"]
    assert both[0].token_ids != both[1].token_ids
    assert engine.lora_store.disk_reads > reads  # evicted from host memory and read again
    assert len(engine.lora_store.resident) == 1
    assert run(engine, [(PROMPT, "mlp")])[0].token_ids == first["mlp"]


def test_an_adapter_evicted_from_host_memory_while_in_its_slot_is_resident_again_when_it_runs(tiny_model_dirs, adapters, tmp_path):
    """A run-time load can evict an adapter from host memory while it still sits in a batch slot;
    its next request must list it resident again (the heartbeat's `lora_resident` reads this)."""
    model, ads = tiny_model_dirs["qwen2"], adapters["qwen2"]
    engine = engine_for(model, ads, max_loras=2, max_cpu_loras=2)
    run(engine, [(PROMPT, "attn"), (PROMPT, "mlp")])  # both in slots and in host memory
    late = make_adapter(model, str(tmp_path / "late"), ATTENTION, 4, seed=5)
    engine.add_adapter(adapter_ref("late", late))  # read: the least recently used leaves host memory
    evicted = next(n for n in ("attn", "mlp") if engine.adapters[n].identity not in engine.lora_store.resident)
    reads = engine.lora_store.disk_reads
    run(engine, [(PROMPT, evicted)])  # its slot still holds it
    assert engine.adapters[evicted].identity in engine.lora_store.resident
    assert engine.lora_store.disk_reads == reads  # from the slot's copy: no disk read on the step path
    assert len(engine.lora_store.resident) == 2


def test_refusals_name_the_problem(tiny_model_dirs, adapters, tmp_path):
    from replica.core.engine_types import UnknownAdapterError
    from replica.engine import InvalidRequestError

    model, ads = tiny_model_dirs["llama"], adapters["llama"]
    with pytest.raises(InvalidRequestError, match=r"mlp: rank 8 of .* exceeds max_lora_rank 4"):
        engine_for(model, ads, max_lora_rank=4)  # refused at start, naming the adapter's directory
    engine = engine_for(model, {"attn": ads["attn"]}, max_lora_rank=4)
    with pytest.raises(UnknownAdapterError, match="'nope'"):
        engine.add_request(PROMPT, greedy(), adapter="nope")
    with pytest.raises(InvalidRequestError, match="exceeds max_lora_rank 4"):
        engine.add_adapter(adapter_ref("mlp", ads["mlp"]))
    # an adapter of another model: judged by its tensors' shapes, not its config's base model name
    import torch
    from transformers import AutoModelForCausalLM

    from tests.helpers.engine import tiny_config

    config = tiny_config("llama")
    config.intermediate_size = 96  # same architecture and names, other MLP shapes
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "other")
    wider = make_adapter(str(tmp_path / "other"), str(tmp_path / "other-lora"), ATTENTION_MLP, 4, seed=3)
    with pytest.raises(InvalidRequestError, match="another model"):
        engine.add_adapter(adapter_ref("wide", wider))
    broken = tmp_path / "broken"
    shutil.copytree(ads["attn"], broken)
    (broken / "adapter_config.json").write_text("{not json")
    with pytest.raises(AdapterError, match="not valid JSON"):
        adapter_ref("broken", broken)
    with pytest.raises(AdapterError, match="does not exist"):
        adapter_ref("gone", tmp_path / "missing")
    dora = tmp_path / "dora"
    shutil.copytree(ads["attn"], dora)
    config = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(InvalidRequestError, match="DoRA"):
        engine.add_adapter(adapter_ref("dora", dora))
    # the engine still serves its adapters after every refusal
    assert run(engine, [(PROMPT, "attn")])[0].token_ids == run(engine_for(model, ads), [(PROMPT, "attn")])[0].token_ids


def test_unload_refused_in_flight_then_done(tiny_model_dirs, adapters):
    from replica.engine import InvalidRequestError

    engine = engine_for(tiny_model_dirs["llama"], adapters["llama"])
    rid = engine.add_request(PROMPT, greedy(), adapter="attn")
    with pytest.raises(InvalidRequestError, match="in flight"):
        engine.remove_adapter("attn")
    engine.abort(rid)
    engine.remove_adapter("attn")
    assert "attn" not in engine.adapters


def test_lora_turns_compile_off(tiny_model_dirs, adapters):
    engine = engine_for(tiny_model_dirs["llama"], adapters["llama"], compile=True)
    assert engine.runner.compiled is None


# ---- pure: the contract and the slots ----------------------------------------------------------
def test_adapter_identity_roots_the_hash_chain(tmp_path):
    tokens = list(range(48))
    base = block_hashes(tokens, 16, chain_seed("m"))
    assert base == block_hashes(tokens, 16, chain_seed("m", None, None))  # the base model's keys unchanged
    a = block_hashes(tokens, 16, chain_seed("m", None, "a@0011"))
    assert len({tuple(base), tuple(a), tuple(block_hashes(tokens, 16, chain_seed("m", None, "a@0012")))}) == 3
    assert chain_seed("m", "t", "a@1") != chain_seed("m", None, "a@1")


def test_digest_follows_content_not_name(tmp_path):
    d = tmp_path / "a"
    d.mkdir()
    (d / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4}))
    (d / "adapter_model.safetensors").write_bytes(b"one")
    first = adapter_ref("x", d)
    assert adapter_ref("y", d).digest == first.digest and adapter_ref("y", d).identity != first.identity
    (d / "adapter_model.safetensors").write_bytes(b"two")
    assert adapter_ref("x", d).digest != first.digest
    assert parse_spec("sql=/p/q") == ("sql", "/p/q")
    for bad in ("sql", "=/p", "bad name=/p"):
        with pytest.raises(AdapterError):
            parse_spec(bad)


def test_slots_admit_up_to_max_loras_and_reuse_idle_ones():
    slots = AdapterSlots(2)
    assert slots.acquire("a") == 0 and slots.acquire("b") == 1
    assert not slots.can_admit("c") and slots.can_admit("a")
    slots.acquire("a")
    slots.release("b")
    assert slots.can_admit("c") and slots.acquire("c") == 1  # b's idle slot
    assert slots.running() == ["a", "c"] and slots.loads == 3
    slots.release("a")
    slots.release("a")
    assert slots.acquire("b") == 0


def test_a_pull_under_an_adapter_imports_that_adapters_blocks(tiny_model_dirs, adapters):
    """A pull hint for an adapter's prompt copies the holder's blocks keyed under the adapter,
    and the puller's output is the holder's."""
    import asyncio

    from replica.async_engine import AsyncLLMEngine
    from replica.kv_io import kv_transfer
    from replica.kv_io.kv_pull import KvPuller
    from router.protocol.messages import KvSource

    model, ads = tiny_model_dirs["llama"], adapters["llama"]
    holder = engine_for(model, ads)
    [held] = run(holder, [(PROMPT, "attn")])
    run(holder, [(PROMPT, None)])  # the base model's blocks of the same tokens are there too

    class Exporter:  # the transport, answered by the holder's engine
        async def call(self, replica_id, method, hashes, tokens, first):
            return kv_transfer.export_prefix(holder, hashes, tokens, first)

    puller_engine = engine_for(model, ads)
    looped = AsyncLLMEngine(puller_engine)
    try:
        puller = KvPuller(looped, "me", caller=Exporter())
        identity = puller_engine.adapters["attn"].identity
        kv = asyncio.run(puller.pull(KvSource("holder", 2), PROMPT, None, identity))
        assert kv is not None and kv.num_blocks == 2
    finally:
        looped.shutdown()
    rid = puller_engine.add_request(PROMPT, greedy(), adapter="attn", kv_prefix=kv)
    assert puller_engine.kv_imported_blocks == 2
    done = None
    while done is None:
        done = next((o for o in puller_engine.step() if o.finished and o.request_id == rid), None)
    assert done.num_cached_tokens == 32 and done.token_ids == held.token_ids
