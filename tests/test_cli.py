"""The `prefixgate` command as users type it: every subcommand takes its own options and --help
directly after its name (gateway/cli.py forwards the raw argv to the subcommand's entry point)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PREFIXGATE = Path(sys.executable).parent / "prefixgate"  # the installed console script


def prefixgate(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([str(PREFIXGATE), *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


# each subcommand, and options (or sub-subcommands) of its own that its help must list
HELP = {
    ("serve",): ["--redis-url", "--port", "--ray-address", "--metrics-port", "--policy", "--ingress"],
    ("chat",): ["--url", "--session"],
    ("bench",): ["engine", "router", "serving", "lora-routing", "noisy-neighbour", "overload", "goodput"],
    ("bench", "engine"): ["prefixgate bench engine", "--requests", "--new-tokens", "--threads"],
    ("bench", "router"): ["prefixgate bench router", "--blocks", "--prompt-tokens", "--cluster"],
    ("bench", "serving"): ["prefixgate bench serving", "--streams", "--replicas", "--max-tokens", "--config", "--ingress"],
    ("bench", "lora-routing"): ["prefixgate bench lora-routing", "--adapters", "--max-cpu-loras"],
    ("bench", "noisy-neighbour"): ["prefixgate bench noisy-neighbour", "--flood-tier", "--quiet-tier", "--modes", "--ingress"],
    ("bench", "goodput"): ["prefixgate bench goodput", "--seed", "--window", "--modes", "--length-scale"],
    ("bench", "pd"): ["prefixgate bench pd", "--prefill-replicas", "--decode-replicas", "--kill-prefill-every", "--pd-threshold-tokens"],
    ("bench", "overload"): ["prefixgate bench overload", "--factor", "--queue-wait-s", "--capacity-clients", "--ingress"],
    ("sim",): ["prefixgate sim", "--replicas", "--capacity", "--limit", "--policies", "--host-blocks"],
    ("loadtest",): ["prefixgate loadtest", "run", "compare", "summarize", "plot"],
    ("loadtest", "run"): ["--url", "--preset", "--plot"],
}


def test_console_script_installed():
    assert PREFIXGATE.exists(), f"{PREFIXGATE}: run `make install`"


@pytest.mark.parametrize("sub", [
    pytest.param(sub, marks=pytest.mark.slow) if sub == ("bench", "engine") else sub  # imports torch: seconds
    for sub in HELP
], ids=" ".join)
def test_subcommand_help(sub):
    r = prefixgate(*sub, "--help")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("usage:"), r.stdout
    for option in HELP[sub]:
        assert option in r.stdout, f"{option!r} missing from `prefixgate {' '.join(sub)} --help`:\n{r.stdout}"


def test_top_level_help_lists_every_subcommand():
    r = prefixgate("--help")
    assert r.returncode == 0, r.stderr
    assert "{serve,chat,bench,sim,loadtest}" in r.stdout


def test_sim_takes_options_directly():
    r = prefixgate("sim", "--replicas", "2", "--capacity", "200", "--limit", "200")
    assert r.returncode == 0, r.stderr
    assert "workload mooncake: 200 requests" in r.stdout
    assert "== 2 replicas x 200 blocks" in r.stdout
    rows = {line.split()[0] for line in r.stdout.splitlines() if line.strip()}
    for policy in ("affinity", "affinity-pull", "prefix", "session", "pow2", "random", "least-loaded"):
        assert policy in rows, r.stdout


@pytest.mark.parametrize("sub", [("serve",), ("sim",), ("loadtest", "run")], ids=" ".join)
def test_unknown_option_is_refused(sub):
    r = prefixgate(*sub, "--no-such-option")
    assert r.returncode == 2
    assert r.stderr.startswith("usage: prefixgate"), r.stderr
    assert "error: unrecognized arguments: --no-such-option" in r.stderr, r.stderr


def test_unknown_subcommand_is_refused():
    r = prefixgate("simulate")
    assert r.returncode == 2 and "invalid choice: 'simulate'" in r.stderr
    r = prefixgate("bench", "everything")
    assert r.returncode == 2 and "invalid choice: 'everything'" in r.stderr


def test_noisy_neighbour_tiers_reach_the_requests():
    """`prefixgate bench noisy-neighbour --flood-tier flex --quiet-tier priority`: each tenant's
    requests carry its service_tier (none sent when not given: the key's default)."""
    import random

    from loadtest.bench.noisy_neighbour import completion_body, parse_args

    args = parse_args(["--flood-tier", "flex", "--quiet-tier", "priority", "--modes", "on"])
    assert completion_body("m", 4, 2, random.Random(0), args.flood_tier)["service_tier"] == "flex"
    assert completion_body("m", 4, 2, random.Random(0), args.quiet_tier)["service_tier"] == "priority"
    assert "service_tier" not in completion_body("m", 4, 2, random.Random(0), parse_args([]).flood_tier)


def test_noisy_neighbour_flood_client_reads_retry_after():
    """A refused flood request is retried after the response's Retry-After (read here from a
    real HTTP 429), unless `--flood-retry-s` says otherwise, as typed."""
    import asyncio
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    import httpx

    from loadtest.bench.noisy_neighbour import parse_args, stream_completion

    class Overloaded(BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["content-length"]))
            body = json.dumps({"error": {"code": "server_overloaded", "message": "full"}}).encode()
            self.send_response(429)
            self.send_header("retry-after", "3")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Overloaded)
    threading.Thread(target=server.serve_forever, daemon=True).start()

    async def once():
        told: list[float] = []
        async with httpx.AsyncClient(timeout=30) as http:
            got = await stream_completion(http, f"http://127.0.0.1:{server.server_port}/v1/completions", "k", {}, None, told)
        return got, told

    try:
        (ttft, tokens, code), told = asyncio.run(once())
    finally:
        server.shutdown()
    assert (ttft, tokens, code, told) == (None, 0, "server_overloaded", [3.0])
    assert parse_args([]).flood_retry_s is None and parse_args(["--flood-retry-s", "0.05"]).flood_retry_s == 0.05


def test_noisy_neighbour_counts_a_quiet_request_still_decoding_at_the_window_end_once():
    """A quiet request that has its first token but is still streaming when the window ends is
    counted once, with its TTFT (it was also counted as censored, with its time so far: a false
    late request in every window); one with no token yet is counted once, censored. A real
    HTTP server streams the first token, or nothing, then holds the stream open past the window."""
    import asyncio
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from loadtest.bench.noisy_neighbour import window

    release = threading.Event()
    first_token = {"on": True}

    class Held(BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["content-length"]))
            self.send_response(200)
            self.send_header("content-type", "text/event-stream")
            self.end_headers()
            if first_token["on"]:
                event = {"choices": [{"index": 0, "text": "Hi"}]}
                self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
                self.wfile.flush()
            release.wait(60)  # held open past the window's end

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Held)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    spec = dict(base=f"http://127.0.0.1:{server.server_port}", model="m", seconds=1.0, quiet=True, flood=None,
                flood_streams=0, quiet_prompt=4, quiet_max_tokens=2, think_s=0.0, seed=0, warmup_s=0.0)
    try:
        decoding = asyncio.run(window(**spec))
        first_token["on"] = False
        silent = asyncio.run(window(**spec))
    finally:
        release.set()
        server.shutdown()
    assert len(decoding.quiet_ttft_ms) == len(decoding.quiet_sent_s) == 1, decoding
    assert len(silent.quiet_ttft_ms) == len(silent.quiet_sent_s) == 1, silent
    assert decoding.quiet_ttft_ms[0] < silent.quiet_ttft_ms[0]  # its first token, not the window's end


def test_noisy_neighbour_quiet_objective_reaches_the_requests():
    """`--quiet-slo-ttft-ms 150`: the quiet tenant's requests carry `x-slo-ttft-ms: 150` (read here
    by a real HTTP server that answers each with one token), the flood's none; the row's
    attainment counts the TTFTs within it over everything sent, refusals as misses."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from loadtest.bench.noisy_neighbour import Row, measure, parse_args

    seen: list[tuple[str, str | None]] = []

    class OneToken(BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["content-length"]))
            seen.append((self.headers["authorization"], self.headers.get("x-slo-ttft-ms")))
            self.send_response(200)
            self.send_header("content-type", "text/event-stream")
            self.end_headers()
            event = {"choices": [{"index": 0, "text": "Hi"}], "usage": {"completion_tokens": 1}}
            self.wfile.write(f"data: {json.dumps(event)}\n\ndata: [DONE]\n\n".encode())

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), OneToken)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    args = parse_args(["--quiet-slo-ttft-ms", "150", "--duration", "0.5", "--warmup-s", "0", "--flood-streams", "1",
                       "--think-s", "0.05", "--flood-nice", "0"])
    try:
        w = measure(args, f"http://127.0.0.1:{server.server_port}", "m", quiet=True, flood=(4, 2), seed=0)
    finally:
        server.shutdown()
    assert w.quiet_ttft_ms and w.flood_requests
    assert {slo for key, slo in seen if key == "Bearer sk-quiet"} == {"150"}
    assert {slo for key, slo in seen if key == "Bearer sk-flood"} == {None}
    row = Row("on", "long-prompts", 0, 0, 0, 0, 1, 1, {"quiet:slo_unattainable": 1}, [], [100.0, 149.0, 151.0],
              [], quiet_slo_ttft_ms=150, quiet_refused=1)
    assert row.slo_attainment == 0.5 and Row("on", "x", 0, 0, 0, 0, 1, 1, {}).slo_attainment is None


def test_noisy_neighbour_flood_client_runs_at_the_servers_niceness():
    """`--flood-nice N`: the flood's client process runs at niceness N (default Ray's workers'),
    the quiet client at 0. Empty windows (0 s): the processes start, report, and send nothing."""
    from loadtest.bench.noisy_neighbour import RAY_WORKER_NICENESS, measure, parse_args

    base = os.nice(0)
    for argv, flood_nice in ((["--flood-nice", "7"], 7), ([], RAY_WORKER_NICENESS)):
        args = parse_args([*argv, "--duration", "0", "--warmup-s", "0"])
        w = measure(args, "http://127.0.0.1:9", "m", quiet=True, flood=(4, 2), seed=0)
        assert (w.flood_nice, w.quiet_nice) == (min(base + flood_nice, 19), base)
        assert w.flood_requests == 0 and not w.quiet_ttft_ms


def test_an_api_keys_file_that_cannot_be_read_is_refused_by_name(tmp_path):
    """`serve --api-keys FILE`: a missing file, one that is not JSON, or one of the wrong shape is
    a clear error naming the flag and the file (exit 2) before anything starts; a missing file
    was a traceback."""
    bad = tmp_path / "keys.json"
    bad.write_text("{bad")
    for path, why in ((tmp_path / "missing.json", "cannot read it (No such file or directory)"),
                      (bad, "not JSON (Expecting property name")):
        r = prefixgate("serve", "--engine", "sim", "--api-keys", str(path))
        assert r.returncode == 2 and f"--api-keys {path}: {why}" in r.stderr, r.stderr
        assert "Traceback" not in r.stderr
    bad.write_text('{"sk-a": 5}')
    r = prefixgate("serve", "--engine", "sim", "--api-keys", str(bad))
    assert r.returncode == 2 and "expected a tenant name or an object" in r.stderr, r.stderr


def test_serve_on_a_port_in_use_is_refused_before_anything_starts():
    """A port another process listens on is named and refused (exit 2) before Ray starts; it
    was a Serve traceback after the whole stack had come up and gone down again."""
    import socket

    with socket.socket() as held, socket.socket() as metrics:
        held.bind(("127.0.0.1", 0))
        held.listen()
        metrics.bind(("127.0.0.1", 0))
        metrics.listen()
        port, metrics_port = held.getsockname()[1], metrics.getsockname()[1]
        r = prefixgate("serve", "--engine", "sim", "--port", str(port), "--metrics-port", str(metrics_port))
    assert r.returncode == 2, r.stdout + r.stderr
    assert f"--port {port}, --metrics-port {metrics_port}: in use by another process" in r.stderr, r.stderr
    assert "starting:" not in r.stdout and "Traceback" not in r.stderr


def test_bench_config_option_as_a_user_types_it():
    """`--config KEY=JSON` reaches the stack's AppConfig fields; a malformed one is refused by
    the parser, named, before any stack starts."""
    from loadtest.bench import overload, serving_bench
    from loadtest.bench.stack_options import config_overrides

    args = overload.parse_args(["--config", "max_queued_requests=128", "--config", 'sim_service={"decode_step_s": 0.01}'])
    assert config_overrides(args) == {"max_queued_requests": 128, "sim_service": {"decode_step_s": 0.01}}
    assert config_overrides(serving_bench.parse_args(["--config", "stream_interval_ms=0"])) == {"stream_interval_ms": 0}
    for bad, why in (("max_queued_requests", "expected KEY=JSON"), ("flow_control=maybe", "not JSON")):
        r = prefixgate("bench", "overload", "--config", bad)
        assert r.returncode == 2 and why in r.stderr, r.stderr


def test_bench_serving_ingress_as_a_user_types_it():
    """`--ingress proxy haproxy` measures each front on a stack of its own, in a child process
    given the user's other options, one ingress and its own JSON file; a front Ray lacks is
    refused by the parser."""
    from loadtest.bench import serving_bench

    argv = ["--streams", "16", "64", "--ingress", "proxy", "haproxy", "--json", "/tmp/x.json", "--requests", "2"]
    assert serving_bench.parse_args(argv).ingress == ["proxy", "haproxy"]
    assert serving_bench.parse_args(["--streams", "4"]).ingress == ["proxy"]
    assert serving_bench.child_argv(argv, "haproxy", "/tmp/c.json") == [
        "--streams", "16", "64", "--requests", "2", "--ingress", "haproxy", "--json", "/tmp/c.json"]
    child = serving_bench.parse_args(serving_bench.child_argv(argv, "proxy", "/tmp/c.json"))
    assert (child.ingress, child.streams, child.requests, child.json) == (["proxy"], [16, 64], 2, "/tmp/c.json")
    r = prefixgate("bench", "serving", "--ingress", "envoy")
    assert r.returncode == 2 and "invalid choice: 'envoy'" in r.stderr, r.stderr
    from loadtest.bench import noisy_neighbour, overload

    for bench in (noisy_neighbour, overload):  # one front each, the stack's
        assert bench.parse_args(["--ingress", "haproxy"]).ingress == "haproxy"
        assert bench.parse_args([]).ingress == "proxy"


def test_serve_refuses_what_a_joined_cluster_decides():
    """With --ray-address, Redis must be named (replicas elsewhere cannot reach a local one) and
    the ingress is the cluster's own (its nodes' environment): both refused before anything starts."""
    r = prefixgate("serve", "--ray-address", "127.0.0.1:9")
    assert r.returncode == 2 and "--ray-address needs --redis-url" in r.stderr, r.stderr
    r = prefixgate("serve", "--ray-address", "127.0.0.1:9", "--redis-url", "redis://127.0.0.1:9", "--ingress", "haproxy")
    assert r.returncode == 2 and "--ingress haproxy applies to a Ray this command starts" in r.stderr, r.stderr
