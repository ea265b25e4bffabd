"""replica/kernels/triton_attention.py against the torch path on one random step: the same pool, block
tables and queries through both backends, the metadata built by the engine's own
StepInputs.prepare. Run by tests/test_triton_attention.py (interpreter) and loadtest/device/gpu_check.py.
"""

from __future__ import annotations

import os
import random
import sys
import types
from dataclasses import dataclass

import torch

from replica.core.scheduler import ScheduledChunk
from replica.core.sequence import Sequence
from replica.kernels import attention
from replica.kernels.attention_metadata import KVPool
from replica.model.step_inputs import StepInputs
from router.protocol.sampling import SamplingParams


def use_interpreter_on_cpu(device: str) -> None:
    """Without a GPU the kernels run under Triton's interpreter, which must be chosen before
    triton is first imported (triton.jit reads TRITON_INTERPRET at decoration): for a process
    of its own (gpu_check --smoke, the tests' subprocesses), never a shared test process."""
    if device.startswith("cuda"):
        return
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("triton was imported without TRITON_INTERPRET=1: its CPU interpreter is off")
    os.environ["TRITON_INTERPRET"] = "1"


@dataclass
class StepShape:
    """One step's attention work: decodes (context lengths) sharing a cached prefix of
    `shared_blocks` blocks (a cascade), decodes sharing nothing, and prefill chunks."""

    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    block_size: int = 4
    shared_blocks: int = 3
    shared_decodes: tuple[int, ...] = (13, 14, 17, 22)  # whole context lengths, prefix included
    decodes: tuple[int, ...] = (1, 5, 8, 9, 30)
    prefills: tuple[tuple[int, int], ...] = ((0, 19), (13, 5), (8, 1))  # (cached tokens, new tokens)
    seed: int = 0


def random_step(shape: StepShape, dtype: torch.dtype, device: str):
    """(module, query, key, value, meta) of a random step over scattered blocks of a random pool."""
    rng = random.Random(shape.seed)
    torch.manual_seed(shape.seed)
    bs = shape.block_size
    contexts = [*shape.shared_decodes, *shape.decodes, *(c + n for c, n in shape.prefills)]
    total = shape.shared_blocks + sum(-(-n // bs) for n in contexts) + 1
    free = iter(rng.sample(range(total), total))
    prefix = [next(free) for _ in range(shape.shared_blocks)]

    def chunk(n: int, start: int, shared: list[int]) -> ScheduledChunk:
        seq = Sequence(list(range(n)), SamplingParams(), hash_seed=0)
        seq.table.block_ids = shared + [next(free) for _ in range(-(-n // bs) - len(shared))]
        return ScheduledChunk(seq, start, n)

    chunks = [chunk(n, n - 1, prefix) for n in shape.shared_decodes]
    chunks += [chunk(n, n - 1, []) for n in shape.decodes]
    chunks += [chunk(c + n, c, []) for c, n in shape.prefills]
    pool = KVPool.allocate(1, total * bs, shape.kv_heads, shape.head_dim, dtype, device)
    pool.k.normal_()
    pool.v.normal_()
    inputs = StepInputs(pool, bs, torch.device(device), max_rows=len(chunks), max_tokens=sum(contexts),
                        max_blocks=total)  # the torch path's cascades and Triton's tables: no C kernel
    _, _, meta, _ = inputs.prepare(chunks)
    t = meta.slot_mapping.numel()
    query = torch.randn(1, t, shape.heads, shape.head_dim, device=device).to(dtype).transpose(1, 2)
    key = torch.randn(1, shape.kv_heads, t, shape.head_dim, device=device).to(dtype)
    value = torch.randn_like(key)
    return types.SimpleNamespace(layer_idx=0), query, key, value, meta


def both_backends(shape: StepShape, dtype: torch.dtype, device: str, tiles=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's attention output [T, H, D] from the torch path, then from the Triton kernels."""
    from replica.kernels import triton_attention

    module, query, key, value, meta = random_step(shape, dtype, device)
    attention.set_metadata(meta)
    try:
        expected = attention.paged_attention_forward(module, query, key, value, None)[0][0]
        got = triton_attention.forward(query[0], meta.pool.k[0], meta.pool.v[0], meta, None, tiles)
    finally:
        attention.set_metadata(None)
    return expected, got


def max_error(shape: StepShape, dtype: torch.dtype, device: str, tiles=None) -> float:
    expected, got = both_backends(shape, dtype, device, tiles)
    return (expected.double() - got.double()).abs().max().item()


def engine_tokens(
    path: str, backend: str, rounds: list[list[list[int]]], max_tokens: int, **engine_args
) -> list[list[list[int]]]:
    """Greedy tokens of each round of prompts through one engine whose attention is `backend`
    (later rounds hit the prefix cache the earlier ones filled)."""
    from replica.engine import LLMEngine

    previous = attention._backend
    attention.set_backend(backend)
    try:
        engine = LLMEngine(path, **engine_args)
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        return [[o.token_ids for o in engine.generate(prompts, params)] for prompts in rounds]
    finally:
        attention._backend = previous


# what gpu_check runs: a Qwen3-0.6B-shaped step on a GPU (contexts to 1,000, 700-token prefills)
QWEN3_STEP = StepShape(
    heads=16, kv_heads=8, head_dim=128, block_size=16, shared_blocks=12,
    shared_decodes=tuple(range(200, 456, 8)), decodes=(1, 17, 100, 513, 1000),
    prefills=((0, 700), (384, 300), (96, 2)),
)
TOLERANCES = {"float32": 1e-4, "bfloat16": 3e-2}  # bf16: both outputs are rounded to bf16


def kernel_check(device: str) -> list[dict]:
    """Triton against the torch path in fp32 and bf16: the Qwen3-0.6B step on CUDA, the tiny
    default step on CPU (interpreter; use_interpreter_on_cpu first)."""
    shape = QWEN3_STEP if device.startswith("cuda") else StepShape()
    results = []
    for dtype, tol in TOLERANCES.items():
        err = max_error(shape, getattr(torch, dtype), device)
        results.append({"dtype": dtype, "heads": shape.heads, "kv_heads": shape.kv_heads, "head_dim": shape.head_dim,
                        "max_error": err, "tolerance": tol, "ok": err <= tol})
    return results
