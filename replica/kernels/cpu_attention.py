"""Decode attention on CPU as one C kernel call per layer (replica/kernels/cpu_attention.c).

The torch path gathers each decode group's blocks into new tensors (two copies per group per
layer) and runs a dozen small operations around them; at 16 rows that was a quarter of a
decode step. The kernel reads K/V in place through each row's whole block table, the blocks a
chunk of adjacent rows share (a cached prefix) once for the chunk, and does the softmax
online, in float32 for fp32 and bf16 pools, parallel over (KV head, chunk of rows) on torch's
OpenMP threads.

How many threads: waking a second OpenMP thread costs tens of microseconds (more under
OMP_WAIT_POLICY=PASSIVE or on a busy machine), more than tiny work takes on one. So a call gets
one thread, and one more per WORK_PER_THREAD multiply-adds of scores (context tokens x query
heads x head_dim), at most one per (KV head, chunk of rows) task and at most the
caller's thread count (torch's, or the ceiling a caller running on fewer threads set). Measured
(2-core EPYC, PASSIVE, us per call, 1 vs 2 threads): 16 rows x 96 tokens, 2 heads of 64 (0.2 M)
32 vs 48; 64 rows (0.8 M) 101 vs 113; 256 rows (3.1 M) 611 vs 298; 1 row x 300 tokens x 9 heads
(0.17 M) 26 vs 39; 16 rows (2.8 M) 300 vs 178; 1 row x 1,000 tokens x 16 heads of 128 (2 M) 206 vs
156. The count changes the split of work, never a row's
arithmetic: results are the same.

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
import threading
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
MAX_QUERIES = 32  # cpu_attention.c's MAX_QUERIES: (row, query head) pairs per task
WORK_PER_THREAD = 1 << 20  # multiply-adds from which a second thread pays (module docstring)
_ceiling = threading.local()  # .threads: the most threads a call may use, when not torch's count
_last = threading.local()  # .lens: (lengths tensor, their sum): a step's layers pass the same tensor


def set_thread_ceiling(threads: int | None) -> None:
    """The most threads this thread's calls may use (None: torch.get_num_threads()); for a caller
    that runs its other work on fewer threads than attention may use."""
    _ceiling.threads = threads


def threads_for(rows: int, heads: int, kv_heads: int, dim: int, tokens: int, most: int) -> int:
    """Threads for one call: one, plus one per WORK_PER_THREAD multiply-adds; at most one per
    task, at most `most`."""
    tasks = kv_heads * -(-rows // max(1, MAX_QUERIES // (heads // kv_heads)))
    return max(1, min(most, tasks, 1 + tokens * heads * dim // WORK_PER_THREAD))


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
    # kernel's threads are torch's pool (and each call is told how many of its threads to use: threads_for)
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
    most = getattr(_ceiling, "threads", None) or torch.get_num_threads()
    threads = threads_for(rows, heads, k_pool.shape[0], dim, _tokens(lens), most) if most > 1 else 1
    fn(_ptr(qf), ctypes.c_int64(qf.stride(0)), _ptr(k_pool), _ptr(v_pool), ctypes.c_int64(k_pool.stride(0)),
       _ptr(tables), _ptr(offsets), _ptr(lens), rows, heads, k_pool.shape[0], dim, block_size,
       _ptr(target), ctypes.c_int64(target.stride(0)), threads)
    if not direct:
        out.copy_(target)


def _tokens(lens: torch.Tensor) -> int:
    """Context tokens of all rows, summed once per step: every layer of a step passes the same
    lengths tensor (a new one each step). Only the thread count depends on it, never a result."""
    last = getattr(_last, "lens", None)
    if last is None or last[0] is not lens:
        last = _last.lens = (lens, int(lens.numpy().sum()))
    return last[1]


@cache
def _function(dtype: torch.dtype, dim: int):
    """The kernel's entry point for this pool dtype and head size (resolved once, not per layer)."""
    return getattr(library(), f"paged_decode_{_DTYPES[dtype]}_{dim if dim in _DIMS else 'any'}")


def _ptr(t: torch.Tensor) -> ctypes.c_void_p:
    return ctypes.c_void_p(t.data_ptr())
