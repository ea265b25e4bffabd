"""LoRA adapters in the routing simulator: sessions under adapters, keys rooted at the adapter's
identity, each replica's adapter LRU and its disk reads, adapter-aware against blind routing,
and the CLI's flags. Pure and seeded: no Redis, Ray, torch or model."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest

from router.costs.adapter_memory import AdapterLru, LoraConfig
from router.costs.service import ServiceModel
from router.policy import make_policy
from router.protocol.hashing import block_hashes, chain_seed
from router.protocol.lora import MAX_CPU_LORAS
from router.sim.cli import main
from router.sim.engine import SimConfig, run_policy
from router.sim.lora import SIM_MODEL_ID, AdapterMix, adapter_hashes, adapter_identity, key_tokens
from router.sim.metrics import PolicyResult
from router.sim.router_config import SimRouterConfig
from router.sim.workload import ChatWorkload, SimRequest

BS = 16


def chat(sessions: int = 120, seed: int = 1) -> list[SimRequest]:
    return ChatWorkload(sessions=sessions, duration_s=300.0, block_size=BS).generate(seed=seed)


def fingerprint(result: PolicyResult) -> str:
    """Every reported figure (NaNs compare equal as text)."""
    return json.dumps(result.to_dict(), sort_keys=True)


def under(adapters: list[int], keys: list[int], gap: float = 100.0, preamble: int = 0) -> list[SimRequest]:
    """One request per adapter index, each with the same workload keys, `gap` seconds apart."""
    mix = AdapterMix(adapters=max(adapters) + 1, preamble_blocks=preamble, block_size=BS)
    return [mix.under(SimRequest(i * gap, list(keys), len(keys) * BS, 4), a) for i, a in enumerate(adapters)]


def one_replica(requests: list[SimRequest], lora: LoraConfig, policy: str = "affinity") -> PolicyResult:
    config = SimConfig(replicas=1, capacity_blocks=500, block_size=BS, lora=lora)
    return run_policy(requests, make_policy(policy, seed=0), config)


# (a) no adapters: the simulator as it was

def test_no_adapters_leaves_the_workload_and_the_results_unchanged():
    requests = chat()
    assert AdapterMix(adapters=0).apply(requests, seed=5) is requests
    config = SimConfig(replicas=4, capacity_blocks=120, block_size=BS)
    before = run_policy(requests, make_policy("affinity", seed=0), config)
    # every new setting away from its default, with no adapter in the workload
    config_lora = replace(config, lora=LoraConfig(max_cpu_loras=1, load_ms=5000.0),
                          router=SimRouterConfig(lora_aware=False))
    after = run_policy(AdapterMix(adapters=0).apply(requests, seed=5), make_policy("affinity", seed=0), config_lora)
    assert fingerprint(after) == fingerprint(before)
    assert after.adapter_requests == after.adapter_loads == 0
    assert "adapter_loads" not in before.to_dict()  # a run without adapters writes what it wrote before


def test_cli_without_adapters_prints_and_writes_the_same(tmp_path, capsys):
    base = ["--workload", "rag", "--limit", "300", "--replicas", "2", "--capacity", "200",
            "--policies", "affinity", "least-loaded"]
    assert main([*base, "--json", str(tmp_path / "a.json")]) == 0
    plain = capsys.readouterr().out
    assert main([*base, "--adapters", "0", "--max-cpu-loras", "1", "--lora-load-ms", "900",
                 "--lora-aware", "false", "--json", str(tmp_path / "b.json")]) == 0
    flagged = capsys.readouterr().out

    def untimed(text: str) -> str:
        return re.sub(r"\[\d+s\]", "[-]", text)

    assert untimed(flagged) == untimed(plain) and "loads/req" not in plain
    a, b = (json.loads((tmp_path / f).read_text()) for f in ("a.json", "b.json"))
    assert a["settings"] == b["settings"] and "lora" not in b


# the workload: sessions sticky to adapters, preambles, keys rooted at the identity

def test_sessions_keep_one_adapter_drawn_from_the_seed():
    requests = chat()
    mix = AdapterMix(adapters=4, preamble_blocks=3, block_size=BS)
    out = mix.apply(requests, seed=7)
    assert out == mix.apply(requests, seed=7)  # deterministic
    assert [r.adapter for r in out] != [r.adapter for r in mix.apply(requests, seed=8)]  # from the seed
    by_session: dict[str, set[str | None]] = {}
    for r in out:
        by_session.setdefault(r.session_id, set()).add(r.adapter)
    assert all(len(a) == 1 for a in by_session.values())  # sticky
    assert {a for s in by_session.values() for a in s} == {adapter_identity(i) for i in range(4)}
    for orig, r in zip(requests, out, strict=True):
        assert r.input_tokens == orig.input_tokens + 3 * BS and r.base_hashes[3:] == orig.hashes
        assert (r.arrival, r.output_tokens, r.session_id) == (orig.arrival, orig.output_tokens, orig.session_id)
    # one preamble per adapter, shared by its prompts, different between adapters
    preambles: dict[str | None, set[tuple[int, ...]]] = {}
    for r in out:
        preambles.setdefault(r.adapter, set()).add(tuple(r.base_hashes[:3]))
    assert all(len(p) == 1 for p in preambles.values())
    assert len({next(iter(p)) for p in preambles.values()}) == 4


def test_zipf_skews_sessions_toward_the_first_adapters():
    requests = chat(sessions=400)
    count = {}
    for r in AdapterMix(adapters=4, zipf_s=1.5).apply(requests, seed=0):
        count[r.session_id] = r.adapter
    hot = sum(a == adapter_identity(0) for a in count.values())
    cold = sum(a == adapter_identity(3) for a in count.values())
    assert hot > 3 * cold


def test_keys_are_the_live_chain_rooted_at_the_adapter():
    """The same chain `router.protocol.hashing.block_hashes` gives the live router, over the
    blocks' 'tokens' (each workload key's two 32-bit halves), from the adapter's seed."""
    keys = [5, 1 << 40, 7, 2**62 + 3]
    identity = adapter_identity(2)
    tokens = [t for k in keys for t in key_tokens(k)]
    assert adapter_hashes(keys, identity) == block_hashes(tokens, 2, chain_seed(SIM_MODEL_ID, None, identity))
    assert adapter_identity(2) == identity and "@" in identity  # name@digest, as AdapterRef.identity


# (b) the same tokens under two adapters are two different blocks

def test_same_tokens_under_two_adapters_never_hit_each_other():
    keys = [11, 12, 13, 14]
    a, b, a_again, b_again = under([0, 1, 0, 1], keys)
    assert a.base_hashes == b.base_hashes == keys and not set(a.hashes) & set(b.hashes)
    result = one_replica([a, b, a_again, b_again], LoraConfig(max_cpu_loras=4))
    # a and b are cold (b's tokens are a's, its blocks are not); the second of each hits all 4
    assert result.hit_blocks == 8 and result.prompt_blocks == 16
    base = SimRequest(500.0, list(keys), len(keys) * BS, 4)  # the base model's blocks are a third set
    assert one_replica([a, b, base], LoraConfig()).hit_blocks == 0


# (c) each replica's adapter LRU

@pytest.mark.parametrize(("adapters", "loads"), [([0, 1, 2] * 3, 9), ([0, 1] * 4, 2)])
def test_lru_of_two_adapters_on_one_replica(adapters, loads):
    """max_cpu_loras 2: three adapters round-robin evict each other, every request reads its own;
    two stay resident after their first reads."""
    requests = under(adapters, [1, 2, 3])
    result = one_replica(requests, LoraConfig(max_cpu_loras=2, load_ms=250.0))
    assert (result.adapter_requests, result.adapter_loads) == (len(adapters), loads)
    assert result.loads_per_request == pytest.approx(loads / len(adapters))


def test_a_read_delays_the_first_token_by_the_load_time():
    requests = under([0], [1, 2, 3])
    fast = one_replica(requests, LoraConfig(load_ms=0.0))
    slow = one_replica(requests, LoraConfig(load_ms=1500.0))
    assert fast.adapter_loads == slow.adapter_loads == 1  # a read, however fast, is a read
    assert slow.ttft_p50_s - fast.ttft_p50_s == pytest.approx(1.5)


def test_heartbeat_reports_residents_and_the_read_time_once_measured():
    lru = AdapterLru(LoraConfig(max_cpu_loras=2, load_ms=42.4))
    assert lru.heartbeat() == {"lora_resident": "", "lora_load_ms": 0}  # nothing read yet: not priced
    a, b, c = (adapter_identity(i) for i in range(3))
    assert [lru.use(x) for x in (a, b, a, c, b, None)] == [True, True, False, True, True, False]
    assert lru.loads == 4 and lru.heartbeat() == {"lora_resident": f"{c} {b}", "lora_load_ms": 42}
    assert lru.holds(None) and lru.holds(b) and not lru.holds(a)


def test_live_decider_prices_a_replica_without_the_adapter():
    """Through the simulator's load table, the live Decider sees which replica holds the adapter
    (`adapter_resident`) and its read time, with no simulator code in the decider."""
    from router.index.memory_index import InMemoryIndex
    from router.sim.replica import SimReplica
    from router.sim.sim_router import SimClock, SimRouter

    index = InMemoryIndex()
    lora = LoraConfig(max_cpu_loras=1, load_ms=300.0)
    reps = {f"r{i}": SimReplica(f"r{i}", 100, BS, ServiceModel(), index, lora=lora) for i in range(2)}
    reps["r0"].adapters.use(adapter_identity(0))
    reps["r1"].adapters.use(adapter_identity(1))
    (req,) = under([0], [90, 91])
    router = SimRouter(make_policy("affinity", seed=0), reps, index, SimRouterConfig(), SimClock(1.0))
    routed = router.decide(router.route_for(req, BS))
    assert routed.decision.replica_id == "r0"
    views = {rid: router.decider._view(rid, 0, 0, {}, None, req.adapter) for rid in reps}
    assert (views["r0"].adapter_resident, views["r1"].adapter_resident) == (True, False)
    assert views["r1"].adapter_load_s == pytest.approx(0.3)
    blind = SimRouter(make_policy("affinity", seed=0), reps, index, SimRouterConfig(lora_aware=False), SimClock(1.0))
    route = blind.route_for(req, BS)
    assert route.adapter is None and route.block_hashes == req.base_hashes  # hashed as the base model's


# (d) adapter-aware routing reads adapters less often than blind routing

def test_adapter_aware_routing_reads_fewer_adapters_than_blind():
    """8 adapters over 4 replicas holding 2 each, sessions sticky to their adapter: the aware
    router finds an adapter's preamble and prices the read, the blind one finds neither."""
    chats = ChatWorkload(sessions=300, duration_s=300.0).generate(seed=1)  # 512-token blocks
    requests = AdapterMix(adapters=8, preamble_blocks=2).apply(chats, seed=0)
    config = SimConfig(replicas=4, capacity_blocks=100, lora=LoraConfig(max_cpu_loras=2))
    result = {aware: run_policy(requests, make_policy("affinity", seed=0),
                                replace(config, router=SimRouterConfig(lora_aware=aware)))
              for aware in (True, False)}
    aware, blind = result[True], result[False]
    assert aware.adapter_requests == blind.adapter_requests == len(requests)
    assert aware.adapter_loads < 0.8 * blind.adapter_loads
    assert aware.hit_rate > blind.hit_rate
    assert (aware.lora_aware, blind.lora_aware) == (True, False)


# (e) the command line

def test_cli_reports_adapter_figures_per_policy_and_arm(tmp_path, capsys):
    out = tmp_path / "lora.json"
    argv = ["--workload", "chat", "--limit", "600", "--replicas", "4", "--capacity", "200",
            "--policies", "affinity", "least-loaded", "--adapters", "6", "--adapter-preamble-blocks", "1",
            "--adapter-zipf", "0", "--max-cpu-loras", "2", "--lora-load-ms", "80",
            "--lora-aware", "true", "false", "--json", str(out)]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "LoRA: 6 adapters (Zipf 0, preambles of 1 blocks), max_cpu_loras 2, disk read 80 ms" in text
    header = next(line for line in text.splitlines() if line.startswith("policy"))
    assert header.split()[:3] == ["policy", "arm", "hit"] and "loads/req" in header
    rows = [line.split() for line in text.splitlines() if line.split()[:1] in (["affinity"], ["least-loaded"])]
    assert [r[:2] for r in rows] == [["affinity", "aware"], ["least-loaded", "aware"],
                                     ["affinity", "blind"], ["least-loaded", "blind"]]
    data = json.loads(out.read_text())
    assert data["lora"] == {"adapters": 6, "preamble_blocks": 1, "zipf_s": 0.0, "block_size": 512,
                            "max_cpu_loras": 2, "load_ms": 80.0, "arms": [True, False]}
    (setting,) = data["settings"]
    got = [(r["policy"], r["lora_aware"]) for r in setting["rows"]]
    assert got == [("affinity", True), ("least-loaded", True), ("affinity", False), ("least-loaded", False)]
    for r, line in zip(setting["rows"], rows, strict=True):
        assert r["adapter_requests"] == 600 and 0 < r["adapter_loads_per_request"] <= 1
        assert line[15] == f"{r['adapter_loads_per_request']:.3f}"  # the column after tier p99


def test_cli_refuses_two_arms_without_adapters(capsys):
    assert main(["--workload", "rag", "--limit", "50", "--lora-aware", "true", "false"]) == 2
    assert "needs --adapters" in capsys.readouterr().err


def test_default_adapter_memory_is_the_live_one():
    from replica.engine_config import EngineConfig

    assert MAX_CPU_LORAS == EngineConfig().max_cpu_loras == LoraConfig().max_cpu_loras
