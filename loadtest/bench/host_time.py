"""`prefixgate bench engine --thin`: the engine's host time per step, on a model whose arithmetic
is negligible.

    prefixgate bench engine --thin [--thin-rows 16 64 256] [--rounds 3] [--new-tokens 64] [--against vllm]

The model is built here, into a temp directory: a thin Qwen3 with Qwen3-0.6B's depth (28 layers)
and almost no width (hidden 64, intermediate 128, 2 attention heads of head_dim 64, 1 K/V head,
vocabulary 2,048, tied embeddings), random fp32 weights from a fixed seed, no tokenizer. Every
row count gets its own random token-id prompts (32 tokens by default, all in one prefill step);
each request decodes exactly --new-tokens tokens (temperature 0.6, EOS ignored). A step costs
almost no FLOPs, so ms per step (the generate's wall time / new tokens) is what the engine spends
around the model: scheduling, preparing inputs, launching 28 layers of small ops, sampling,
outputs. With `--against vllm` vLLM's offline CPU engine (compiled unless --vllm-eager) runs the
same prompts in its venv; per round and row count the two alternate who goes first, and the
report gives each engine's median over the rounds and the ratio ours / vLLM (> 1: ours slower).
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from loadtest.bench import engine_workload as workload
from replica.engine import LLMEngine, SamplingParams

# Qwen3-0.6B's depth and head layout, everything else as small as it goes
THIN_CONFIG: dict[str, Any] = {
    "num_hidden_layers": 28, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 2,
    "num_key_value_heads": 1, "head_dim": 64, "vocab_size": 2048, "tie_word_embeddings": True,
    "max_position_embeddings": 1024, "bos_token_id": 0, "eos_token_id": 1,
}
FIRST_PROMPT_ID = 2  # prompts avoid the BOS/EOS ids
TEMPERATURE = 0.6
WARMUP_TOKENS = 4  # each row count once on other prompts, before round 1
SEED = 0


def build_thin_model(directory: Path, seed: int = SEED) -> Path:
    """The thin Qwen3, random fp32 weights from `seed`, saved with save_pretrained (no tokenizer)."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(Qwen3Config(**THIN_CONFIG), dtype=torch.float32)
    model.save_pretrained(directory)
    return directory


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo; platform's guess elsewhere) and the CPUs this process sees."""
    name = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{name or platform.processor() or platform.machine()} ({cpus} CPUs)"


def random_prompts(rows: int, tokens: int, salt: int = 0) -> list[list[int]]:
    """`rows` distinct random prompts, the same for both engines (seeded by rows and salt)."""
    rng = random.Random(f"{SEED}-{rows}-{tokens}-{salt}")
    top = THIN_CONFIG["vocab_size"] - 1
    return [[rng.randint(FIRST_PROMPT_ID, top) for _ in range(tokens)] for _ in range(rows)]


# ---- the figures ----------------------------------------------------------------------------------
@dataclass
class RowFigures:
    """One row count: each engine's ms per step in every round (wall time / new tokens)."""

    rows: int
    ours_ms: list[float] = field(default_factory=list)
    vllm_ms: list[float] = field(default_factory=list)
    ours_steps: list[int] = field(default_factory=list)  # engine steps per generate (prefill + decodes)

    @property
    def ours_median(self) -> float:
        return statistics.median(self.ours_ms)

    @property
    def vllm_median(self) -> float | None:
        return statistics.median(self.vllm_ms) if self.vllm_ms else None

    @property
    def ratio(self) -> float | None:
        """ours / vLLM ms per step, median over median (> 1: ours spends longer per step)."""
        v = self.vllm_median
        return self.ours_median / v if v else None


@dataclass
class HostTime:
    cpu: str
    threads: int
    dtype: str
    prompt_tokens: int
    new_tokens: int
    rounds: int
    ours_compiled: bool
    vllm_compiled: bool | None  # None: ours only
    rows: list[RowFigures]
    order: list[str] = field(default_factory=list)  # who ran first in each round
    ours_load_s: float = 0.0
    vllm_ready_s: float | None = None
    vllm_log: str = ""
    load: list[float] = field(default_factory=list)  # 1-minute load average before and after: the machine's other work
    omp_wait_policy: str | None = None  # OMP_WAIT_POLICY as set for both engines, if it was

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "model": THIN_CONFIG, "medians": [
            {"rows": r.rows, "ours_ms_per_step": r.ours_median, "vllm_ms_per_step": r.vllm_median, "ratio": r.ratio}
            for r in self.rows]}


# ---- the runs -------------------------------------------------------------------------------------
def params(new_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=TEMPERATURE, max_tokens=new_tokens, ignore_eos=True)


def run_ours(engine: LLMEngine, prompts: list[list[int]], new_tokens: int) -> tuple[float, int]:
    """One generate of all prompts from an empty cache; (ms per step, engine steps)."""
    engine.blocks.clear_cache()
    before = engine.stats().steps
    elapsed, outs = workload.run_batch(engine, prompts, params(new_tokens))
    workload.require_length([o.token_ids for o in outs], new_tokens, "our engine")
    return elapsed * 1e3 / new_tokens, engine.stats().steps - before


def run_vllm(worker, prompts: list[list[int]], new_tokens: int) -> float:
    got = worker.call({"op": "batch", "prompts": prompts, "max_tokens": new_tokens, "temperature": TEMPERATURE})
    workload.require_length(got["token_ids"], new_tokens, "vLLM")
    return got["elapsed_s"] * 1e3 / new_tokens


def thin_engine(model: Path, args: argparse.Namespace) -> LLMEngine:
    """Ours, sized so the largest row count's prompts are one prefill step, as vLLM's below."""
    most = max(args.thin_rows)
    return LLMEngine(model=str(model), dtype=args.dtype, compile=args.compile, max_num_seqs=most,
                     max_num_batched_tokens=most * args.thin_prompt_tokens)


def vllm_job(model: Path, args: argparse.Namespace) -> dict[str, Any]:
    most = max(args.thin_rows)
    return {
        "model": str(model), "dtype": args.dtype or "float32", "threads": args.threads,
        "block_size": args.vllm_block_size, "enforce_eager": args.vllm_eager,
        "max_model_len": THIN_CONFIG["max_position_embeddings"], "skip_tokenizer_init": True, "kvcache_gib": 1,
        "max_num_seqs": most, "max_num_batched_tokens": max(most * args.thin_prompt_tokens, 2048),
    }


def run(args: argparse.Namespace, vllm_python: Path | None, say: Callable[..., None]) -> HostTime:
    with tempfile.TemporaryDirectory(prefix="thin-qwen3-") as tmp:
        model = build_thin_model(Path(tmp))
        t0 = time.perf_counter()
        engine = thin_engine(model, args)
        load_s = time.perf_counter() - t0
        say(f"thin Qwen3 built in {model}; our engine loaded in {load_s:.1f} s"
            + (" (forward compiled)" if engine.runner.compile_stats else ""))
        if vllm_python is None:
            return _rounds(engine, None, args, say, load_s)
        from loadtest.bench.vllm_bench import VllmWorker

        say(f"starting vLLM's CPU engine in {vllm_python} ({'eager' if args.vllm_eager else 'torch.compile'}) ...")
        with VllmWorker(vllm_python, vllm_job(model, args)) as worker:
            say(f"  vLLM ready in {worker.ready_s:.1f} s (LLM() {worker.startup_s:.1f} s)")
            result = _rounds(engine, worker, args, say, load_s)
            result.vllm_ready_s, result.vllm_log = worker.ready_s, str(worker.log)
            return result


def _rounds(engine: LLMEngine, worker, args: argparse.Namespace, say: Callable[..., None], load_s: float) -> HostTime:
    n, length = args.new_tokens, args.thin_prompt_tokens
    load = [os.getloadavg()[0]]
    for rows in args.thin_rows:  # one-off costs (allocator, kernels, vLLM's shapes) out of the figures
        warm = random_prompts(rows, length, salt=-1)
        run_ours(engine, warm, WARMUP_TOKENS)
        if worker is not None:
            run_vllm(worker, warm, WARMUP_TOKENS)
    figures = [RowFigures(rows) for rows in args.thin_rows]
    order = []
    for i in range(args.rounds):
        ours_first = i % 2 == 0
        order.append("ours,vllm" if ours_first else "vllm,ours")
        for fig in figures:
            prompts = random_prompts(fig.rows, length, salt=i)
            for who in ("ours", "vllm") if ours_first else ("vllm", "ours"):
                if who == "ours":
                    ms, steps = run_ours(engine, prompts, n)
                    fig.ours_ms.append(ms)
                    fig.ours_steps.append(steps)
                elif worker is not None:
                    fig.vllm_ms.append(run_vllm(worker, prompts, n))
            theirs = f", vLLM {fig.vllm_ms[-1]:.1f}" if fig.vllm_ms else ""
            say(f"  round {i + 1}/{args.rounds}, {fig.rows} rows: ours {fig.ours_ms[-1]:.1f} ms/step{theirs}")
    return HostTime(
        cpu=cpu_name(), threads=args.threads, dtype=str(engine.runner.dtype).removeprefix("torch."),
        prompt_tokens=length, new_tokens=n, rounds=args.rounds, ours_compiled=engine.runner.compile_stats is not None,
        vllm_compiled=None if worker is None else not args.vllm_eager, rows=figures,
        order=order if worker is not None else [], ours_load_s=load_s, load=[*load, os.getloadavg()[0]],
        omp_wait_policy=os.environ.get("OMP_WAIT_POLICY"),
    )


# ---- report -------------------------------------------------------------------------------------
def report(h: HostTime, say: Callable[..., None]) -> None:
    c = THIN_CONFIG
    say(f"== Host time per step: thin Qwen3 ({c['num_hidden_layers']} layers, hidden {c['hidden_size']}, "
        f"intermediate {c['intermediate_size']}, {c['num_attention_heads']} heads x {c['head_dim']}, "
        f"{c['num_key_value_heads']} K/V head, vocabulary {c['vocab_size']}, random {h.dtype})")
    say(f"  CPU: {h.cpu}; {h.threads} threads; {h.prompt_tokens}-token random prompts, {h.new_tokens} new tokens, "
        f"temperature {TEMPERATURE}, EOS ignored; ms/step = generate wall time / {h.new_tokens}; "
        f"medians of {h.rounds} round(s)" + (f", interleaved ({' | '.join(h.order)})" if h.order else ""))
    say(f"  load average (1 min) {h.load[0]:.1f} before, {h.load[-1]:.1f} after: the machine's other work"
        + (f"; OMP_WAIT_POLICY={h.omp_wait_policy}" if h.omp_wait_policy else ""))
    ours = "ours (compiled)" if h.ours_compiled else "ours"
    theirs = None if h.vllm_compiled is None else ("vLLM (compiled)" if h.vllm_compiled else "vLLM (eager)")
    say(f"  {'rows':>5}  {ours + ' ms/step':>24}" + (f"  {theirs + ' ms/step':>24}  {'ours/vLLM':>9}" if theirs else ""))
    for r in h.rows:
        line = f"  {r.rows:>5}  {r.ours_median:>24.1f}"
        if r.vllm_median is not None:
            line += f"  {r.vllm_median:>24.1f}  {'x' + format(r.ratio, '.2f'):>9}"
        say(line)
    for r in h.rows:
        say(f"  {r.rows} rows, per round: ours {workload.fmt_values(r.ours_ms)} ms/step ({r.ours_steps[0]} engine steps)"
            + (f", vLLM {workload.fmt_values(r.vllm_ms)}" if r.vllm_ms else ""))
    if h.vllm_log:
        say(f"  vLLM ready in {h.vllm_ready_s:.1f} s; its log: {h.vllm_log}")
