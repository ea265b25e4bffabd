"""`prefixgate loadtest headtohead`: the same 2 replicas under several serving systems, one
system at a time, driven by the same clients; one table per client.

Systems (rows):

  prefixgate-vllm  `prefixgate serve --engine vllm` (vLLM's engine behind our gateway and router)
  ray-llm-prefix   Ray Serve LLM's OpenAI app (`build_openai_app`, `LLMServer` on vLLM's CPU
                   engine) with Ray's PrefixCacheAffinityRouter (loadtest/ray_llm_app.py)
  ray-llm-pow2     the same with Ray Serve's default router (power of two choices)
  ray-llm-kv       the same with Ray's KVAwareRouter (alpha): NVIDIA Dynamo's selection service
                   scores the replicas on their vLLM KV events, on Ray's direct-streaming path
                   (HAProxy to each replica's own vLLM server); its row counts the router's
                   "Selected worker" log lines (`kv_scored`), and says so when there are none
  prefixgate-ours  `prefixgate serve --engine model` (our own engine, block size 16, the same pool)

Clients (tables):

  bench  vLLM's own benchmark client, `vllm bench serve --dataset-name prefix_repetition`
         against /v1/completions (run in the vLLM venv)
  chat   our Locust chat users: growing histories, uneven session lengths (loadtest/locustfile.py)

Every system is started fresh (cold caches), warmed with a few sub-block requests, measured,
and stopped (SIGTERM, wait, ports confirmed free) before the next. Hit rate is the engines' own
prefix-cache counters, delta(hits) / delta(queries) summed over the replicas, scraped from the
Ray node's metrics export before and after each client run (docs/vllm.md).

The pure parts (result parsing, counter deltas, the ceiling, the tables) are at the top and
unit-tested in tests/test_headtohead.py; the process handling is below them.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from gateway.ingress import DEFAULT_INGRESS, INGRESSES
from gateway.local_redis import free_port
from router.policy_table import DEFAULT_POLICY

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "loadtest" / "results"
SYSTEMS = ("prefixgate-vllm", "ray-llm-prefix", "ray-llm-pow2", "ray-llm-kv", "prefixgate-ours")
RAY_ROUTERS = {"ray-llm-prefix": "prefix", "ray-llm-pow2": "pow2", "ray-llm-kv": "kv"}  # ray_llm_app.py --router
DEFAULT_SYSTEMS = SYSTEMS
CLIENTS = ("bench", "chat")
MODEL_NAME = "SmolLM2-135M-Instruct"
HITS = "ray_vllm_prefix_cache_hits_total"
QUERIES = "ray_vllm_prefix_cache_queries_total"
# One thread per replica, unpinned; vLLM's CPU backend refuses to start here without a K/V space.
ENGINE_ENV = {"OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_CPU_KVCACHE_SPACE": "1"}
# ray-llm-kv: Ray 2.60 runs KVAwareRouter only on its direct-streaming path; these must be set
# before Ray is imported (ray_llm_app.py --router kv sets them too), so they go in the env.
KV_ENV = {"RAY_SERVE_ENABLE_HA_PROXY": "1", "RAY_SERVE_LLM_ENABLE_DIRECT_STREAMING": "1",
          "RAY_SERVE_INGRESS_REQUEST_ROUTER_FORWARD_BODY": "1"}
# What Dynamo's selection service logs (in the LLMRouter replica's worker log) for each request
# it scored; none means the router replica never served and HAProxy balanced on its own.
KV_SCORED_MARK = "Selected worker"

# vLLM's CLI checks importlib.metadata.version("vllm"); this build's distribution is "vllm-cpu".
# The "+cpu" matters: vLLM's platform detection looks for "cpu" in that version string, and
# without it falls back to an unspecified platform that imports the AVX-512 kernels (SIGILL on
# an AVX2-only CPU).
VLLM_CLI = """
import importlib.metadata as md, sys
_version = md.version
def version(name):
    return _version("vllm-cpu") + "+cpu" if name == "vllm" else _version(name)
md.version = version
sys.argv = ["vllm", *sys.argv[1:]]
from vllm.entrypoints.cli.main import main
main()
"""


# ---- settings ----------------------------------------------------------------------------------
@dataclass
class BenchSpec:
    """vLLM's `bench serve` with the prefix_repetition dataset."""

    prefix_len: int = 512
    suffix_len: int = 64
    num_prefixes: int = 16
    output_len: int = 16
    num_prompts: int = 128
    max_concurrency: int = 8
    seed: int = 0

    def argv(self, url: str, model_name: str, tokenizer: str, result_dir: Path) -> list[str]:
        return [
            "bench", "serve", "--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions",
            "--model", model_name, "--tokenizer", tokenizer,
            "--dataset-name", "prefix_repetition",
            "--prefix-repetition-prefix-len", str(self.prefix_len),
            "--prefix-repetition-suffix-len", str(self.suffix_len),
            "--prefix-repetition-num-prefixes", str(self.num_prefixes),
            "--prefix-repetition-output-len", str(self.output_len),
            "--num-prompts", str(self.num_prompts), "--max-concurrency", str(self.max_concurrency),
            "--ignore-eos", "--temperature", "0", "--seed", str(self.seed),
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
            "--save-result", "--result-dir", str(result_dir), "--result-filename", "bench.json",
            "--disable-tqdm",
        ]


@dataclass
class Settings:
    """What every row shares."""

    replicas: int = 2
    pool_tokens: int = 6144  # K/V pool per replica, tokens: 192 blocks of 32, 384 of 16
    vllm_block_size: int = 32
    ours_block_size: int = 16
    max_model_len: int = 2048
    max_num_batched_tokens: int | None = None  # every row's engine step budget (None: each system's default)
    model_name: str = MODEL_NAME
    model: str = ""  # model directory (resolved at start)
    bench: BenchSpec = field(default_factory=BenchSpec)
    chat: dict = field(default_factory=dict)  # LoadSpec fields (loadtest/locust_run.py)

    def num_blocks(self, block_size: int) -> int:
        return self.pool_tokens // block_size


def chat_load(quick: bool) -> dict:
    """The chat client's LoadSpec fields: 8 system prompts of ~480 tokens (3,840 tokens: more
    than half a replica's 6,144-token pool), user messages ~32 tokens, 2-6 turns per chat
    (uneven), histories resent every turn; quick: a short version of the same."""
    if quick:
        return dict(workload="chat", users=4, spawn_rate=4.0, system_prompts=4, system_tokens=256,
                    user_tokens=24, turns=4, turns_min=2, sessions_per_user=1, think_min=0.5,
                    think_max=1.0, max_tokens=16, duration_s=300, seed=0)
    return dict(workload="chat", users=8, spawn_rate=8.0, system_prompts=8, system_tokens=480,
                user_tokens=32, turns=6, turns_min=2, sessions_per_user=2, think_min=1.0,
                think_max=2.0, max_tokens=16, duration_s=900, seed=0)


# ---- pure parts --------------------------------------------------------------------------------
def prefix_ceiling(prefix_len: int, suffix_len: int, num_prefixes: int, num_prompts: int) -> float:
    """The best hit rate prefix_repetition allows: every prompt after its prefix's first one
    finds the prefix cached, nothing else can hit (block rounding ignored). vLLM's dataset
    makes num_prompts // num_prefixes prompts per prefix."""
    per_prefix = num_prompts // num_prefixes
    if per_prefix < 1:
        raise ValueError(f"num_prompts ({num_prompts}) must be >= num_prefixes ({num_prefixes})")
    return prefix_len / (prefix_len + suffix_len) * (1 - 1 / per_prefix)


def parse_prometheus(text: str, names: tuple[str, ...] = (HITS, QUERIES)) -> dict[str, float]:
    """Sum of every sample of each named metric (over replicas, engines and any other labels);
    a metric with no sample is 0 (vLLM's hits counter has no series until its first hit)."""
    sums = dict.fromkeys(names, 0.0)
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_end = len(line)
        for i, ch in enumerate(line):
            if ch in "{ ":
                name_end = i
                break
        name = line[:name_end]
        if name not in sums:
            continue
        if "}" in line:
            rest = line[line.rindex("}") + 1:]
        else:
            rest = line[name_end:]
        parts = rest.split()
        if not parts:
            continue
        try:
            value = float(parts[0])
        except ValueError:
            continue
        if not math.isnan(value):
            sums[name] += value
    return sums


def hit_rate_delta(before: dict[str, float] | None, after: dict[str, float] | None) -> dict:
    """delta(hits) / delta(queries); None where a scrape is missing, nothing was queried, or a
    counter went down (a replica restarted in between)."""
    out = {"hits": None, "queries": None, "hit_rate": None}
    if before is None or after is None:
        return out
    hits = after.get(HITS, 0.0) - before.get(HITS, 0.0)
    queries = after.get(QUERIES, 0.0) - before.get(QUERIES, 0.0)
    out.update(hits=hits, queries=queries)
    if queries > 0 and hits >= 0:
        out["hit_rate"] = hits / queries
    return out


def parse_bench_result(result: dict) -> dict:
    """The row numbers from `vllm bench serve --save-result`'s JSON (milliseconds -> seconds)."""
    def ms(key: str) -> float | None:
        v = result.get(key)
        return None if v is None else v / 1000.0

    return {
        "requests": result.get("num_prompts", (result.get("completed") or 0) + (result.get("failed") or 0)),
        "completed": result.get("completed"),
        "errors": result.get("failed"),
        "duration_s": result.get("duration"),
        "ttft_p50_s": ms("median_ttft_ms"),
        "ttft_p99_s": ms("p99_ttft_ms"),
        "tpot_p50_s": ms("median_tpot_ms"),
        "output_tokens_per_s": result.get("output_throughput"),
        "input_tokens": result.get("total_input_tokens"),
        "output_tokens": result.get("total_output_tokens"),
    }


def parse_chat_summary(summary: dict) -> dict:
    """The row numbers from a Locust run's summary.json (loadtest/summary.py)."""
    return {
        "requests": summary.get("requests"),
        "completed": summary.get("ok"),
        "errors": (summary.get("errors") or 0) + (summary.get("aborted") or 0),
        "duration_s": summary.get("duration_s"),
        "ttft_p50_s": summary.get("ttft_p50_s"),
        "ttft_p99_s": summary.get("ttft_p99_s"),
        "tpot_p50_s": summary.get("tpot_p50_s"),
        "output_tokens_per_s": summary.get("output_tokens_per_s"),
        "input_tokens": summary.get("prompt_tokens"),
        "output_tokens": summary.get("completion_tokens"),
        "client_hit_rate": summary.get("hit_rate"),  # from usage.cached_tokens, where a server reports it
    }


def count_kv_scored(text: str) -> int:
    """Lines of one log that record a KV-scored selection."""
    return sum(1 for line in text.splitlines() if KV_SCORED_MARK in line)


def parse_session_dir(log_text: str) -> str | None:
    """The Ray session directory from ray_llm_app.py's ready line (`... session DIR`)."""
    for line in log_text.splitlines():
        if line.startswith("[ray-llm] ready") and " session " in line:
            path = line.rsplit(" session ", 1)[1].strip()
            return path if path and path != "-" else None
    return None


def kv_scored_in_session(session_dir: str | Path | None) -> int | None:
    """"Selected worker" lines in a Ray session's worker logs (logs/worker-*.out and .err: the
    processes' own output, where the LLMRouter replica's Dynamo selection service writes);
    None when there is no such directory."""
    if not session_dir:
        return None
    logs = Path(session_dir) / "logs"
    if not logs.is_dir():
        return None
    total = 0
    for path in sorted(logs.glob("worker-*")):
        if path.suffix in (".out", ".err") and path.is_file():
            total += count_kv_scored(path.read_text(errors="replace"))
    return total


def kv_scored_note(kv_scored: int | None, requests: int | None) -> str | None:
    """The row's note for ray-llm-kv: None when the router scored; otherwise says plainly that
    the numbers are not a KV-aware result."""
    if kv_scored is None:
        return "KV router not checked: no Ray session logs found"
    if kv_scored == 0:
        return ("KV router never scored (0 'Selected worker' lines): the router replica did not serve, "
                "HAProxy balanced by least connections; NOT a KV-aware result")
    if requests and kv_scored < requests:
        return f"KV router scored only {kv_scored} of {requests} requests"
    return None


TABLE = (
    ("system", "system", "{}"),
    ("requests", "requests", "{}"),
    ("duration_s", "run time", "{:.1f}s"),
    ("hit_rate", "hit rate", "{:.1%}"),
    ("ttft_p50_s", "TTFT p50", "{:.3f}s"),
    ("ttft_p99_s", "TTFT p99", "{:.3f}s"),
    ("tpot_p50_s", "TPOT p50", "{:.3f}s"),
    ("output_tokens_per_s", "out tok/s", "{:.1f}"),
    ("errors", "errors", "{}"),
    ("startup_s", "start-up", "{:.0f}s"),
    ("kv_scored", "KV scored", "{}"),
)


def _cell(row: dict, key: str, fmt: str) -> str:
    v = row.get(key)
    if v is None:
        return "-"
    try:
        return fmt.format(v)
    except (ValueError, TypeError):
        return str(v)


def format_table(rows: list[dict]) -> str:
    """A markdown table, one line per system; a row that failed says why in its last cell."""
    heads = [h for _, h, _ in TABLE] + ["note"]
    lines = ["| " + " | ".join(heads) + " |", "|" + "|".join("---" for _ in heads) + "|"]
    for r in rows:
        cells = [_cell(r, k, f) for k, _, f in TABLE] + [str(r.get("note") or "").replace("|", "/")[:160]]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def report_markdown(result: dict) -> str:
    """headtohead.md: the settings, the ceiling and one table per client."""
    s = result["settings"]
    b = s["bench"]
    out = [f"# Head-to-head ({result.get('started', '')})", "",
           f"{s['replicas']} replicas each, model `{s['model_name']}`, pool {s['pool_tokens']} tokens per replica "
           f"({s['pool_tokens'] // s['vllm_block_size']} blocks of {s['vllm_block_size']} for vLLM, "
           f"{s['pool_tokens'] // s['ours_block_size']} of {s['ours_block_size']} for ours), max_model_len "
           f"{s['max_model_len']}, one thread per replica. Hit rate: the engines' prefix-cache counters "
           f"(delta hits / delta queries over the run, summed over replicas).", ""]
    for client in result["clients"]:
        rows = result["tables"].get(client, [])
        if client == "bench":
            out.append(f"## bench: `vllm bench serve`, prefix_repetition {b['num_prompts']} prompts "
                       f"({b['num_prefixes']} prefixes x {b['prefix_len']} + {b['suffix_len']} tokens, "
                       f"{b['output_len']} out, concurrency {b['max_concurrency']})")
            out.append("")
            out.append(f"Ceiling: prefix share x (1 - prefixes/prompts) = {b['prefix_len']}/{b['prefix_len'] + b['suffix_len']}"
                       f" x (1 - {b['num_prefixes']}/{b['num_prompts']}) = {result['ceiling']:.1%}")
        else:
            c = s["chat"]
            out.append(f"## chat: Locust chat users, {c.get('users')} users x {c.get('sessions_per_user')} chats of "
                       f"{c.get('turns_min') or c.get('turns')}-{c.get('turns')} turns, {c.get('system_prompts')} system "
                       f"prompts of ~{c.get('system_tokens')} tokens, replies <= {c.get('max_tokens')} tokens")
        out += ["", format_table(rows), ""]
    return "\n".join(out)


# ---- processes ---------------------------------------------------------------------------------
def port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    with socket.socket() as s:  # and nobody listens on another address of the port
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) != 0


def default_vllm_python() -> str:
    return str(REPO / ".venv-vllm" / "bin" / "python")


def default_prefixgate() -> str:
    here = Path(sys.executable).parent / "prefixgate"
    return str(here if here.exists() else REPO / ".venv" / "bin" / "prefixgate")


@dataclass
class System:
    """One row: how to start it, where it listens, what marks it ready."""

    name: str
    argv: list[str]
    port: int
    metrics_port: int
    ready_marker: str
    env: dict = field(default_factory=dict)
    audit_dir: Path | None = None  # a prefixgate row's live routing audit (--audit)
    block_size: int = 16

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"


def system_for(name: str, s: Settings, args: argparse.Namespace, audit_dir: Path | None = None) -> System:
    """`audit_dir`: where a prefixgate row records the live routing audit (`--audit`)."""
    port, mport = free_port(), free_port()
    if name in ("prefixgate-vllm", "prefixgate-ours"):
        vllm = name == "prefixgate-vllm"
        block = s.vllm_block_size if vllm else s.ours_block_size
        argv = [args.prefixgate, "serve", "--engine", "vllm" if vllm else "model", "--replicas", str(s.replicas),
                "--policy", DEFAULT_POLICY, "--block-size", str(block), "--num-blocks", str(s.num_blocks(block)),
                "--max-model-len", str(s.max_model_len), "--model", s.model, "--model-name", s.model_name,
                "--port", str(port), "--metrics-port", str(mport), "--ingress", args.ingress]
        if s.max_num_batched_tokens:
            argv += ["--max-num-batched-tokens", str(s.max_num_batched_tokens)]
        if audit_dir is not None:
            argv += ["--audit-dir", str(audit_dir)]
        return System(name, argv, port, mport, "[prefixgate] serving until Ctrl-C", audit_dir=audit_dir, block_size=block)
    router = RAY_ROUTERS[name]
    argv = [args.vllm_python, str(REPO / "loadtest" / "ray_llm_app.py"), "--router", router,
            "--replicas", str(s.replicas), "--block-size", str(s.vllm_block_size),
            "--num-blocks", str(s.num_blocks(s.vllm_block_size)), "--max-model-len", str(s.max_model_len),
            "--model", s.model, "--model-name", s.model_name, "--port", str(port), "--metrics-port", str(mport)]
    if s.max_num_batched_tokens:
        argv += ["--max-num-batched-tokens", str(s.max_num_batched_tokens)]
    return System(name, argv, port, mport, "[ray-llm] ready", env=dict(KV_ENV) if router == "kv" else {})


def _group_ids(pid: int) -> set[int]:
    """A process's process group and session ids (empty once it is gone)."""
    try:
        return {os.getpgid(pid), os.getsid(pid)}
    except OSError:
        return set()


def group_members(groups: set[int], exclude: set[int]) -> list:
    """Every live process whose process group or session is one of groups (ours excluded)."""
    import psutil

    out = []
    for p in psutil.process_iter():
        if p.pid in exclude:
            continue
        if _group_ids(p.pid) & groups:
            out.append(p)
    return out


class Running:
    """A started system: its process (in a session of its own), its log, and every process
    group and session its processes were seen in (Ray's workers and what they start, HAProxy
    and vLLM's engine cores among them, may sit in groups of their own and outlive their
    parents: the stop takes down every member of those groups too)."""

    def __init__(self, system: System, log_path: Path) -> None:
        self.system = system
        self.log_path = log_path
        self.t0 = time.monotonic()
        env = {**os.environ, **ENGINE_ENV, **system.env, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
        self.log = log_path.open("w")
        self.proc = subprocess.Popen(system.argv, stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                                     start_new_session=True)
        self.startup_s: float | None = None
        self.groups: set[int] = {self.proc.pid}  # its session (start_new_session: sid == pid)
        self._own = _group_ids(os.getpid()) | {os.getpid()}  # never ours

    def note_groups(self) -> None:
        """Record the process groups and sessions of the system's processes as they are now."""
        import psutil

        try:
            procs = [self.proc.pid] + [p.pid for p in psutil.Process(self.proc.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            return
        for pid in procs:
            self.groups |= _group_ids(pid) - self._own

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"exited with {self.proc.returncode} before it was ready: {self.tail(600)}")
            if self.system.ready_marker in self.log_path.read_text(errors="replace"):
                self.startup_s = time.monotonic() - self.t0
                return
            time.sleep(1.0)
        raise RuntimeError(f"not ready after {timeout_s:.0f}s: {self.tail(600)}")

    def tail(self, n: int) -> str:
        text = self.log_path.read_text(errors="replace")
        return " ".join(text[-n:].split())

    def stop(self, timeout_s: float = 180.0) -> dict:
        """SIGTERM to the process we started, wait; then whatever of its descendants is left
        (ours: it started them) is terminated, then killed. Ports confirmed free at the end."""
        import psutil

        t0 = time.monotonic()
        info: dict = {"forced": []}
        self.note_groups()
        try:
            descendants = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            descendants = []
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                info["forced"].append(self.proc.pid)
                self.proc.kill()
                self.proc.wait(30)
        info["exit_code"] = self.proc.returncode
        _, alive = psutil.wait_procs(descendants, timeout=20)
        for sig in ("terminate", "kill"):
            for p in alive:
                try:
                    getattr(p, sig)()
                    info["forced"].append(p.pid)
                except psutil.NoSuchProcess:
                    pass
            _, alive = psutil.wait_procs(alive, timeout=10)
        # what left the tree (re-parented to init) but stayed in one of the system's groups
        strays = group_members(self.groups, self._own)
        info["group_strays"] = [p.pid for p in strays]
        for sig in ("terminate", "kill"):
            for p in strays:
                try:
                    getattr(p, sig)()
                    info["forced"].append(p.pid)
                except psutil.NoSuchProcess:
                    pass
            _, strays = psutil.wait_procs(strays, timeout=10)
        info["left_running"] = sorted({p.pid for p in alive} | {p.pid for p in group_members(self.groups, self._own)})
        deadline = time.monotonic() + 60
        ports = (self.system.port, self.system.metrics_port)
        while time.monotonic() < deadline and not all(port_free(p) for p in ports):
            time.sleep(1.0)
        info["ports_busy"] = [p for p in ports if not port_free(p)]
        info["stop_s"] = time.monotonic() - t0
        self.log.close()
        return info


def scrape(url: str) -> dict[str, float] | None:
    import httpx

    try:
        r = httpx.get(url, timeout=10)
        r.raise_for_status()
        return parse_prometheus(r.text)
    except Exception as e:  # a missing scrape leaves the hit rate empty, not the row
        print(f"[headtohead] metrics scrape {url} failed: {e!r}", file=sys.stderr, flush=True)
        return None


def settled(url: str, quiet_s: float, timeout_s: float, more_than: dict | None = None) -> dict | None:
    """The counters once Ray's export has caught up: unchanged for quiet_s (Ray's agents
    refresh every ~10 s) and, with more_than, with more queries than that earlier scrape."""
    deadline = time.monotonic() + timeout_s
    last, since = None, time.monotonic()
    while True:
        cur = scrape(url)
        now = time.monotonic()
        if cur != last:
            last, since = cur, now
        grown = more_than is None or (cur is not None and cur.get(QUERIES, 0.0) > more_than.get(QUERIES, 0.0))
        if cur is not None and grown and now - since >= quiet_s:
            return cur
        if now >= deadline:
            return cur
        time.sleep(1.0)


def warm_up(url: str, model_name: str, n: int, tag: str) -> None:
    """A few requests with prompts of their own, each under one block (of 16 tokens), so they
    leave nothing cached that a measured prompt could hit; first-call overheads are paid here."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    def one(i: int) -> None:
        r = httpx.post(f"{url}/v1/completions", timeout=300,
                       json={"model": model_name, "prompt": f"Warm {tag} {i}.", "max_tokens": 4, "temperature": 0})
        r.raise_for_status()

    with ThreadPoolExecutor(n) as pool:
        list(pool.map(one, range(n)))


def run_bench(s: Settings, system: System, out: Path, args: argparse.Namespace) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    argv = [args.vllm_python, "-c", VLLM_CLI, *s.bench.argv(system.url, s.model_name, s.model, out)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_TARGET_DEVICE": "cpu", "PYTHONUNBUFFERED": "1"}
    t0 = time.monotonic()
    with (out / "bench.log").open("w") as log:
        proc = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                              timeout=args.client_timeout)
    path = out / "bench.json"
    if proc.returncode != 0 or not path.exists():
        tail = " ".join((out / "bench.log").read_text(errors="replace")[-600:].split())
        raise RuntimeError(f"vllm bench serve exited with {proc.returncode}: {tail}")
    row = parse_bench_result(json.loads(path.read_text()))
    row["wall_s"] = time.monotonic() - t0
    return row


def run_chat(s: Settings, system: System, out: Path, args: argparse.Namespace) -> dict:
    from loadtest.locust_run import LoadSpec, run_locust

    spec = LoadSpec(**s.chat)
    summary = run_locust(spec, system.url, out, system.name)
    if summary.get("locust_failure"):
        raise RuntimeError(f"locust exited with {summary.get('locust_exit_code')}")
    row = parse_chat_summary(summary)
    row["wall_s"] = summary.get("wall_s")
    return row


def measure(client: str, s: Settings, system: System, out: Path, args: argparse.Namespace,
            kv_session: str | None = None, check_kv: bool = False) -> dict:
    """One client run between two settled scrapes of the engines' counters; with check_kv
    (ray-llm-kv), also the KV router's "Selected worker" lines logged in between."""
    out.mkdir(parents=True, exist_ok=True)
    before = settled(system.metrics_url, args.metrics_quiet_s, args.metrics_timeout_s)
    kv_before = kv_scored_in_session(kv_session) if check_kv else None
    (out / "metrics_before.json").write_text(json.dumps(before))
    fn = run_bench if client == "bench" else run_chat
    started = time.time()
    try:
        row = fn(s, system, out, args)
    except Exception as e:
        row = {"note": f"{client} failed: {e}"}
        print(f"[headtohead] {system.name} {client}: {e}", file=sys.stderr, flush=True)
    if system.audit_dir is not None:
        row["audit"] = audit_client(system, (started, time.time()), out)
    after = settled(system.metrics_url, args.metrics_quiet_s, args.metrics_timeout_s, more_than=before)
    (out / "metrics_after.json").write_text(json.dumps(after))
    row.update(hit_rate_delta(before, after))
    if check_kv:
        kv_after = kv_scored_in_session(kv_session)
        row["kv_scored"] = None if kv_before is None or kv_after is None else kv_after - kv_before
        note = kv_scored_note(row["kv_scored"], row.get("requests"))
        if note:
            row["note"] = f"{row['note']}; {note}" if row.get("note") else note
            print(f"[headtohead] {system.name} {client}: {note}", file=sys.stderr, flush=True)
    return row


def audit_client(system: System, window: tuple[float, float], out: Path) -> dict | None:
    """The live routing audit of one client's run (loadtest/live_audit.py), printed and written
    to `out/audit.txt`; None (with the reason printed) where it cannot be made."""
    from loadtest.live_audit import audit_dir, report

    try:
        result = audit_dir(system.audit_dir, system.block_size, window=window)
    except (ValueError, OSError) as e:
        print(f"[headtohead] {system.name}: no audit: {e}", file=sys.stderr, flush=True)
        return None
    text = report(result)
    (out / "audit.txt").write_text(text + "\n")
    print(f"[headtohead] {system.name} {out.name}: {text}", flush=True)
    return {**result.summary.to_dict(), "decisions": result.decisions, "unmatched": result.unmatched,
            "prompt_blocks": result.prompt_blocks}


def run_system(name: str, s: Settings, clients: list[str], out: Path, args: argparse.Namespace) -> dict:
    """Start, warm, measure each client, stop. A system that does not start gets rows saying why."""
    audit = out / "audit" if args.audit and name.startswith("prefixgate") else None
    system = system_for(name, s, args, audit)
    out.mkdir(parents=True, exist_ok=True)
    (out / "command.txt").write_text(" ".join(system.argv) + "\n")
    print(f"[headtohead] {name}: starting ({' '.join(system.argv[:4])} ...; log {out / 'server.log'})", flush=True)
    running = Running(system, out / "server.log")
    result: dict = {"system": name, "argv": system.argv, "clients": {}}
    try:
        try:
            running.wait_ready(args.start_timeout)
            warm_up(system.url, s.model_name, 2 * s.replicas, f"{name}-{int(time.time())}")
        except Exception as e:
            result["start_error"] = str(e)
            print(f"[headtohead] {name}: did not start: {e}", file=sys.stderr, flush=True)
            return result
        result["startup_s"] = running.startup_s
        running.note_groups()
        check_kv = RAY_ROUTERS.get(name) == "kv"
        kv_session = parse_session_dir(running.log_path.read_text(errors="replace")) if check_kv else None
        if check_kv:
            result["ray_session_dir"] = kv_session
        print(f"[headtohead] {name}: ready in {running.startup_s:.0f}s at {system.url}", flush=True)
        for client in clients:
            t0 = time.monotonic()
            row = measure(client, s, system, out / client, args, kv_session, check_kv)
            result["clients"][client] = row
            running.note_groups()
            print(f"[headtohead] {name} {client}: {json.dumps(_brief(row))} ({time.monotonic() - t0:.0f}s)", flush=True)
    finally:
        result["stop"] = running.stop()
        if result.get("ray_session_dir"):  # warm-up included
            result["kv_scored_total"] = kv_scored_in_session(result["ray_session_dir"])
        print(f"[headtohead] {name}: stopped in {result['stop']['stop_s']:.0f}s (exit {result['stop']['exit_code']}"
              f"{', forced ' + str(result['stop']['forced']) if result['stop']['forced'] else ''}"
              f"{', ports busy ' + str(result['stop']['ports_busy']) if result['stop']['ports_busy'] else ''}"
              f"{', LEFT RUNNING ' + str(result['stop']['left_running']) if result['stop']['left_running'] else ''})",
              flush=True)
    return result


def _brief(row: dict) -> dict:
    keys = ("requests", "errors", "duration_s", "hit_rate", "ttft_p50_s", "output_tokens_per_s", "kv_scored", "note")
    return {k: (round(row[k], 4) if isinstance(row.get(k), float) else row.get(k)) for k in keys if k in row}


def tables(systems: list[dict], clients: list[str]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for client in clients:
        rows = []
        for r in systems:
            row = {"system": r["system"], "startup_s": r.get("startup_s"), **r.get("clients", {}).get(client, {})}
            if r.get("start_error"):
                row["note"] = f"did not start: {r['start_error']}"
            rows.append(row)
        out[client] = rows
    return out


# ---- command -----------------------------------------------------------------------------------
def add_parser(sub) -> None:
    p = sub.add_parser("headtohead", help="the same replicas under prefixgate and Ray Serve LLM, the same clients",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS), help=f"comma-separated rows, in order ({', '.join(SYSTEMS)})")
    p.add_argument("--clients", default=",".join(CLIENTS), help="bench, chat or bench,chat")
    p.add_argument("--quick", action="store_true", help="smoke run: 32 bench prompts (4 prefixes), a short chat")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--pool-tokens", type=int, default=6144, help="K/V pool per replica in tokens (192 blocks of 32)")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="every row's engine step budget (default: each system's own: prefixgate 512, vLLM 2048 on CPU)")
    p.add_argument("--model", default=None, help="model directory (default: the bundled converted SmolLM2-135M-Instruct)")
    p.add_argument("--model-name", default=MODEL_NAME, help="served model name on every row")
    p.add_argument("--ingress", choices=INGRESSES, default=DEFAULT_INGRESS,
                   help="the prefixgate rows' HTTP front (gateway/ingress.py; ray-llm-kv runs behind HAProxy)")
    p.add_argument("--audit", action="store_true",
                   help="record the prefixgate rows' live routing audit (--audit-dir) and print each client's "
                        "lost prompt tokens by cause (loadtest/live_audit.py, docs/routing-audit.md)")
    g = p.add_argument_group("bench (vllm bench serve, prefix_repetition)")
    g.add_argument("--prefix-len", type=int, default=512)
    g.add_argument("--suffix-len", type=int, default=64)
    g.add_argument("--num-prefixes", type=int, default=None, help="default 16 (4 with --quick)")
    g.add_argument("--output-len", type=int, default=16)
    g.add_argument("--num-prompts", type=int, default=None, help="default 128 (32 with --quick)")
    g.add_argument("--max-concurrency", type=int, default=8)
    g.add_argument("--seed", type=int, default=0)
    p.add_argument("--chat-set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a field of the chat load (loadtest/locust_run.py LoadSpec), e.g. users=4 (repeatable)")
    p.add_argument("--vllm-python", default=default_vllm_python(), help="the vLLM venv's interpreter")
    p.add_argument("--prefixgate", default=default_prefixgate(), help="the prefixgate command")
    p.add_argument("--start-timeout", type=float, default=900.0)
    p.add_argument("--client-timeout", type=float, default=3600.0)
    p.add_argument("--metrics-quiet-s", type=float, default=15.0,
                   help="counters count as settled once unchanged this long (Ray exports every ~10 s)")
    p.add_argument("--metrics-timeout-s", type=float, default=90.0)
    p.add_argument("--out", default=None, help=f"output folder (default: {DEFAULT_OUT}/headtohead-<time>)")
    p.set_defaults(fn=cmd_headtohead)


def settings_from_args(args: argparse.Namespace) -> Settings:
    bench = BenchSpec(prefix_len=args.prefix_len, suffix_len=args.suffix_len,
                      num_prefixes=args.num_prefixes or (4 if args.quick else 16), output_len=args.output_len,
                      num_prompts=args.num_prompts or (32 if args.quick else 128),
                      max_concurrency=args.max_concurrency, seed=args.seed)
    return Settings(replicas=args.replicas, pool_tokens=args.pool_tokens, max_model_len=args.max_model_len,
                    max_num_batched_tokens=args.max_num_batched_tokens, model_name=args.model_name, model=args.model or "", bench=bench,
                    chat=chat_overrides(chat_load(args.quick), args.chat_set))


def chat_overrides(load: dict, items: list[str]) -> dict:
    """KEY=VALUE pairs over the chat load, each cast to the LoadSpec field's type."""
    from dataclasses import fields

    from loadtest.locust_run import LoadSpec

    types = {f.name: type(f.default) for f in fields(LoadSpec)}
    out = dict(load)
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or key not in types:
            raise SystemExit(f"--chat-set takes KEY=VALUE with KEY a LoadSpec field, got {item!r}")
        kind = types[key]
        out[key] = value if kind in (str, type(None)) else kind(value)
    return out


def _interrupt(signum: int, _frame) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def cmd_headtohead(args: argparse.Namespace) -> int:
    systems = [x.strip() for x in args.systems.split(",") if x.strip()]
    clients = [x.strip() for x in args.clients.split(",") if x.strip()]
    bad = [x for x in systems if x not in SYSTEMS] + [x for x in clients if x not in CLIENTS]
    if bad or not systems or not clients:
        print(f"unknown or missing systems/clients: {bad}; systems: {', '.join(SYSTEMS)}; clients: bench, chat",
              file=sys.stderr)
        return 2
    s = settings_from_args(args)
    signal.signal(signal.SIGTERM, _interrupt)  # a SIGTERM still stops the running row (run_system's finally)
    if not s.model:
        from replica.default_model import default_model_dir

        s.model = str(default_model_dir())
    ceiling = prefix_ceiling(s.bench.prefix_len, s.bench.suffix_len, s.bench.num_prefixes, s.bench.num_prompts)
    out = Path(args.out) if args.out else DEFAULT_OUT / f"headtohead-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    print(f"[headtohead] {', '.join(systems)} x {', '.join(clients)}; output in {out}", flush=True)
    if "bench" in clients:
        print(f"[headtohead] bench ceiling: {s.bench.prefix_len}/{s.bench.prefix_len + s.bench.suffix_len} x "
              f"(1 - {s.bench.num_prefixes}/{s.bench.num_prompts}) = {ceiling:.1%}", flush=True)
    t0 = time.time()
    result = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "argv": sys.argv, "settings": asdict(s),
              "systems_run": systems, "clients": clients, "ceiling": ceiling, "systems": []}
    try:
        for name in systems:
            result["systems"].append(run_system(name, s, clients, out / name, args))
            result["tables"] = tables(result["systems"], clients)
            (out / "headtohead.json").write_text(json.dumps(result, indent=2))  # partial results survive a crash
    except KeyboardInterrupt as e:  # the running row was stopped on the way out (run_system's finally)
        result["interrupted"] = str(e) or "SIGINT"
        result["tables"] = tables(result["systems"], clients)
        (out / "headtohead.json").write_text(json.dumps(result, indent=2))
        print(f"[headtohead] interrupted ({result['interrupted']}); finished rows in {out / 'headtohead.json'}",
              file=sys.stderr, flush=True)
        return 130
    result["elapsed_s"] = time.time() - t0
    result["tables"] = tables(result["systems"], clients)
    (out / "headtohead.json").write_text(json.dumps(result, indent=2))
    md = report_markdown(result)
    (out / "headtohead.md").write_text(md + "\n")
    print()
    print(md)
    print(f"[headtohead] {out / 'headtohead.json'}, {out / 'headtohead.md'}; {result['elapsed_s']:.0f}s in all")
    ok = all(not r.get("start_error") and all(not c.get("note") for c in r["clients"].values()) for r in result["systems"])
    return 0 if ok else 1
