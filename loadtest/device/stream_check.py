"""The replica's half of the serving path on a real engine, where a GPU makes tokens fast.

`prefixgate bench serving` measures the whole path (HTTP, gateway, Ray, replica) with a sim
engine that costs nothing; a CUDA machine here has no Ray, so this measures what it can: N
concurrent streams through `request_chunks` exactly as a Serve replica runs them (the stream
batcher, the chunk structs), each chunk msgpack-encoded and decoded as the gateway reads it,
beside the same kind of requests read straight off the engine (one output per token, no
batching, no encoding). Their ratio is what the replica's path costs a fast engine; the
output tok/s against bench serving's gateway ceiling says whether the gateway would keep up.

    python -m loadtest.device.stream_check                # Qwen3-0.6B (random weights) on CUDA
    python -m loadtest.device.stream_check --smoke        # tiny model on CPU (run by the tests)

Each stream is one request: a prompt of random token ids (no two share a block), greedy,
end of sequence ignored, so every request produces exactly `--max-tokens` tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from loadtest.device.gpu_check import (
    qwen3_0_6b_config,
    refuse_without_cuda,
    save_random_model,
    tiny_qwen3_config,
)
from replica.backends.local_backend import ModelBackend
from replica.engine_config import EngineConfig
from replica.serve.metrics import ReplicaMetrics
from replica.serve.replica_settings import ReplicaSettings
from replica.serve.request_stream import request_chunks
from router.protocol.messages import (
    STREAM_INTERVAL_S,
    DeltaChunk,
    EndChunk,
    ErrorChunk,
    GenerateRequest,
    decode_chunk,
    encode_chunk,
)
from router.protocol.sampling import SamplingParams

ENGINE_ONLY = "engine"  # outputs read straight off the engine: the ceiling the path is held to


@dataclass
class StreamHost:
    """What `request_chunks` reads of a replica (replica/serve/request_stream.py StreamHost)."""

    backend: ModelBackend
    metrics: ReplicaMetrics
    settings: ReplicaSettings
    replica_id: str = "device-replica"
    draining: bool = False
    kv_pull: Any = None
    audit: Any = None


@dataclass
class StreamRun:
    path: str  # "engine" or "replica, interval N ms"
    streams: int
    output_tokens: int
    seconds: float
    output_tok_s: float
    events_per_request: float  # chunks carrying tokens (SSE events the gateway would write)
    ttft_p50_ms: float
    ttft_p99_ms: float
    cpu_s_per_1k_tokens: float  # this process, engine thread included
    ratio_to_engine: float | None = None


@dataclass
class Report:
    device: str
    torch: str
    max_tokens: int
    prompt_len: int
    runs: list[StreamRun] = field(default_factory=list)


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _request(rng: random.Random, vocab: int, args: argparse.Namespace) -> GenerateRequest:
    return GenerateRequest(prompt_token_ids=[rng.randrange(vocab) for _ in range(args.prompt_len)],
                           params=SamplingParams(max_tokens=args.max_tokens, ignore_eos=True))


async def _engine_stream(host: StreamHost, req: GenerateRequest, t0: float) -> tuple[int, int, float]:
    tokens = events = 0
    first = None
    async for out in host.backend.generate(req):
        if out.new_token_ids:
            first = first if first is not None else time.perf_counter() - t0
            tokens += len(out.new_token_ids)
            events += 1
    return tokens, events, first or 0.0


async def _replica_stream(host: StreamHost, req: GenerateRequest, t0: float) -> tuple[int, int, float]:
    tokens = events = 0
    first = None
    async with contextlib.aclosing(request_chunks(host, req, None)) as chunks:
        async for chunk in chunks:
            got = decode_chunk(encode_chunk(chunk))  # what crosses to the gateway and is read there
            if isinstance(got, ErrorChunk):
                raise RuntimeError(f"replica refused the request: {got.message}")
            if isinstance(got, DeltaChunk):
                first = first if first is not None else time.perf_counter() - t0
                tokens += len(got.token_ids)
                events += 1
            elif isinstance(got, EndChunk) and got.completion_tokens != tokens:
                raise RuntimeError(f"end says {got.completion_tokens} tokens, the deltas carried {tokens}")
    return tokens, events, first or 0.0


async def _run(host: StreamHost, path: str, streams: int, rng: random.Random, vocab: int,
               args: argparse.Namespace) -> StreamRun:
    requests = [_request(rng, vocab, args) for _ in range(streams)]
    one = _engine_stream if path == ENGINE_ONLY else _replica_stream
    cpu0, t0 = time.process_time(), time.perf_counter()
    results = await asyncio.gather(*(one(host, r, t0) for r in requests))
    seconds, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    tokens = sum(r[0] for r in results)
    if tokens != streams * args.max_tokens:
        raise RuntimeError(f"{path}: {tokens} tokens, expected {streams * args.max_tokens}")
    ttfts = [r[2] * 1000 for r in results]
    return StreamRun(path=path, streams=streams, output_tokens=tokens, seconds=seconds, output_tok_s=tokens / seconds,
                     events_per_request=statistics.mean(r[1] for r in results), ttft_p50_ms=_pct(ttfts, 0.5),
                     ttft_p99_ms=_pct(ttfts, 0.99), cpu_s_per_1k_tokens=cpu / tokens * 1000)


async def measure(model_path: str, args: argparse.Namespace) -> Report:
    config = EngineConfig(model=model_path, device=args.device, dtype=args.dtype,
                          kv_cache_bytes=int(args.kv_cache_gb * 2**30), max_num_seqs=max(args.streams),
                          max_num_batched_tokens=args.max_batched_tokens, max_model_len=args.max_model_len)
    backend = await ModelBackend.create(config, torch_threads=torch.get_num_threads())
    try:
        report = Report(device=torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
                        torch=torch.__version__, max_tokens=args.max_tokens, prompt_len=args.prompt_len)
        vocab = min(10000, backend.facts.vocab_size)
        rng = random.Random(0)
        paths = [(ENGINE_ONLY, 0.0)] + [(f"replica, interval {ms:g} ms", ms / 1000) for ms in args.interval_ms]
        warm = argparse.Namespace(**{**vars(args), "max_tokens": 4})
        for streams in args.streams:
            engine_rate = None
            for path, interval in paths:
                host = StreamHost(backend=backend, metrics=ReplicaMetrics("stream-check", backend.facts.max_model_len),
                                  settings=ReplicaSettings(stream_interval_s=interval))
                await _run(host, path, 2, rng, vocab, warm)  # warm-up: the shapes of a first step
                run = await _run(host, path, streams, rng, vocab, args)
                if path == ENGINE_ONLY:
                    engine_rate = run.output_tok_s
                else:
                    run.ratio_to_engine = run.output_tok_s / engine_rate
                report.runs.append(run)
                print(f"{streams:4d} streams, {run.path:24s}: {run.output_tok_s:8.0f} output tok/s"
                      + (f" ({run.ratio_to_engine:.2f}x the engine's)" if run.ratio_to_engine else "")
                      + f", {run.events_per_request:6.1f} events/request, TTFT p50 {run.ttft_p50_ms:7.1f} ms "
                      f"p99 {run.ttft_p99_ms:7.1f} ms, CPU {run.cpu_s_per_1k_tokens:.3f} s/1k tokens", flush=True)
        return report
    finally:
        backend.shutdown()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m loadtest.device.stream_check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny model on CPU: 2 and 4 streams of 12 tokens")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--streams", type=lambda s: [int(x) for x in s.split(",")], default=[16, 64, 128],
                   help="comma-separated concurrent stream counts")
    p.add_argument("--interval-ms", type=lambda s: [float(x) for x in s.split(",")],
                   default=[STREAM_INTERVAL_S * 1000, 0.0], help="the replica's stream intervals to measure")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=384)
    p.add_argument("--kv-cache-gb", type=float, default=20.0)
    p.add_argument("--max-batched-tokens", type=int, default=16384)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    if args.smoke:
        args.device, args.dtype, args.streams, args.prompt_len, args.max_tokens = "cpu", "float32", [2, 4], 24, 12
        args.kv_cache_gb, args.max_batched_tokens, args.max_model_len = 0.02, 256, 256
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if refuse_without_cuda(args.device):
        return 2
    with tempfile.TemporaryDirectory(prefix="prefixgate-stream-check-") as tmp:
        config = tiny_qwen3_config() if args.smoke else qwen3_0_6b_config()
        path = save_random_model(config, Path(tmp) / "qwen3", getattr(torch, args.dtype))
        report = asyncio.run(measure(path, args))
    if args.json:
        args.json.write_text(json.dumps(asdict(report), indent=2) + "\n")
    print("stream_check: ok", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
