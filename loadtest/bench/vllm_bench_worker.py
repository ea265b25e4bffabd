"""vLLM's side of `prefixgate bench engine --against vllm`, run in the vLLM venv (`.venv-vllm`)
as a child process, so the main process never imports vLLM (it pins other transformers).

Protocol: JSON lines. The first line on stdin is the engine job (`model`, `dtype`, `threads`,
`block_size`, `enforce_eager`, optionally `max_num_seqs` and `max_num_batched_tokens`, ...); the worker builds `vllm.LLM`, answers
`{"ready": true, "startup_s": ...}`, then answers one line per command line:

- `{"op": "batch", "prompts": [[ids]], "max_tokens": n}`: prefix cache reset, all prompts in one
  `LLM.generate` (greedy unless `"temperature"` is given, EOS ignored);
  `{"elapsed_s", "output_tokens", "token_ids"}`.
- `{"op": "one_by_one", "prompts": ..., "max_tokens": n, "reset_each": bool}`: one request per
  `generate`, the cache reset once first (or before each); per request `ttft_s` from
  `RequestOutput.metrics.first_token_latency` (`ttft_source` says so) or, where vLLM gives no
  metrics, the wall time of a 1-token generate of the same prompt (`ttft_source` says that).
- `{"op": "quit"}`.

Protocol lines go to the original stdout; fd 1 is pointed at stderr before vLLM is imported,
because vLLM (and its engine-core child) log to stdout.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, TextIO

METRICS_TTFT = "RequestOutput.metrics.first_token_latency"
WALL_TTFT = "wall time of a 1-token generate"


def _protocol_stream() -> TextIO:
    """Keep the real stdout for our answers; everything else printed goes to stderr."""
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return proto


def _environment(job: dict[str, Any]) -> None:
    """Threads and the CPU pool, set before vLLM is imported (its engine core reads them)."""
    os.environ["OMP_NUM_THREADS"] = str(job["threads"])
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(job.get("kvcache_gib", 1)))


class Worker:
    """One `vllm.LLM` kept alive across commands, so rounds can interleave with ours."""

    def __init__(self, job: dict[str, Any]) -> None:
        from vllm import LLM

        t0 = time.perf_counter()
        self.llm = LLM(
            model=job["model"], dtype=job["dtype"], enforce_eager=job["enforce_eager"],
            block_size=job["block_size"], max_model_len=job["max_model_len"], gpu_memory_utilization=0.5,
            seed=0, enable_prefix_caching=True, disable_log_stats=False,  # metrics carry the TTFT
            skip_tokenizer_init=job.get("skip_tokenizer_init", False),
            **{k: job[k] for k in ("max_num_seqs", "max_num_batched_tokens") if k in job},
        )
        self.startup_s = time.perf_counter() - t0
        self.detokenize = not job.get("skip_tokenizer_init", False)

    def facts(self) -> dict[str, Any]:
        """Settings vLLM chose itself, for the report."""
        try:
            sched = self.llm.llm_engine.vllm_config.scheduler_config
            return {"max_num_seqs": sched.max_num_seqs, "max_num_batched_tokens": sched.max_num_batched_tokens}
        except AttributeError:
            return {}

    def _params(self, max_tokens: int, temperature: float = 0.0):
        """Exactly max_tokens (greedy by default); detokenized as a deployed vLLM would (ours detokenizes too)."""
        from vllm import SamplingParams

        return SamplingParams(max_tokens=max_tokens, temperature=temperature, ignore_eos=True,
                              detokenize=self.detokenize)

    def _generate(self, prompts: list[list[int]], max_tokens: int, temperature: float = 0.0):
        from vllm.inputs import TokensPrompt

        return self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                                 self._params(max_tokens, temperature), use_tqdm=False)

    def batch(self, prompts: list[list[int]], max_tokens: int, temperature: float = 0.0) -> dict[str, Any]:
        self.llm.reset_prefix_cache()
        t0 = time.perf_counter()
        outs = self._generate(prompts, max_tokens, temperature)
        elapsed = time.perf_counter() - t0
        ids = [list(o.outputs[0].token_ids) for o in outs]
        return {"elapsed_s": elapsed, "output_tokens": sum(map(len, ids)), "token_ids": ids,
                "cached_tokens": [o.num_cached_tokens or 0 for o in outs]}

    def one_by_one(self, prompts: list[list[int]], max_tokens: int, reset_each: bool) -> dict[str, Any]:
        self.llm.reset_prefix_cache()
        ttft, source, ids, cached = [], METRICS_TTFT, [], []
        for p in prompts:
            if reset_each:
                self.llm.reset_prefix_cache()
            [out] = self._generate([p], max_tokens)
            first = getattr(out.metrics, "first_token_latency", 0.0) if out.metrics is not None else 0.0
            if not first:  # no metrics from this build: time a 1-token request of the same prompt
                source = WALL_TTFT
                if reset_each:
                    self.llm.reset_prefix_cache()
                t0 = time.perf_counter()
                self._generate([p], 1)
                first = time.perf_counter() - t0
            ttft.append(first)
            ids.append(list(out.outputs[0].token_ids))
            cached.append(out.num_cached_tokens or 0)
        return {"ttft_s": ttft, "ttft_source": source, "token_ids": ids, "cached_tokens": cached}


def main() -> None:
    proto = _protocol_stream()
    job = json.loads(sys.stdin.readline())
    _environment(job)
    worker = Worker(job)
    print(json.dumps({"ready": True, "startup_s": worker.startup_s, "facts": worker.facts()}), file=proto)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            break
        if cmd["op"] == "batch":
            answer = worker.batch(cmd["prompts"], cmd["max_tokens"], cmd.get("temperature", 0.0))
        elif cmd["op"] == "one_by_one":
            answer = worker.one_by_one(cmd["prompts"], cmd["max_tokens"], cmd.get("reset_each", False))
        else:
            answer = {"error": f"unknown op {cmd['op']!r}"}
        print(json.dumps(answer), file=proto)


if __name__ == "__main__":  # vLLM's engine core starts with spawn
    main()
