"""What a prefill/decode hand-over costs on vLLM replicas (docs/vllm.md), measured on the
backends themselves: a prefill and a decode VllmBackend in one process (two vLLM engine cores),
sharing one hand-over directory, as a 1 + 1 app's replicas do, without Ray, the router or the
gateway in the figures.

For each prompt length, fresh random prompts (nothing cached anywhere), greedy:

  computed     the decode engine computes the prompt itself: time to its first token
  prefill      the prefill engine's part (`prefill_for_handover`: the prompt, one token, and
               vLLM's connector writing every layer's K/V as safetensors files)
  loaded       the decode engine starts from those files (`do_remote_prefill`): time to its
               first token, the load included
  bytes        what the connector wrote (K/V of the saved tokens, float32)

and checks that the loaded run's tokens equal the computed run's on the same prompt (computed on
the prefill engine, whose own cache then holds it).

    .venv-vllm/bin/python -m loadtest.bench.vllm_handover [--lengths 256 512 1024 2000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import tempfile
import time

from replica.backends.vllm_settings import VllmSettings
from replica.backends.vllm_spec import handover_connector
from replica.engine_config import EngineConfig
from replica.kv_io.handover import ConnectorKv, prefill_and_export, prefill_request
from router.protocol.messages import GenerateRequest
from router.protocol.sampling import SamplingParams


async def _first_token(backend, request: GenerateRequest, kv=None) -> tuple[float, list[int], int]:
    start = time.perf_counter()
    first = None
    async for out in backend.generate(request, kv):
        if first is None and out.new_token_ids:
            first = time.perf_counter() - start
        if out.finished:
            return first, out.token_ids, out.num_cached_tokens
    raise RuntimeError("no final output")


async def run(lengths: list[int], repeats: int, max_tokens: int) -> list[dict]:
    from replica.backends.vllm_backend import VllmBackend

    directory = tempfile.mkdtemp(prefix="prefixgate-pd-bench-")
    settings = VllmSettings(engine_args={"kv_transfer_config": handover_connector(directory)})
    config = EngineConfig(block_size=32, num_blocks=512, max_model_len=4096, max_num_batched_tokens=4096)
    prefill = await VllmBackend.create(config, settings, 1)
    decode = await VllmBackend.create(config, settings, 1)
    rng = random.Random(1)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    rows = []
    try:
        for n in lengths:
            computed, pre, loaded, nbytes, equal = [], [], [], [], 0
            for i in range(repeats + 1):  # the first round warms the shapes up: not counted
                a = [rng.randrange(200, 30000) for _ in range(n)]
                b = [rng.randrange(200, 30000) for _ in range(n)]
                t, _, _ = await _first_token(decode, GenerateRequest(prompt_token_ids=a, params=params,
                                                                     request_id=f"c{n}-{i}"))
                req = GenerateRequest(prompt_token_ids=b, params=params, request_id=f"h{n}-{i}")
                start = time.perf_counter()
                result = await prefill_and_export(prefill, None, prefill_request(req), 0)
                p = time.perf_counter() - start
                kv = ConnectorKv(result.kv_transfer_params)
                t_loaded, ids, cached = await _first_token(decode, req, kv)
                assert cached >= kv.tokens, (cached, kv.tokens)  # loaded, not computed
                _, ref, _ = await _first_token(prefill, GenerateRequest(prompt_token_ids=b, params=params,
                                                                        request_id=f"r{n}-{i}"))
                if i:
                    computed.append(t)
                    pre.append(p)
                    loaded.append(t_loaded)
                    nbytes.append(kv.params["bytes"])
                    equal += ids == ref
            rows.append({"prompt_tokens": n, "repeats": repeats,
                         "computed_ttft_ms": round(1000 * statistics.median(computed), 1),
                         "prefill_ms": round(1000 * statistics.median(pre), 1),
                         "loaded_ttft_ms": round(1000 * statistics.median(loaded), 1),
                         "handover_ttft_ms": round(1000 * (statistics.median(pre) + statistics.median(loaded)), 1),
                         "bytes": int(statistics.median(nbytes)), "greedy_equal": f"{equal}/{repeats}",
                         "files_left": len(os.listdir(directory))})
            print(json.dumps(rows[-1]), flush=True)
    finally:
        prefill.shutdown()
        decode.shutdown()
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[256, 512, 1024, 2000])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    rows = asyncio.run(run(args.lengths, args.repeats, args.max_tokens))
    print("| prompt tokens | computed TTFT ms | prefill + save ms | load TTFT ms | hand-over total ms | K/V bytes | greedy equal |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['prompt_tokens']} | {r['computed_ttft_ms']} | {r['prefill_ms']} | {r['loaded_ttft_ms']} | "
              f"{r['handover_ttft_ms']} | {r['bytes']:,} | {r['greedy_equal']} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":  # vLLM's engine core starts with spawn
    raise SystemExit(main())
