"""LoRA adapters on vLLM replicas, for real: a VllmBackend with LoRA on (vLLM's CPU engine, in the
vLLM venv that `make install` builds, docs/vllm.md) serves the bundled model under two adapters
built with peft and under the base model. Greedy output under an adapter equals transformers +
PeftModel; identical prompts never hit across adapters (or the base) and do hit under one; the
blocks vLLM's KV events announce are, re-hashed, the router's hashes rooted at the adapter's
identity; the pending-prefill estimate finds an adapter's held prefix; adapters of other models
are refused as a 400 (InvalidRequestError, vLLM's own words where vLLM refuses) and the replica
keeps serving, an adapter evicted from vLLM's cache by the refused load reloading unchanged.

The backend runs in a child process in the vLLM venv (the source of `_driver` below, given to
`python -c`), the adapters and the reference in this process (.venv: peft, transformers).
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess

import pytest

from gateway.config import AppConfig
from replica.default_model import DEFAULT_MODEL_NAME
from replica.engine_config import EngineConfig
from router.protocol.hashing import block_hashes, chain_seed
from router.protocol.lora import adapter_ref

BLOCK = 32  # vLLM's CPU attention takes multiples of 32
MAX_TOKENS = 12
TEXT = ("The history of the lighthouse keepers on the northern coast began when the first tower was lit "
        "above the harbour, and every night since then someone has climbed the stairs to trim the wick. ") * 4


def _driver() -> None:
    """Runs in the vLLM venv: reads the job (JSON on stdin), serves it through VllmBackend and
    prints `RESULT {json}`. Self-contained: its source is what the child process runs."""
    import asyncio
    import json
    import sys

    from replica.backends.vllm_backend import VllmBackend
    from replica.backends.vllm_settings import VllmSettings
    from replica.engine_config import EngineConfig
    from router.protocol.hashing import block_hashes
    from router.protocol.lora import adapter_ref
    from router.protocol.messages import GenerateRequest
    from router.protocol.sampling import SamplingParams

    job = json.load(sys.stdin)
    refs = {name: adapter_ref(name, path) for name, path in job["adapters"].items()}
    prompt = job["prompt"]

    class Stored:  # a KVEventListener: every block the backend publishes as stored
        def __init__(self) -> None:
            self.blocks: list[list[int]] = []

        def stored(self, hashes, positions, medium="GPU") -> None:
            self.blocks += [[h, p] for h, p in zip(hashes, positions, strict=True)]

        def removed(self, hashes, medium="GPU") -> None:
            pass

        def cleared(self) -> None:
            pass

    async def main() -> None:
        config = EngineConfig(**job["engine"])
        backend = await VllmBackend.create(config, VllmSettings(), 1)
        listener = Stored()
        backend.add_listener(listener)
        count = 0

        async def run(name, salt=None):
            nonlocal count
            count += 1
            rid = f"r{count}"
            params = SamplingParams(max_tokens=job["max_tokens"], ignore_eos=True)
            pending, final = None, None
            request = GenerateRequest(prompt_token_ids=prompt, params=params, request_id=rid, cache_salt=salt,
                                      adapter=refs[name] if name else None)
            stream = backend.generate(request)
            async for out in stream:
                if pending is None:  # what generate() priced as the prefill still to compute
                    pending = backend._inflight[rid].prompt_tokens
                final = out
            return {"adapter": name, "tokens": final.token_ids, "cached": final.num_cached_tokens, "pending": pending}

        async def settled(name) -> bool:
            """Bounded wait for the events of the prompt's blocks under `name`'s root."""
            root = backend.translator.chain_root(None, refs[name].identity if name else None)
            want = block_hashes(prompt, config.block_size, root)
            for _ in range(1200):
                if backend.translator.leading_held(want) == len(want):
                    return True
                await asyncio.sleep(0.05)
            return False

        async def refusal(coro) -> str | None:
            try:
                await coro
            except Exception as e:
                return f"{type(e).__name__}: {e}"
            return None

        result = {"runs": []}
        for name in ("a", "b", None, "a"):
            got = await run(name)
            got["settled"] = await settled(name)
            result["runs"].append(got)
        # all three in one batch, under a salt that no cached block has: prefill and decode mixed
        result["together"] = await asyncio.gather(*(run(n, salt="together") for n in ("a", "b", None)))
        result["refusals"] = {}
        for name in ("big", "small"):
            result["refusals"][f"{name} add_adapter"] = await refusal(backend.add_adapter(refs[name]))
            result["refusals"][f"{name} generate"] = await refusal(run(name))
        result["after"] = [await run(n) for n in ("a", "b", None)]
        result["alive"] = backend.alive
        result["resident"] = await backend.refresh_lora_residency()  # what vLLM's adapter cache holds
        stats = backend.stats()  # the heartbeat's source
        result["heartbeat_lora"] = [stats.lora_resident, stats.lora_load_s]
        result["stored"] = listener.blocks
        result["info"] = backend.info_extra()
        backend.shutdown()
        print("RESULT " + json.dumps(result), flush=True)

    asyncio.run(main())


def _random_model(path: str, hidden: int) -> str:
    """A randomly initialised two-layer Llama of width `hidden`, saved: another model's shapes."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(7)
    config = LlamaConfig(vocab_size=384, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def adapters(default_model_dir, tmp_path_factory) -> dict[str, str]:
    from tests.helpers.lora import ATTENTION, ATTENTION_MLP, make_adapter

    d = tmp_path_factory.mktemp("vllm-lora")
    return {
        "a": make_adapter(default_model_dir, str(d / "a"), ATTENTION, 8, seed=11),
        "b": make_adapter(default_model_dir, str(d / "b"), ATTENTION_MLP, 4, seed=12, rslora=True),
        # wider than the bundled model (576): does not fit vLLM's buffers
        "big": make_adapter(_random_model(str(d / "wide"), 640), str(d / "big"), ATTENTION, 4, seed=1),
        # narrower (64): fits in a corner of vLLM's buffers
        "small": make_adapter(_random_model(str(d / "narrow"), 64), str(d / "small"), ATTENTION, 4, seed=1),
    }


@pytest.fixture(scope="module")
def served(default_model_dir, adapters):
    """The driver's result, and the prompt it served."""
    from transformers import AutoTokenizer

    from replica.backends.vllm_settings import vllm_python

    py = vllm_python()
    assert ".venv-vllm" in py and os.path.exists(py), f"the vLLM venv is missing ({py}): run `make install`"
    prompt = AutoTokenizer.from_pretrained(default_model_dir).encode(TEXT)
    engine = dict(model=default_model_dir, model_id=DEFAULT_MODEL_NAME, block_size=BLOCK, num_blocks=64,
                  max_model_len=1024, max_num_seqs=8, enable_lora=True, lora_adapters={"a": adapters["a"]},
                  max_loras=2, max_lora_rank=16, max_cpu_loras=2)  # "a" from the start, the rest on first use
    job = {"engine": engine, "adapters": adapters, "prompt": prompt, "max_tokens": MAX_TOKENS}
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "PYTEST"))}
    code = inspect.getsource(_driver) + "\n_driver()\n"
    done = subprocess.run([py, "-c", code], input=json.dumps(job), capture_output=True, text=True, timeout=1200,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), env=env)
    assert done.returncode == 0, done.stderr[-5000:]
    [line] = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]  # vLLM logs to stdout too
    return json.loads(line.removeprefix("RESULT ")), prompt


def _identity(adapters, name) -> str | None:
    return adapter_ref(name, adapters[name]).identity if name else None


def _ours(prompt, adapters, name) -> list[int]:
    """The router's hashes of the prompt under `name` (None: the base model)."""
    return block_hashes(prompt, BLOCK, chain_seed(DEFAULT_MODEL_NAME, None, _identity(adapters, name)))


@pytest.mark.slow
@pytest.mark.vllm
def test_adapters_change_the_output_and_match_peft(served, adapters, default_model_dir):
    from tests.helpers.engine import reference_greedy
    from tests.helpers.lora import peft_model

    result, prompt = served
    a, b, base, _ = result["runs"]
    assert a["tokens"] != base["tokens"] and b["tokens"] != base["tokens"] and a["tokens"] != b["tokens"]
    assert len(a["tokens"]) == MAX_TOKENS
    for name, got in (("a", a), ("b", b)):
        ref = reference_greedy(peft_model(default_model_dir, adapters[name]), prompt, MAX_TOKENS, stop_at_eos=False)
        assert got["tokens"] == ref, (name, got["tokens"], ref)
    # base + both adapters at once (one batch, two LoRA slots, nothing cached) equal each alone: vLLM's
    # CPU LoRA ops alone would give the base row the last slot's adapter (CpuLoraFix)
    assert [r["cached"] for r in result["together"]] == [0, 0, 0]
    assert [r["tokens"] for r in result["together"]] == [a["tokens"], b["tokens"], base["tokens"]]


@pytest.mark.slow
@pytest.mark.vllm
def test_no_cache_hit_across_adapters_a_hit_under_one(served):
    result, prompt = served
    a, b, base, again = result["runs"]
    full = len(prompt) // BLOCK
    assert full >= 4, len(prompt)
    assert (a["cached"], b["cached"], base["cached"]) == (0, 0, 0), result["runs"]
    # vLLM recomputes a fully cached prompt's last token: every block but that one's
    assert again["cached"] >= (full - 1) * BLOCK and again["cached"] % BLOCK == 0, again
    assert again["tokens"] == a["tokens"]
    # the pending-prefill estimate roots the prompt at the adapter: nothing held under b or the
    # base model although a's blocks are, a's held blocks found on its repeat
    assert a["pending"] == b["pending"] == base["pending"] == len(prompt), result["runs"]
    assert again["pending"] == max(1, len(prompt) - full * BLOCK), again


@pytest.mark.slow
@pytest.mark.vllm
def test_event_hashes_are_the_routers_under_each_adapter(served, adapters):
    result, prompt = served
    assert all(r["settled"] for r in result["runs"]), result["runs"]
    stored = {h: p for h, p in result["stored"]}
    chains = {name: _ours(prompt, adapters, name) for name in ("a", "b", None)}
    for name, hashes in chains.items():
        assert [stored.get(h) for h in hashes] == list(range(len(hashes))), name
    assert len(set().union(*map(set, chains.values()))) == 3 * len(chains["a"])  # three different chains
    assert set(result["info"]["lora_adapters"]) == {_identity(adapters, "a"), _identity(adapters, "b")}


@pytest.mark.slow
@pytest.mark.vllm
def test_the_heartbeat_reports_the_adapters_vllm_holds(served, adapters):
    """What routers price an adapter's disk read with: the identities in vLLM's adapter cache
    (max_cpu_loras 2, a and b served last) and the measured time of one add_lora."""
    result, _ = served
    held = {_identity(adapters, "a"), _identity(adapters, "b")}
    assert set(result["resident"]) == held, result["resident"]
    resident, load_s = result["heartbeat_lora"]
    assert set(resident) == held and load_s > 0, result["heartbeat_lora"]


@pytest.mark.slow
@pytest.mark.vllm
def test_another_models_adapter_is_refused_and_the_replica_keeps_serving(served):
    result, _ = served
    refusals = result["refusals"]
    for how in ("add_adapter", "generate"):
        # wider tensors than the model's: vLLM refuses the load (its words through add_lora)
        big = refusals[f"big {how}"]
        assert big is not None and big.startswith("InvalidRequestError: ") and "refused by vLLM" in big, big
        assert "add_lora method failed" in big, big
        # narrower ones vLLM would take: refused by their shapes before any request runs under them
        small = refusals[f"small {how}"]
        assert small is not None and small.startswith("InvalidRequestError: ") and "another model" in small, small
    a, b, base, _ = result["runs"]
    assert result["alive"]
    assert [r["tokens"] for r in result["after"]] == [a["tokens"], b["tokens"], base["tokens"]]


def test_engine_vllm_takes_lora_settings(tmp_path):
    """The gateway passes LoRA to vLLM replicas (their EngineConfig), and refuses at build a
    max_lora_rank vLLM's LoRAConfig would refuse at start, when the config loads."""
    adapter = tmp_path / "sql"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4}))
    (adapter / "adapter_model.safetensors").write_bytes(b"weights")
    config = AppConfig.from_dict({"engine": "vllm", "lora": {"sql": str(adapter)}, "max_loras": 2,
                                  "max_cpu_loras": 3, "max_lora_rank": 8})
    engine: EngineConfig = config.engine_settings("m").config
    assert engine.lora and engine.lora_adapters == {"sql": str(adapter)}
    assert (engine.max_loras, engine.max_cpu_loras, engine.max_lora_rank) == (2, 3, 8)
    with pytest.raises(ValueError, match="max_lora_rank in 1, 8, 16"):
        AppConfig.from_dict({"engine": "vllm", "enable_lora": True, "max_lora_rank": 4})
