"""What scripts/gpu_check.sh runs: the Triton paged-attention kernels against the torch path,
bf16 parity on the device, then a nano-vllm-style throughput benchmark on a randomly
initialised Qwen3-0.6B (throughput does not depend on weight values).

    python -m loadtest.device.gpu_check --device cuda            # the real check (256 seqs, 100-1024)
    python -m loadtest.device.gpu_check --attention triton       # parity and throughput on the Triton kernels
    python -m loadtest.device.gpu_check --smoke                  # tiny model on CPU, same code paths
                                                         # (kernels under Triton's interpreter)

The workload follows nano-vllm's bench.py: seed 0, prompts of uniform 100..1024 random token
ids in [0, 10000), outputs of uniform 100..1024 tokens, temperature 0.6, end of sequence
ignored; throughput = output tokens / wall seconds, after one warm-up request.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from loadtest.device import parity, triton_check
from replica.kernels import attention


def qwen3_0_6b_config():
    """Qwen3-0.6B's published shape."""
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
        rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=151643,
        eos_token_id=151645,
    )


def tiny_qwen3_config():
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, tie_word_embeddings=True,
    )


def save_random_model(config, path: Path, dtype: torch.dtype) -> str:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).to(dtype).save_pretrained(path)
    return str(path)


@dataclass
class ThroughputResult:
    device: str
    dtype: str
    num_seqs: int
    prompt_tokens: int
    output_tokens: int
    seconds: float
    output_tok_s: float
    total_tok_s: float  # prompt + output tokens per second
    steps: int
    preemptions: int
    compile_s: float | None = None  # --compile: the compiled forward's start-up (trace, compile or cache load)
    compiled_graphs: int | None = None  # one per thread count its steps run on (one on a GPU)
    threads: int = 0  # torch's intra-op threads (on CPU, small steps run on one: a graph of their own)


def throughput(path: str, args: argparse.Namespace) -> ThroughputResult:
    from replica.engine import LLMEngine, SamplingParams

    engine = LLMEngine(
        path, device=args.device, dtype=args.dtype, kv_cache_bytes=int(args.kv_cache_gb * 2**30),
        max_num_seqs=args.num_seqs, max_num_batched_tokens=args.max_batched_tokens, max_model_len=args.max_model_len,
        compile=args.compile,
    )
    rng = random.Random(0)
    vocab = min(10000, engine.vocab_size)
    prompts = [[rng.randint(0, vocab - 1) for _ in range(rng.randint(args.min_len, args.max_len))]
               for _ in range(args.num_seqs)]
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=rng.randint(args.min_len, args.max_len))
              for _ in range(args.num_seqs)]
    engine.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
    before = engine.stats()
    _sync(args.device)
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params)
    _sync(args.device)
    seconds = time.perf_counter() - t0
    after = engine.stats()
    produced = sum(len(o.token_ids) for o in outs)
    expected = sum(p.max_tokens for p in params)
    if produced != expected:
        raise RuntimeError(f"engine produced {produced} tokens, expected {expected}")
    prompt_tokens = sum(map(len, prompts))
    return ThroughputResult(
        device=args.device, dtype=args.dtype, num_seqs=args.num_seqs, prompt_tokens=prompt_tokens,
        output_tokens=produced, seconds=seconds, output_tok_s=produced / seconds,
        total_tok_s=(produced + prompt_tokens) / seconds, steps=after.steps - before.steps,
        preemptions=after.preemptions - before.preemptions,
        compile_s=engine.runner.compile_stats.seconds if engine.runner.compile_stats else None,
        compiled_graphs=engine.runner.compile_stats.graphs if engine.runner.compile_stats else None,
        threads=torch.get_num_threads(),
    )


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m loadtest.device.gpu_check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny model on CPU: 8 seqs of 10-60 tokens")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--num-seqs", type=int, default=256)
    p.add_argument("--min-len", type=int, default=100)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--kv-cache-gb", type=float, default=40.0)
    p.add_argument("--max-batched-tokens", type=int, default=16384)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--attention", choices=("torch", "triton"), default="torch",
                   help="the engine's attention for parity and throughput (attention.set_backend)")
    p.add_argument("--compile", action="store_true",
                   help="parity and throughput through the compiled forward (replica/model/compiled_step.py)")
    p.add_argument("--skip-kernel", action="store_true", help="skip Triton kernels against the torch path")
    p.add_argument("--skip-parity", action="store_true")
    p.add_argument("--skip-throughput", action="store_true")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    if args.smoke:
        args.device, args.num_seqs, args.min_len, args.max_len = "cpu", 8, 10, 60
        args.kv_cache_gb, args.max_batched_tokens, args.max_model_len = 0.05, 256, 256
    return args


def refuse_without_cuda(device: str) -> bool:
    """True (and says why) where a CUDA device is asked for and there is none."""
    if device.startswith("cuda") and not torch.cuda.is_available():
        print("no CUDA device here: run with --smoke for the CPU form", file=sys.stderr)
        return True
    return False


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if refuse_without_cuda(args.device):
        return 2
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    print(f"device {args.device} ({name}), torch {torch.__version__}, dtype {args.dtype}, "
          f"attention {args.attention}{', compiled forward' if args.compile else ''}", flush=True)
    report: dict = {"device": name, "torch": torch.__version__, "attention": args.attention, "compile": args.compile}
    ok = True
    if not args.skip_kernel or args.attention == "triton":
        triton_check.use_interpreter_on_cpu(args.device)  # this process's own triton import
    if not args.skip_kernel:
        report["kernel"] = triton_check.kernel_check(args.device)
        for r in report["kernel"]:
            print(f"triton kernels {r['dtype']:8s} ({r['heads']} heads, {r['kv_heads']} KV, d {r['head_dim']}): max "
                  f"|triton - torch| {r['max_error']:.2e} (tolerance {r['tolerance']:.0e}): "
                  f"{'ok' if r['ok'] else 'FAILED'}", flush=True)
            ok = ok and r["ok"]
    attention.set_backend(args.attention)
    with tempfile.TemporaryDirectory(prefix="prefixgate-gpu-check-") as tmp:
        if not args.skip_parity:
            results = []
            for family in parity.FAMILIES:
                path = parity.save_tiny(family, Path(tmp) / f"tiny-{family}")
                r = parity.check_family(family, path, device=args.device, dtype="bfloat16", compile=args.compile)
                results.append(r)
                print(f"parity bf16 {family:8s} exact {r.exact}/{r.prompts}, up to bf16 ties {r.agreed}/{r.prompts}: "
                      f"{'ok' if r.ok else 'FAILED'}", flush=True)
                ok = ok and r.ok
            report["parity"] = [asdict(r) for r in results]
        if not args.skip_throughput:
            config = tiny_qwen3_config() if args.smoke else qwen3_0_6b_config()
            path = save_random_model(config, Path(tmp) / "qwen3", getattr(torch, args.dtype))
            r = throughput(path, args)
            print(f"throughput {'tiny Qwen3' if args.smoke else 'Qwen3-0.6B (random weights)'}: {r.num_seqs} seqs, "
                  f"{r.prompt_tokens} prompt + {r.output_tokens} output tokens in {r.seconds:.1f} s, "
                  f"{r.steps} steps, {r.preemptions} preemptions: {r.output_tok_s:.0f} output tok/s "
                  f"({r.total_tok_s:.0f} tok/s with prompts)"
                  + (f"; compiled forward ready in {r.compile_s:.1f} s at start" if r.compile_s is not None else ""),
                  flush=True)
            report["throughput"] = asdict(r)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    print("gpu_check: " + ("ok" if ok else "FAILED"), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
