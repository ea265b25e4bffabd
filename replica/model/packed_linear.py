"""CPU linear layers through oneDNN with weights packed once at load.

`F.linear` re-reads the weight in its plain layout every call; oneDNN's matmul over a weight
reordered once into its blocked layout is faster at the batch sizes a serving step has
(`scripts/bench_linear.py` measures both on the model's shapes, interleaved; docs/benchmarks.md):

- bf16 (AVX-512 bf16 / AMX): 1.3x to 1.4x per layer at 1 to 208 rows;
- fp32 on AVX-512: 1.37x at 16 rows, about 1.0x at 64 and above, but 0.61x at 1 row (MKL's
  single-row path is better): a lone stream decodes 0.84x as fast, 16 streams 1.07x faster;
- fp32 on AVX2 only: 1.2x to 1.9x at 1 to 64 rows (measured on an earlier machine).

So on x86 every fp32 model is packed, and every bf16 one where oneDNN has bf16 kernels: batches
are what a replica serves for. But not every layer: a oneDNN call costs ~10 us more than
F.linear's (MKL) whatever its size, so a layer is packed only if its weight has at least
PACK_MIN_WEIGHT elements (in x out). Measured per call (us, one thread, fp32, 2-core EPYC,
interleaved, F.linear vs packed): the thin benchmark model's 64 -> 256 at 16 rows 8.5 vs 19,
at 256 rows 87 vs 90; 128 -> 64 at 16 rows 5.4 vs 16.5; its lm_head 64 -> 2048 (131 k weights)
at 16 rows 60 vs 57, 64 rows 188 vs 172; the bundled model's smallest, 576 -> 576 (332 k), at
16 rows 139 vs 113, 64 rows 442 vs 394 (and 1 -> 3072 at 1 row 134 vs 110). So layers of
under 2^18 weights stay nn.Linear and every layer of a real model is packed as before.
The weights are the largest part of a decode step. Packed layers replace nn.Linear after
loading and the dense weight is dropped, so memory stays the same (except a tied lm_head, whose
embedding keeps its own copy).

torch.compile cannot trace an opaque oneDNN tensor, so a compiled graph calls the layer
through the custom op `prefixgate::packed_linear`, which finds it by its name in the model
among the layers activate() was last given: the graph holds names, not objects, so it is the
same for every instance of an architecture and inductor's cache serves them all.
"""

from __future__ import annotations

import platform
import threading

import torch
from torch import nn

PACK_MIN_WEIGHT = 1 << 18  # in x out below which F.linear is as fast or faster (module docstring)
_active = threading.local()  # .layers: what the calling thread's compiled forward resolves names to


def activate(layers: dict[str, PackedLinear]) -> None:
    """The layers a compiled graph's `prefixgate::packed_linear` calls resolve to (by name), for
    the calling thread: engines stepping on their own threads each resolve to their own model."""
    _active.layers = layers


def layers_of(model: nn.Module) -> dict[str, PackedLinear]:
    return {m.name: m for m in model.modules() if isinstance(m, PackedLinear)}


def packable(model: nn.Module) -> bool:
    """Whether packing pays for this model here (the measurements in the module docstring)."""
    p = next(model.parameters())
    if p.device.type != "cpu" or platform.machine().lower() not in {"x86_64", "amd64"}:
        return False  # measured on x86 only
    if not torch.backends.mkldnn.is_available():
        return False
    if p.dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return p.dtype == torch.float32


class PackedLinear(nn.Module):
    """y = x W^T + b with W held in oneDNN's packed layout (an nn.Linear's weight, reordered)."""

    def __init__(self, linear: nn.Linear, name: str) -> None:
        super().__init__()
        self.in_features, self.out_features, self.name = linear.in_features, linear.out_features, name
        with torch.no_grad():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach())
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return torch.ops.prefixgate.packed_linear(x, self.name, self.out_features)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


@torch.library.custom_op("prefixgate::packed_linear", mutates_args=())
def _packed_linear_op(x: torch.Tensor, name: str, out_features: int) -> torch.Tensor:
    layer = _active.layers[name]
    return torch.ops.mkldnn._linear_pointwise(x, layer.packed, layer.bias, "none", [], "")


@_packed_linear_op.register_fake
def _(x: torch.Tensor, name: str, out_features: int) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], out_features)


def pays(linear: nn.Linear) -> bool:
    """Whether packing this layer pays: its weight is large enough (PACK_MIN_WEIGHT)."""
    return linear.in_features * linear.out_features >= PACK_MIN_WEIGHT


def pack_linears(model: nn.Module) -> int:
    """Replace every nn.Linear in `model` for which packing pays by a PackedLinear; returns how many."""
    swaps = [(parent, f"{prefix}.{name}".lstrip("."), name, child) for prefix, parent in model.named_modules()
             for name, child in parent.named_children() if type(child) is nn.Linear and pays(child)]
    for parent, full_name, name, child in swaps:
        setattr(parent, name, PackedLinear(child, full_name))
    return len(swaps)
