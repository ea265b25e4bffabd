"""Decode attention on CPU as one C kernel call per layer (replica/kernels/cpu_attention.c).

The torch path gathers each decode group's blocks into new tensors (two copies per group per
layer) and runs a dozen small operations around them; at 16 rows that was a quarter of a
decode step. The kernel reads K/V in place through each row's whole block table, the blocks a
chunk of adjacent rows share (a cached prefix) once for the chunk, and does the softmax
online, in float32 for fp32 and bf16 pools, parallel over (KV head, chunk of rows) on torch's
OpenMP threads.

Built at first use with the system C compiler (`gcc`, else `cc`, or $CC) into the user's cache
(`$XDG_CACHE_HOME/prefixgate/kernels`), keyed by the source, the flags, the compiler and this
CPU's architecture and features (it is compiled for the machine it runs on), so later starts
only load it. Without a compiler, if building or loading fails, or for shapes it does not take
(see supports), attention.py keeps the torch path.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

import torch

log = logging.getLogger("prefixgate.replica.cpu_attention")

SOURCE = Path(__file__).with_name("cpu_attention.c")
# compiled with -ffast-math (vectorised expf, reassociated sums) but linked without it: linking a
# shared library with -ffast-math adds crtfastmath.o, whose constructor sets flush-to-zero for
# the thread that loads it, changing every float operation there
COMPILE_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-c"]
LINK_FLAGS = ["-shared", "-fopenmp"]
_DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16"}
_DIMS = (64, 128)  # head sizes with functions of their own; others take the generic one


def kernel_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "prefixgate" / "kernels"


def _cpu_identity() -> str:
    """What -march=native compiles for: the architecture and its feature lines (x86 `flags`,
    Arm `Features` / `CPU part`), so a shared cache never hands one CPU's build to another."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    keep = sorted({line for line in lines if line.split(":")[0].strip() in {"flags", "Features", "CPU part"}})
    return "\n".join([platform.machine(), *keep])


@cache
def library() -> ctypes.CDLL | None:
    """The compiled kernel, built on first use; None (the torch path) if it cannot be built or
    loaded here: no compiler, a failing build, an unwritable cache, a library that will not load."""
    try:
        return _build_and_load()
    except (OSError, RuntimeError, ValueError, subprocess.SubprocessError) as e:
        log.warning("CPU decode kernel unavailable, decode attention stays on the torch path: %s", e)
        return None


def _build_and_load() -> ctypes.CDLL | None:
    compiler = shlex.split(os.environ.get("CC", "")) or [c for c in (shutil.which("gcc") or shutil.which("cc"),) if c]
    if not compiler:
        log.warning("no C compiler: decode attention stays on the torch path")
        return None
    parts = [SOURCE.read_bytes(), " ".join(COMPILE_FLAGS + LINK_FLAGS), " ".join(compiler), _cpu_identity()]
    key = hashlib.sha256(b"\0".join(p if isinstance(p, bytes) else p.encode() for p in parts)).hexdigest()[:16]
    target = kernel_dir() / f"cpu_attention-{key}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            built = Path(tmp) / target.name
            obj = Path(tmp) / "cpu_attention.o"
            for argv in ([*compiler, *COMPILE_FLAGS, str(SOURCE), "-o", str(obj)],
                         [*compiler, *LINK_FLAGS, str(obj), "-o", str(built), "-lm"]):
                result = subprocess.run(argv, capture_output=True, text=True, timeout=300)
                if result.returncode != 0:
                    log.warning("building %s failed, decode attention stays on the torch path: %s",
                                SOURCE.name, result.stderr[-500:])
                    return None
            os.replace(built, target)  # atomic: concurrent replicas never load a half-written file
    # gcc's -fopenmp links libgomp.so.1, the soname torch's own libgomp already loaded has: the
    # kernel's threads are torch's pool (and it is told torch's thread count on every call)
    return ctypes.CDLL(str(target))


def supports(k_pool: torch.Tensor, heads: int, block_size: int) -> bool:
    """The kernel takes contiguous CPU pools of fp32 or bf16 within its fixed buffer sizes."""
    if k_pool.device.type != "cpu" or k_pool.dtype not in _DTYPES or not k_pool.is_contiguous():
        return False
    lib = library()
    if lib is None:
        return False
    kv_heads, _, dim = k_pool.shape
    return (heads % kv_heads == 0 and heads // kv_heads <= lib.max_queries() and dim <= lib.max_dim()
            and block_size <= lib.max_block())


def decode(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, tables: torch.Tensor, offsets: torch.Tensor,
           lens: torch.Tensor, block_size: int, scale: float, out: torch.Tensor) -> None:
    """out[r] = attention of query row r (q: [B, H, D]) over its lens[r] context tokens, whose
    blocks are tables[offsets[r]:offsets[r + 1]]; out: [B, H, D], written in place."""
    rows, heads, dim = q.shape
    for t in (tables, offsets, lens):
        if t.dtype != torch.int64 or not t.is_contiguous() or t.device.type != "cpu":
            raise ValueError("block tables, offsets and lengths must be contiguous int64 CPU tensors")
    qf = (q.float() * scale).contiguous()
    direct = out.dtype == torch.float32 and out.stride(2) == 1 and out.stride(1) == dim
    target = out if direct else torch.empty(rows, heads, dim, dtype=torch.float32)
    fn = _function(k_pool.dtype, dim)
    fn(_ptr(qf), ctypes.c_int64(qf.stride(0)), _ptr(k_pool), _ptr(v_pool), ctypes.c_int64(k_pool.stride(0)),
       _ptr(tables), _ptr(offsets), _ptr(lens), rows, heads, k_pool.shape[0], dim, block_size,
       _ptr(target), ctypes.c_int64(target.stride(0)), torch.get_num_threads())
    if not direct:
        out.copy_(target)


@cache
def _function(dtype: torch.dtype, dim: int):
    """The kernel's entry point for this pool dtype and head size (resolved once, not per layer)."""
    return getattr(library(), f"paged_decode_{_DTYPES[dtype]}_{dim if dim in _DIMS else 'any'}")


def _ptr(t: torch.Tensor) -> ctypes.c_void_p:
    return ctypes.c_void_p(t.data_ptr())
