"""Engine benchmark: what the prefix cache saves, and throughput against transformers.

    prefixgate bench engine [--requests 16] [--new-tokens 64] [--skip-baselines] [--json out.json]
    prefixgate bench engine --against vllm [--dtype float32|bfloat16] [--rounds 3]
    prefixgate bench engine --thin [--thin-rows 16 64 256] [--against vllm]   # host time per step
    python -m loadtest.bench.engine_bench ...

Scenario 1 (prefix cache): a 100-token system prompt followed by 10 questions (190 tokens), sent
one at a time, with the prefix cache and without it. "Without" is the same warmed engine with
its cache emptied (`engine.blocks.clear_cache()`) before every request, so the only difference
is the cache, not model load or first-call overhead. Reports prefill tokens computed, requests
that hit, and time to first token.

Scenario 2 (throughput): N requests sharing a system prompt, all submitted at once, against
transformers' continuous batching (`model.generate_batch`, sdpa) and sequential
`model.generate`, in one process on the same weights, greedy, exactly --new-tokens each.

--thin replaces both: ms per step on a thin Qwen3 built on the spot, whose arithmetic is
negligible, so the figure is the engine's host time (loadtest/bench/host_time.py).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch
from transformers.utils import logging as hf_logging

# the workload's sizes, also read here (tests/test_bench.py)
from loadtest.bench.engine_workload import QUESTION_TOKENS as QUESTION_TOKENS
from loadtest.bench.engine_workload import SEED_QUESTION_LENGTHS as SEED_QUESTION_LENGTHS
from loadtest.bench.engine_workload import (
    SEED_SYSTEM_TOKENS,
    SeedResult,
    ThroughputResult,
    batch_prompts,
    exact_tokens,
    fmt_values,
    require_length,
    run_ours,
    scenario_seed,
)
from replica.engine import LLMEngine, SamplingParams
from replica.model.packed_linear import PackedLinear

say = functools.partial(print, flush=True)  # progress shows up in redirected logs


# ---- our engine (its workload and runs: loadtest/bench/engine_workload.py) ---------------------
def warm_up(engine: LLMEngine) -> None:
    """First calls pay one-off costs (allocator, kernels); keep them out of the figures."""
    engine.generate([list(range(3, 40))], SamplingParams(max_tokens=2, ignore_eos=True))
    engine.blocks.clear_cache()


# ---- transformers baselines -------------------------------------------------------------------
def load_reference(path: Path, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa").eval()


def hf_sequential(model, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]]]:
    """Plain `model.generate`, one request after another, greedy, never stopping at EOS."""
    outs = []
    t0 = time.perf_counter()
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                eos_token_id=None, pad_token_id=0,
            )
            outs.append(gen[0, len(p):].tolist())
    return time.perf_counter() - t0, outs


def hf_generate_batch(
    model, prompts: list[list[int]], new_tokens: int, page: int = 64
) -> tuple[float, float, list[list[int]]]:
    """transformers' continuous batching; returns (call seconds, in-flight seconds, tokens).

    eos_token_id=-1 disables stopping at EOS. The KV cache is sized for this workload: left to
    its default on CPU, transformers takes 90% of free RAM (GBs zeroed per call, seconds of
    setup). Pages of 64 tokens (default 256) let its own prefix sharing reuse 192 tokens of a
    200-token system prompt; it was its fastest setting here. The in-flight window (first
    request created to last finished) leaves out manager setup and its ~0.5 s shutdown wait,
    which is the figure comparable to ours.
    """
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    config = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
    pages = sum(-(-(len(p) + new_tokens) // page) for p in prompts)
    cb = ContinuousBatchingConfig(page_size=page, num_blocks=pages + 2, max_batch_tokens=512)
    t0 = time.perf_counter()
    with torch.inference_mode():
        results = model.generate_batch(
            inputs=prompts, generation_config=config, continuous_batching_config=cb, progress_bar=False
        )
    elapsed = time.perf_counter() - t0
    outs = list(results.values())
    window = max(o.lifespan[1] for o in outs) - min(o.created_time for o in outs)
    return elapsed, window, [o.generated_tokens for o in outs]


@torch.inference_mode()
def weights_step_s(engine: LLMEngine, rows: int, repeats: int = 9) -> float:
    """Median time of every linear layer of the model (nn.Linear or the oneDNN PackedLinear it
    becomes on CPU fp32, lm_head included) on `rows` random rows: what
    a decode step of that many sequences spends only reading and multiplying the weights, the
    floor no attention or scheduling work can get under (the weights are bandwidth bound at
    small batches, for transformers' generate_batch as for us)."""
    runner = engine.runner
    linears = [m for m in runner.model.modules() if isinstance(m, (torch.nn.Linear, PackedLinear))]
    assert linears, "no linear layers found"
    inputs = [torch.randn(rows, m.in_features, dtype=runner.dtype, device=runner.device) for m in linears]
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for m, x in zip(linears, inputs, strict=True):
            m(x)
        if runner.device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def scenario_throughput(engine: LLMEngine, args: argparse.Namespace) -> ThroughputResult:
    """Scenario 2: the same prompts through our engine and the two transformers paths."""
    prompts = batch_prompts(engine, args.requests, args.system_tokens)
    res, ours = run_ours(engine, prompts, args.new_tokens)
    res.weights_step_s = weights_step_s(engine, len(prompts))
    if args.skip_baselines and args.check == 0:
        return res
    model = load_reference(engine.model_path, engine.runner.dtype)
    run_baselines(model, prompts, ours, res, args, warmup=exact_tokens(engine, "warm up", 8))
    if args.rounds > 1 and not args.skip_baselines:
        more_rounds(engine, model, prompts, res, args)
    return res


def more_rounds(engine: LLMEngine, model, prompts: list[list[int]], res: ThroughputResult,
                args: argparse.Namespace) -> None:
    """Rounds 2..N of ours and generate_batch, interleaved, so machine load hits both alike; the
    reported figures become the medians (ratio: median of the per-round ratios)."""
    n = res.new_tokens
    ours_rounds = [(res.ours_s, res.ours_tok_s)]
    gb_rounds = [(res.generate_batch_s, res.generate_batch_tok_s)]
    calls = {res.generate_batch_s: res.generate_batch_call_s}
    for _ in range(args.rounds - 1):
        r, _tokens = run_ours(engine, prompts, n)
        ours_rounds.append((r.ours_s, r.ours_tok_s))
        call, gb_s, gb = hf_generate_batch(model, prompts, n, args.hf_page_size)
        require_length(gb, n, "generate_batch")
        gb_rounds.append((gb_s, len(prompts) * n / gb_s))
        calls[gb_s] = call
    res.ours_tok_s_rounds = [t for _, t in ours_rounds]
    res.generate_batch_tok_s_rounds = [t for _, t in gb_rounds]
    res.ratio_rounds = [a / b for a, b in zip(res.ours_tok_s_rounds, res.generate_batch_tok_s_rounds, strict=True)]
    res.ours_s, res.ours_tok_s = _median_round(ours_rounds)
    res.generate_batch_s, res.generate_batch_tok_s = _median_round(gb_rounds)
    res.generate_batch_call_s = calls[res.generate_batch_s]  # the same round's whole call


def _median_round(rounds: list[tuple[float, float]]) -> tuple[float, float]:
    """The (seconds, tok/s) of the median round (odd N) so seconds x tok/s stays the token count."""
    ordered = sorted(rounds, key=lambda r: r[1])
    return ordered[(len(ordered) - 1) // 2]


def run_baselines(
    model, prompts: list[list[int]], ours: list[list[int]], res: ThroughputResult,
    args: argparse.Namespace, warmup: list[int],
) -> None:
    """Sequential generate (timed, and the correctness reference), then generate_batch."""
    n, total = res.new_tokens, len(prompts) * res.new_tokens
    hf_sequential(model, [warmup], 2)
    checked = prompts[: args.check] if args.skip_baselines or args.skip_sequential else prompts
    seq_s, reference = hf_sequential(model, checked, n)
    require_length(reference, n, "model.generate")
    res.checked = len(checked)
    res.mismatched_ids = [i for i, r in enumerate(reference) if ours[i] != r]
    res.matched = res.checked - len(res.mismatched_ids)
    if args.skip_baselines:
        return
    if not args.skip_sequential:
        res.sequential_s, res.sequential_tok_s = seq_s, total / seq_s
    hf_generate_batch(model, [warmup], 2, args.hf_page_size)
    res.generate_batch_call_s, gb_s, gb = hf_generate_batch(model, prompts, n, args.hf_page_size)
    require_length(gb, n, "generate_batch")
    res.generate_batch_s, res.generate_batch_tok_s = gb_s, total / gb_s
    res.generate_batch_matched = sum(1 for a, b in zip(gb, reference, strict=False) if a == b)


# ---- report -----------------------------------------------------------------------------------
def print_seed(r: SeedResult, block_size: int) -> None:
    full_blocks = SEED_SYSTEM_TOKENS // block_size
    cacheable = full_blocks * block_size
    say(f"== Scenario 1: {SEED_SYSTEM_TOKENS}-token system prompt + {r.requests} questions "
        f"({r.prompt_tokens - r.requests * SEED_SYSTEM_TOKENS} tokens), one request at a time")
    say(f"  prefill tokens computed: without cache {r.computed_without_cache} / {r.prompt_tokens}, "
        f"with cache {r.computed_with_cache} / {r.prompt_tokens} ({r.saved_fraction:.1%} saved)")
    say(f"  requests that hit the cache: {r.hits}/{r.requests}; cached tokens per request "
        f"{r.cached_per_request}")
    say(f"  (blocks of {block_size}: the system prompt fills {full_blocks} full blocks = {cacheable} "
        f"cacheable tokens, so expect {r.prompt_tokens} - {r.requests - 1} x {cacheable} = "
        f"{r.prompt_tokens - (r.requests - 1) * cacheable})")
    say(f"  time to first token: no cache median {r.ttft_no_cache_median_ms:.1f} ms, "
        f"cold first request {r.ttft_cold_first_ms:.1f} ms, warm median {r.ttft_warm_median_ms:.1f} ms "
        f"(x{r.ttft_no_cache_median_ms / r.ttft_warm_median_ms:.2f} faster)")
    say(f"  greedy outputs with and without cache identical: {r.outputs_equal}")


def _row(label: str, tok_s: float, detail: str) -> None:
    say(f"  {label:<46} {tok_s:7.1f} output tok/s  ({detail})")


def print_throughput(r: ThroughputResult, args: argparse.Namespace) -> None:
    say(f"== Scenario 2: {r.requests} requests, {args.system_tokens}-token shared system prompt "
        f"({r.prompt_tokens} prompt tokens), {r.new_tokens} new tokens each, greedy")
    _row("ours (continuous batching + prefix cache)", r.ours_tok_s,
         f"{r.ours_s:.1f} s, {r.ours_steps} steps, {r.ours_cached_tokens} prompt tokens from cache")
    if r.generate_batch_tok_s is not None:
        _row(f"transformers generate_batch (sdpa, page {args.hf_page_size})", r.generate_batch_tok_s,
             f"{r.generate_batch_s:.1f} s in flight, {r.generate_batch_call_s:.1f} s whole call")
        if r.sequential_tok_s is not None:
            _row("transformers model.generate, one at a time", r.sequential_tok_s, f"{r.sequential_s:.1f} s")
        say(f"  ratio ours / generate_batch: x{r.ratio_generate_batch:.2f}" + (
            f"   ours / sequential: x{r.ratio_sequential:.2f}" if r.sequential_tok_s is not None else ""))
        if r.ratio_rounds:
            say(f"  {len(r.ratio_rounds)} interleaved rounds: ours {fmt_values(r.ours_tok_s_rounds)} tok/s, generate_batch "
                f"{fmt_values(r.generate_batch_tok_s_rounds)} tok/s, ratios {fmt_values(r.ratio_rounds, 2)} (median shown above)")
    if r.weights_floor_s is not None:
        best = r.requests * r.new_tokens / r.weights_floor_s
        say(f"  weights floor: every linear layer once at {r.requests} rows takes {r.weights_step_s * 1e3:.1f} ms; "
            f"x {r.ours_steps} steps = {r.weights_floor_s:.1f} s ({r.weights_floor_s / r.ours_s:.0%} of ours): "
            f"at most {best:.0f} tok/s" + (f", x{r.generate_batch_s / r.weights_floor_s:.2f} generate_batch"
                                          if r.generate_batch_s else ""))
    say(f"  ours is {r.ours_tok_s / args.cpu_limit:.0%} of this CPU's limit (~{args.cpu_limit:.0f} tok/s for "
        f"SmolLM2-135M fp32, ENVIRONMENT.md)")
    if r.checked:
        verdict = "matched" if not r.mismatched_ids else f"MISMATCH on requests {r.mismatched_ids}"
        say(f"  correctness: our greedy tokens vs model.generate on {r.checked} requests: "
            f"{r.matched}/{r.checked} {verdict}")
    if r.generate_batch_matched is not None:
        say(f"  (generate_batch vs model.generate: {r.generate_batch_matched}/{r.checked} identical)")


def to_json(seed: SeedResult, tp: ThroughputResult, args: argparse.Namespace, engine: LLMEngine) -> dict:
    return {
        "model": str(engine.model_path),
        "threads": args.threads,
        "torch": torch.__version__,
        "compile": asdict(engine.runner.compile_stats) if engine.runner.compile_stats else None,
        "seed_scenario": {**asdict(seed), "saved_fraction": seed.saved_fraction},
        "throughput": {
            **asdict(tp),
            "ratio_generate_batch": tp.ratio_generate_batch,
            "ratio_sequential": tp.ratio_sequential,
            "weights_floor_s": tp.weights_floor_s,
        },
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="prefixgate bench engine", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF model directory (default: bundled SmolLM2-135M-Instruct)")
    p.add_argument("--requests", type=int, default=16, help="scenario 2 batch size")
    p.add_argument("--new-tokens", type=int, default=64, help="scenario 2 tokens per request")
    p.add_argument("--system-tokens", type=int, default=200, help="scenario 2 shared system prompt length")
    p.add_argument("--seed-new-tokens", type=int, default=8, help="scenario 1 tokens per request")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    p.add_argument("--skip-baselines", action="store_true",
                   help="skip generate_batch and timed sequential generate (still checks --check requests)")
    p.add_argument("--check", type=int, default=2,
                   help="with --skip-baselines: requests to compare with model.generate (0: none)")
    p.add_argument("--hf-page-size", type=int, default=64,
                   help="generate_batch cache page size (transformers' default is 256)")
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    p.add_argument("--skip-sequential", action="store_true",
                   help="skip the timed sequential baseline (still checks --check requests against it)")
    p.add_argument("--rounds", type=int, default=None,
                   help="scenario 2: rounds of ours and generate_batch, interleaved; report medians "
                        "(default 1; --thin: 3)")
    p.add_argument("--cpu-limit", type=float, default=400.0,
                   help="output tok/s this CPU allows at most (ENVIRONMENT.md), for the share printed")
    p.add_argument("--against", choices=["vllm"], default=None,
                   help="also run vLLM's CPU engine (its venv .venv-vllm) on the same prompts, rounds interleaved "
                        "(loadtest/bench/vllm_bench.py)")
    p.add_argument("--compile", action="store_true",
                   help="our engine with EngineConfig(compile=True): the forward compiled at start (replica/model/compiled_step.py)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                   help="our engine's dtype, and vLLM's with --against (default: float32 on CPU)")
    p.add_argument("--vllm-python", default=None, help="--against vllm: its interpreter (default .venv-vllm/bin/python)")
    p.add_argument("--vllm-eager", action="store_true",
                   help="--against vllm: enforce_eager (no torch.compile: start-up in seconds, not ~70 s; slower steps)")
    p.add_argument("--vllm-block-size", type=int, default=32, help="--against vllm: its block size (multiple of 32)")
    p.add_argument("--decode-memory", action="store_true",
                   help="only measure decode-step peak memory: short rows next to a long one (loadtest/bench/engine_memory.py)")
    p.add_argument("--short-len", type=int, default=32, help="--decode-memory: short context length")
    p.add_argument("--long-len", type=int, default=1024, help="--decode-memory: long context length")
    p.add_argument("--num-short", type=int, default=32, help="--decode-memory: short sequences")
    p.add_argument("--thin", action="store_true",
                   help="only measure host time per step: a thin Qwen3 (28 layers, hidden 64) built in a temp "
                        "directory, random prompts, temperature 0.6 (loadtest/bench/host_time.py)")
    p.add_argument("--thin-rows", type=int, nargs="+", default=[16, 64, 256], help="--thin: row counts (batch sizes)")
    p.add_argument("--thin-prompt-tokens", type=int, default=32, help="--thin: tokens per random prompt")
    args = p.parse_args(argv)
    if args.rounds is None:
        args.rounds = 3 if args.thin else 1
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        return _run(args)
    finally:  # called in-process (the tests): leave the caller's thread count as it was
        torch.set_num_threads(threads)


def _run(args: argparse.Namespace) -> int:
    hf_logging.disable_progress_bar()  # weight-loading bars would interleave with the report
    if args.decode_memory:
        from loadtest.bench import engine_memory as bench_memory

        results = bench_memory.run(args.model, args.short_len, args.long_len, args.num_short)
        bench_memory.report(results, say)
        if args.json:
            args.json.write_text(json.dumps([asdict(r) for r in results], indent=2) + "\n")
        return 0
    vllm_python = None
    if args.against:  # its only choice: vLLM
        from loadtest.bench import vllm_bench as bench_vllm

        vllm_python = bench_vllm.interpreter(args.vllm_python)
        if vllm_python is None:
            print(bench_vllm.missing_message(args.vllm_python), file=sys.stderr, flush=True)
            return bench_vllm.MISSING_EXIT
    if args.thin:
        from loadtest.bench import host_time

        result = host_time.run(args, vllm_python, say)
        host_time.report(result, say)
        if args.json:
            args.json.write_text(json.dumps(result.to_json(), indent=2) + "\n")
        return 0
    t0 = time.perf_counter()
    engine = LLMEngine(model=args.model, dtype=args.dtype, compile=args.compile)
    say(f"model {engine.model_path.name} loaded in {time.perf_counter() - t0:.1f} s; "
          f"torch {torch.__version__}, {args.threads} threads, block size {engine.config.block_size}")
    if (c := engine.runner.compile_stats) is not None:
        say(f"compiled forward: {c.seconds:.1f} s of that start-up ({c.graphs} graph, FX graph cache "
            f"{c.fx_cache_hits} hit / {c.fx_cache_misses} miss, {c.cache_dir})")
    warm_up(engine)
    seed = scenario_seed(engine, args.seed_new_tokens)
    print_seed(seed, engine.config.block_size)
    tp = scenario_throughput(engine, args)
    print_throughput(tp, args)
    figures = to_json(seed, tp, args, engine)
    if vllm_python is not None:
        from loadtest.bench import vllm_bench as bench_vllm

        versus = bench_vllm.compare(engine, args, vllm_python, say)
        bench_vllm.report(versus, say)
        figures["against_vllm"] = bench_vllm.to_json(versus)
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    return 0 if seed.outputs_equal and not tp.mismatched_ids else 1


if __name__ == "__main__":
    sys.exit(main())
