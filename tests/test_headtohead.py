"""The pure parts of `prefixgate loadtest headtohead` (loadtest/headtohead.py): result parsing,
counter deltas, the ceiling, the tables, the command lines; and the chat workload's uneven
session lengths. No network, no Ray, no vLLM."""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path

import pytest

from loadtest import headtohead as h
from loadtest.cli import LoadSpec
from loadtest.workload import chat_turns

SCRAPE = """\
# HELP ray_vllm_prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE ray_vllm_prefix_cache_hits_total counter
ray_vllm_prefix_cache_hits_total{Component="core_worker",NodeAddress="127.0.0.1",ReplicaId="hi3fdo4x",engine="0",model_name="SmolLM2-135M-Instruct",otel_scope_name="ray._private.telemetry.open_telemetry_metric_recorder",otel_scope_schema_url="",otel_scope_version=""} 32.0
# TYPE ray_vllm_prefix_cache_queries_total counter
ray_vllm_prefix_cache_queries_total{Component="core_worker",ReplicaId="hi3fdo4x",engine="0",model_name="SmolLM2-135M-Instruct"} 122.0
ray_vllm_prefix_cache_queries_total{Component="core_worker",ReplicaId="hnyyuq85",engine="0",model_name="SmolLM2-135M-Instruct"} 37.0
ray_vllm_prefix_cache_queries_total_created{ReplicaId="hnyyuq85"} 1796133600.0
ray_vllm_prompt_tokens_total{ReplicaId="hi3fdo4x"} 122.0
ray_vllm_prefix_cache_hits_totalx 5
"""


def test_ceiling_of_the_default_workload():
    assert h.prefix_ceiling(512, 64, 16, 128) == pytest.approx(512 / 576 * (1 - 16 / 128))
    assert round(h.prefix_ceiling(512, 64, 16, 128), 3) == 0.778
    assert h.prefix_ceiling(512, 64, 4, 32) == pytest.approx(0.7778, abs=1e-4)  # --quick keeps 8 prompts per prefix
    assert h.prefix_ceiling(512, 64, 16, 16) == 0.0  # every prefix seen once: nothing can hit
    with pytest.raises(ValueError):
        h.prefix_ceiling(512, 64, 16, 8)


def test_prometheus_sums_over_replicas_and_ignores_other_names():
    got = h.parse_prometheus(SCRAPE)
    assert got == {h.HITS: 32.0, h.QUERIES: 159.0}  # hits: only one replica has a series yet


def test_prometheus_without_the_metrics_is_zero():
    assert h.parse_prometheus("# nothing\nray_other_total 4\n") == {h.HITS: 0.0, h.QUERIES: 0.0}
    assert h.parse_prometheus(f"{h.HITS} 7\n{h.QUERIES} 9 1796133600000\n") == {h.HITS: 7.0, h.QUERIES: 9.0}


def test_hit_rate_delta():
    before = {h.HITS: 32.0, h.QUERIES: 117.0}
    after = {h.HITS: 13280.0, h.QUERIES: 18549.0}
    d = h.hit_rate_delta(before, after)
    assert (d["hits"], d["queries"]) == (13248.0, 18432.0)
    assert d["hit_rate"] == pytest.approx(13248 / 18432)
    assert h.hit_rate_delta(None, after)["hit_rate"] is None
    assert h.hit_rate_delta(before, None)["hit_rate"] is None
    assert h.hit_rate_delta(before, before)["hit_rate"] is None  # nothing queried
    # a counter that went down (a replica restarted): no hit rate rather than a wrong one
    assert h.hit_rate_delta(before, {h.HITS: 10.0, h.QUERIES: 500.0})["hit_rate"] is None


BENCH_JSON = {
    "date": "20261201-140529", "backend": "openai", "num_prompts": 32, "duration": 27.43, "completed": 32,
    "failed": 0, "total_input_tokens": 18432, "total_output_tokens": 512, "output_throughput": 18.67,
    "median_ttft_ms": 1688.36, "p50_ttft_ms": 1688.36, "p99_ttft_ms": 9256.97, "median_tpot_ms": 244.27,
    "p99_tpot_ms": 471.06, "mean_ttft_ms": 2658.84,
}


def test_bench_result():
    row = h.parse_bench_result(BENCH_JSON)
    assert row["requests"] == 32 and row["errors"] == 0 and row["completed"] == 32
    assert row["duration_s"] == 27.43 and row["output_tokens_per_s"] == 18.67
    assert row["ttft_p50_s"] == pytest.approx(1.68836)
    assert row["ttft_p99_s"] == pytest.approx(9.25697)
    assert row["tpot_p50_s"] == pytest.approx(0.24427)
    assert row["input_tokens"] == 18432


def test_bench_result_with_failures_and_missing_percentiles():
    row = h.parse_bench_result({"duration": 3.0, "completed": 5, "failed": 3, "output_throughput": 1.0})
    assert row["requests"] == 8 and row["errors"] == 3
    assert row["ttft_p50_s"] is None and row["tpot_p50_s"] is None


def test_chat_summary():
    summary = {"requests": 13, "ok": 12, "errors": 1, "aborted": 1, "duration_s": 15.5, "ttft_p50_s": 1.27,
               "ttft_p99_s": 2.74, "tpot_p50_s": 0.12, "output_tokens_per_s": 13.4, "prompt_tokens": 4646,
               "completion_tokens": 208, "hit_rate": 0.0}
    row = h.parse_chat_summary(summary)
    assert row["errors"] == 2  # failed + cut off
    assert (row["requests"], row["duration_s"], row["ttft_p99_s"]) == (13, 15.5, 2.74)
    assert row["client_hit_rate"] == 0.0


def test_table_and_report():
    good = {"system": "ray-llm-prefix", "requests": 32, "duration_s": 29.33, "hit_rate": 0.7778,
            "ttft_p50_s": 1.817, "ttft_p99_s": 10.416, "tpot_p50_s": 0.257, "output_tokens_per_s": 17.46,
            "errors": 0, "startup_s": 107.2}
    failed = {"system": "prefixgate-vllm", "startup_s": None, "note": "did not start: exited with 2 | usage"}
    table = h.format_table([good, failed])
    lines = table.splitlines()
    assert lines[0].startswith("| system | requests | run time | hit rate | TTFT p50 | TTFT p99 | TPOT p50 | out tok/s | errors")
    assert lines[2].startswith("| ray-llm-prefix | 32 | 29.3s | 77.8% | 1.817s | 10.416s | 0.257s | 17.5 | 0 | 107s |")
    assert lines[3].startswith("| prefixgate-vllm | - | - | - |")
    assert "did not start: exited with 2 / usage" in lines[3]  # a '|' cannot break the table
    assert all(line.count("|") == lines[0].count("|") for line in lines)

    result = {"started": "now", "clients": ["bench", "chat"], "ceiling": h.prefix_ceiling(512, 64, 16, 128),
              "settings": {"replicas": 2, "model_name": "M", "pool_tokens": 6144, "vllm_block_size": 32,
                           "ours_block_size": 16, "max_model_len": 2048, "bench": vars(h.BenchSpec()),
                           "chat": h.chat_load(False)},
              "tables": {"bench": [good], "chat": [failed]}}
    md = h.report_markdown(result)
    assert "512/576 x (1 - 16/128) = 77.8%" in md
    assert "## bench" in md and "## chat" in md and "192 blocks of 32" in md and "384 of 16" in md
    assert "2-6 turns" in md


def test_tables_mark_a_system_that_did_not_start():
    systems = [{"system": "a", "startup_s": 10.0, "clients": {"bench": {"requests": 4, "hit_rate": 0.5}}},
               {"system": "b", "start_error": "exited with 2", "clients": {}}]
    t = h.tables(systems, ["bench", "chat"])
    assert [r["system"] for r in t["bench"]] == ["a", "b"]
    assert t["bench"][0]["hit_rate"] == 0.5 and t["bench"][0]["startup_s"] == 10.0
    assert t["bench"][1]["note"] == "did not start: exited with 2"
    assert t["chat"][0]["system"] == "a" and "requests" not in t["chat"][0]


def test_bench_command_line():
    argv = h.BenchSpec().argv("http://127.0.0.1:9", "SmolLM2-135M-Instruct", "/models/smol", Path("/tmp/r"))
    joined = " ".join(argv)
    for part in ("bench serve", "--backend openai", "--endpoint /v1/completions", "--dataset-name prefix_repetition",
                 "--prefix-repetition-prefix-len 512", "--prefix-repetition-suffix-len 64",
                 "--prefix-repetition-num-prefixes 16", "--prefix-repetition-output-len 16", "--num-prompts 128",
                 "--max-concurrency 8", "--ignore-eos", "--seed 0", "--save-result", "--result-dir /tmp/r",
                 "--model SmolLM2-135M-Instruct", "--tokenizer /models/smol", "--base-url http://127.0.0.1:9",
                 "--metric-percentiles 50,90,99"):
        assert part in joined
    assert "import importlib.metadata" in h.VLLM_CLI and '+ "+cpu"' in h.VLLM_CLI


def _args(**kw) -> argparse.Namespace:
    base = dict(quick=False, prefix_len=512, suffix_len=64, num_prefixes=None, output_len=16, num_prompts=None,
                max_concurrency=8, seed=0, replicas=2, pool_tokens=6144, max_model_len=2048, max_num_batched_tokens=None,
                model_name=h.MODEL_NAME, model="/models/smol", chat_set=[], prefixgate="/venv/bin/prefixgate",
                vllm_python="/venv-vllm/bin/python", ingress="proxy")
    base.update(kw)
    return argparse.Namespace(**base)


def test_settings_defaults_quick_and_overrides():
    s = h.settings_from_args(_args())
    assert (s.bench.num_prompts, s.bench.num_prefixes) == (128, 16)
    assert s.num_blocks(32) == 192 and s.num_blocks(16) == 384
    q = h.settings_from_args(_args(quick=True, chat_set=["users=3", "think-max=0.5", "workload=chat"]))
    assert (q.bench.num_prompts, q.bench.num_prefixes) == (32, 4)
    assert q.chat["users"] == 3 and q.chat["think_max"] == 0.5 and q.chat["turns_min"] == 2
    LoadSpec(**q.chat)  # every chat field is a LoadSpec field
    with pytest.raises(SystemExit):
        h.settings_from_args(_args(chat_set=["nonsense=1"]))


def test_system_command_lines(monkeypatch):
    ports = iter(range(41000, 41100))
    monkeypatch.setattr(h, "free_port", lambda: next(ports))
    s = h.settings_from_args(_args())
    a = _args()
    ours = h.system_for("prefixgate-ours", s, a)
    assert ours.argv[:2] == ["/venv/bin/prefixgate", "serve"]
    joined = " ".join(ours.argv)
    assert "--engine model" in joined and "--block-size 16 --num-blocks 384" in joined and "--policy affinity" in joined
    assert f"--port {ours.port} --metrics-port {ours.metrics_port}" in joined and "--ingress proxy" in joined
    behind = " ".join(h.system_for("prefixgate-vllm", s, _args(ingress="haproxy")).argv)  # `--ingress haproxy`
    assert behind.endswith("--ingress haproxy")
    vllm = " ".join(h.system_for("prefixgate-vllm", s, a).argv)
    assert "--engine vllm" in vllm and "--replicas 2" in vllm and "--block-size 32 --num-blocks 192" in vllm
    ray = h.system_for("ray-llm-pow2", s, a)
    assert ray.argv[0] == "/venv-vllm/bin/python" and ray.argv[1].endswith("loadtest/ray_llm_app.py")
    assert "--router pow2" in " ".join(ray.argv) and "--num-blocks 192" in " ".join(ray.argv)
    assert ray.metrics_url == f"http://127.0.0.1:{ray.metrics_port}/metrics"
    assert "--router prefix" in " ".join(h.system_for("ray-llm-prefix", s, a).argv)
    assert ray.env == {} and h.system_for("ray-llm-prefix", s, a).env == {}


# ---- ray-llm-kv: Ray's KVAwareRouter -------------------------------------------------------------
def test_kv_system_in_the_table_and_the_defaults():
    assert h.RAY_ROUTERS["ray-llm-kv"] == "kv"
    assert h.RAY_ROUTERS["ray-llm-prefix"] == "prefix" and h.RAY_ROUTERS["ray-llm-pow2"] == "pow2"
    assert "ray-llm-kv" in h.SYSTEMS
    assert h.DEFAULT_SYSTEMS.index("ray-llm-kv") == h.DEFAULT_SYSTEMS.index("ray-llm-pow2") + 1
    assert "ray-llm-kv" in h.__doc__


def test_kv_system_command_line_and_env(monkeypatch):
    ports = iter(range(42000, 42100))
    monkeypatch.setattr(h, "free_port", lambda: next(ports))
    s = h.settings_from_args(_args())
    kv = h.system_for("ray-llm-kv", s, _args())
    assert kv.argv[0] == "/venv-vllm/bin/python" and kv.argv[1].endswith("loadtest/ray_llm_app.py")
    assert kv.argv[kv.argv.index("--router") + 1] == "kv"
    joined = " ".join(kv.argv)
    assert "--replicas 2" in joined and "--block-size 32 --num-blocks 192" in joined and "--max-model-len 2048" in joined
    assert f"--port {kv.port} --metrics-port {kv.metrics_port}" in joined
    assert kv.ready_marker == "[ray-llm] ready"
    # direct streaming, set in the environment the interpreter starts with (before Ray is imported)
    assert kv.env == {"RAY_SERVE_ENABLE_HA_PROXY": "1", "RAY_SERVE_LLM_ENABLE_DIRECT_STREAMING": "1",
                      "RAY_SERVE_INGRESS_REQUEST_ROUTER_FORWARD_BODY": "1"}


# as the LLMRouter replica's worker-*.err holds them (Dynamo's Rust log, ANSI colours and all)
ROUTER_LOG = (
    "INFO 2026-12-04 15:35:56,505 ray-llm_LLMRouter qdoe4hui -- Dynamo SelectionService created (indexer threads 4).\n"
    "\x1b[2m2026-12-04T15:37:19.461321Z\x1b[0m \x1b[32m INFO\x1b[0m \x1b[2mdynamo_kv_router::scheduling::selector\x1b[0m"
    "\x1b[2m:\x1b[0m Selected worker \x1b[3mrouter_mode\x1b[0m\x1b[2m=\x1b[0m\"kv\" \x1b[3mrequest_id\x1b[0m\x1b[2m=\x1b[0m"
    "\"7190a55b-14ae-4883-85e9-a995898de317\" \x1b[3mworker_id\x1b[0m\x1b[2m=\x1b[0m18288175156963056239 "
    "\x1b[3mlogit\x1b[0m\x1b[2m=\x1b[0m0.6875\n"
    "\x1b[2m2026-12-04T15:37:19.466574Z\x1b[0m \x1b[32m INFO\x1b[0m dynamo_kv_router::scheduling::selector: Selected worker "
    "router_mode=\"kv\" request_id=\"654bd5a5\" worker_id=10476613760765979413 logit=0.6875\n"
    "2026-12-04T15:37:19.487910Z  INFO dynamo_kv_router::scheduling::selector: Selected worker router_mode=\"kv\"\n"
    "INFO 2026-12-04 15:36:19,898 ray-llm_LLMRouter qdoe4hui -- In-process pre-routing tokenizer ready for /m\n"
)


def test_kv_scored_count_in_a_log_text():
    assert h.count_kv_scored(ROUTER_LOG) == 3
    assert h.count_kv_scored("") == 0
    assert h.count_kv_scored("selected worker 1\nSelected  worker 2\n") == 0  # the exact mark only


def test_kv_scored_in_a_session_dir(tmp_path):
    assert h.kv_scored_in_session(None) is None
    assert h.kv_scored_in_session(tmp_path / "nowhere") is None
    logs = tmp_path / "logs"
    (logs / "serve").mkdir(parents=True)
    assert h.kv_scored_in_session(tmp_path) == 0
    (logs / "worker-aa-01000000-111.err").write_text(ROUTER_LOG)
    (logs / "worker-aa-01000000-111.out").write_text("Selected worker worker_id=1\n")
    (logs / "worker-bb-01000000-222.err").write_text("nothing here\n")
    (logs / "raylet.out").write_text("Selected worker (not a worker's own output)\n")
    (logs / "serve" / "replica_ray-llm_LLMRouter_x.log").write_text("Selected worker copied by a logger\n")
    assert h.kv_scored_in_session(tmp_path) == 4
    assert h.kv_scored_in_session(str(tmp_path)) == 4


def test_session_dir_from_the_ready_line():
    log = ("[ray-llm] starting\n[ray-llm] ready http://127.0.0.1:5 metrics http://127.0.0.1:6/metrics startup 171.2s "
           "router kv session /tmp/ray/session_2026-12-04_15-37-01_123_999\n")
    assert h.parse_session_dir(log) == "/tmp/ray/session_2026-12-04_15-37-01_123_999"
    assert h.parse_session_dir("[ray-llm] ready http://x metrics http://y startup 1.0s router kv session -\n") is None
    assert h.parse_session_dir("[ray-llm] ready http://x metrics http://y startup 1.0s router pow2\n") is None


def test_kv_scored_note_says_when_it_did_not_score():
    assert h.kv_scored_note(32, 32) is None and h.kv_scored_note(36, 32) is None
    zero = h.kv_scored_note(0, 32)
    assert "0 'Selected worker'" in zero and "NOT a KV-aware result" in zero and "HAProxy" in zero
    assert "only 20 of 32" in h.kv_scored_note(20, 32)
    assert "not checked" in h.kv_scored_note(None, 32)
    row = {"system": "ray-llm-kv", "requests": 32, "kv_scored": 0, "note": zero}
    line = h.format_table([row]).splitlines()[2]
    assert "| 0 |" in line and "NOT a KV-aware" in line  # the count has its column, the note says why
    assert "KV scored" in h.format_table([]).splitlines()[0]


def test_cli_accepts_the_kv_system(capsys):
    from gateway.cli import main

    with pytest.raises(SystemExit) as e:
        main(["loadtest", "headtohead", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "ray-llm-kv" in out
    parser = argparse.ArgumentParser()
    h.add_parser(parser.add_subparsers())
    args = parser.parse_args(["headtohead", "--systems", "ray-llm-kv", "--clients", "bench", "--quick"])
    assert args.systems == "ray-llm-kv" and args.fn is h.cmd_headtohead and args.ingress == "proxy"
    typed = parser.parse_args(["headtohead", "--systems", "prefixgate-vllm", "--ingress", "haproxy"])
    s = h.settings_from_args(typed)
    assert h.system_for("prefixgate-vllm", s, typed).argv[-2:] == ["--ingress", "haproxy"]
    systems = [x.strip() for x in args.systems.split(",")]
    assert all(x in h.SYSTEMS for x in systems)


def test_one_step_budget_for_every_row_as_a_user_sets_it():
    """`--max-num-batched-tokens N` gives every row's engines the same step budget (by default
    each system keeps its own: prefixgate 512, vLLM 2048 on CPU), down to the kwargs Ray Serve
    LLM's app hands vLLM."""
    from loadtest import ray_llm_app

    parser = argparse.ArgumentParser()
    h.add_parser(parser.add_subparsers())
    typed = parser.parse_args(["headtohead", "--max-num-batched-tokens", "1024"])
    s = h.settings_from_args(typed)
    ours = h.system_for("prefixgate-vllm", s, typed).argv
    assert ours[ours.index("--max-num-batched-tokens") + 1] == "1024"
    ray = h.system_for("ray-llm-prefix", s, typed).argv
    assert ray_llm_app.engine_kwargs(ray_llm_app.parse_args(ray[2:]))["max_num_batched_tokens"] == 1024
    default = h.settings_from_args(parser.parse_args(["headtohead"]))
    assert "--max-num-batched-tokens" not in h.system_for("prefixgate-vllm", default, typed).argv
    ray = h.system_for("ray-llm-kv", default, typed).argv
    assert "max_num_batched_tokens" not in ray_llm_app.engine_kwargs(ray_llm_app.parse_args(ray[2:]))


def test_unknown_system_is_refused(capsys):
    parser = argparse.ArgumentParser()
    h.add_parser(parser.add_subparsers())
    args = parser.parse_args(["headtohead", "--systems", "ray-llm-kvv", "--clients", "bench"])
    assert h.cmd_headtohead(args) == 2
    assert "ray-llm-kv" in capsys.readouterr().err


def test_ray_llm_app_has_the_kv_router():
    text = (Path(h.REPO) / "loadtest" / "ray_llm_app.py").read_text()
    assert '"kv"' in text and "ray.serve.llm.request_router:KVAwareRouter" in text
    assert "loadtest.ray_kv_shim.install" in text


def test_kv_shim_aliases_the_moved_module(monkeypatch):
    import sys
    import types

    from loadtest import ray_kv_shim

    old, new = "fake_pkg_kv.old_mod", "fake_pkg_kv_new"
    pkg = types.ModuleType("fake_pkg_kv")
    pkg.__path__ = []  # a package with nothing in it: the old module cannot be found
    target = types.ModuleType(new)
    target.load_chat_template = lambda x: x
    monkeypatch.setitem(sys.modules, "fake_pkg_kv", pkg)
    monkeypatch.setitem(sys.modules, new, target)
    alias = ray_kv_shim._Alias(old, new)
    monkeypatch.setattr(sys, "meta_path", [alias, *sys.meta_path])
    from fake_pkg_kv.old_mod import load_chat_template

    assert load_chat_template is target.load_chat_template
    assert sys.modules[old] is target and pkg.old_mod is target
    monkeypatch.delitem(sys.modules, old)
    assert alias.find_spec("json") is None  # other names are not its business
    monkeypatch.setattr(sys, "meta_path", [f for f in sys.meta_path if not isinstance(f, ray_kv_shim._Alias)])
    ray_kv_shim.install()
    ray_kv_shim.install()
    assert sum(isinstance(f, ray_kv_shim._Alias) for f in sys.meta_path) == 1 and ray_kv_shim.installed()


# ---- uneven session lengths (loadtest/workload.py) ----------------------------------------------
def test_chat_turns_fixed_unless_turns_min():
    assert {chat_turns(0, u, j, 5) for u in range(10) for j in range(3)} == {5}
    assert chat_turns(0, 1, 1, 5, turns_min=5) == 5 and chat_turns(0, 1, 1, 5, turns_min=9) == 5


def test_chat_turns_uneven_and_reproducible():
    draws = [chat_turns(0, u, j, 6, turns_min=2) for u in range(40) for j in range(2)]
    assert draws == [chat_turns(0, u, j, 6, turns_min=2) for u in range(40) for j in range(2)]
    assert min(draws) >= 2 and max(draws) <= 6
    assert len(Counter(draws)) >= 4  # really uneven
    assert draws != [chat_turns(1, u, j, 6, turns_min=2) for u in range(40) for j in range(2)]  # seeded


def test_load_spec_passes_turns_min_to_locust():
    argv = LoadSpec(turns=6, turns_min=2).locust_argv("http://x", Path("/tmp/o"), "p")
    assert argv[argv.index("--turns-min") + 1] == "2" and argv[argv.index("--turns") + 1] == "6"


def test_audit_records_the_prefixgate_rows_and_audits_each_client_window(tmp_path):
    """`--audit` as typed: the prefixgate rows get `--audit-dir`, the Ray rows nothing; each
    client's audit takes the decisions made during its own run."""
    from router.protocol.audit_log import AuditWriter, Decision, Outcome
    from router.protocol.messages import RouteDecision

    parser = argparse.ArgumentParser()
    h.add_parser(parser.add_subparsers())
    typed = parser.parse_args(["headtohead", "--systems", "prefixgate-vllm,ray-llm-prefix", "--audit"])
    assert typed.audit
    s = h.settings_from_args(typed)
    ours = h.system_for("prefixgate-vllm", s, typed, tmp_path / "audit")
    assert ours.argv[-2:] == ["--audit-dir", str(tmp_path / "audit")] and ours.block_size == 32
    assert "--audit-dir" not in h.system_for("ray-llm-prefix", s, typed, None).argv

    w = AuditWriter.for_process(tmp_path / "audit", "router", "x")
    for t, rid in ((1.0, "warm-up"), (5.0, "bench-1"), (6.0, "bench-2")):
        w.write(Decision(t=t, request_id=rid, hashes=[1, 2, 3], prompt_tokens=100, replica="A",
                         route=RouteDecision("affinity", "load", "A")))
        w.write(Outcome(t=t + 0.5, request_id=rid, replica="A", prompt_tokens=100, cached_tokens=0))
    out = tmp_path / "bench"
    out.mkdir()
    row = h.audit_client(ours, (4.0, 7.0), out)
    assert row["decisions"] == 2 and row["requests"] == 2 and row["pooled_hits"] == 3  # bench-2 repeats bench-1
    assert "routing audit: 2 decisions" in (out / "audit.txt").read_text()
    assert h.audit_client(ours, (10.0, 11.0), out) is None  # nothing in that window: said, not raised
