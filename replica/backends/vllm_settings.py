"""Settings of a vLLM replica (replica/backends/vllm_backend.py), importable without vLLM: the gateway
validates them when it builds the app, the replica applies them."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

VLLM_BLOCK_MULTIPLE = 32  # vLLM's CPU attention backend takes block sizes that are multiples of 32
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the max_lora_rank values vLLM takes (its LoRAConfig)
VLLM_VENV = ".venv-vllm"  # beside the checkout: where scripts/bootstrap.sh installs vLLM (docs/vllm.md)


@dataclass
class VllmSettings:
    """vLLM-only knobs; the pool, block size, batch limits and model come from EngineConfig."""

    dtype: str = "float32"
    enforce_eager: bool = True  # skips torch.compile (about 70 s per start on 2 CPU cores)
    gpu_memory_utilization: float = 0.5  # on CPU: the share of RAM vLLM may reserve
    cpu_kvcache_gib: int = 1  # VLLM_CPU_KVCACHE_SPACE: the CPU pool's cap (num_blocks sets the pool exactly)
    seed: int = 0
    engine_args: dict[str, Any] = field(default_factory=dict)  # any other vLLM AsyncEngineArgs field


def vllm_python(configured: str | None = None) -> str:
    """The interpreter vLLM replicas run in: the configured one, else the checkout's vLLM venv,
    else this interpreter (a venv where vLLM installs beside prefixgate, e.g. on a GPU host)."""
    if configured:
        return configured
    venv = Path(__file__).resolve().parents[2] / VLLM_VENV / "bin" / "python"
    return str(venv) if venv.exists() else sys.executable
