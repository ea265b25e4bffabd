"""LoRA adapters in the model: PEFT adapters read with peft's own loaders, applied per row.

Every Linear of the decoder (attention and MLP projections, fused or not: replica/model/fused.py)
is wrapped once at start by a `LoraLinear` holding `max_loras` batch slots of zero-padded A and B
up to `max_lora_rank`. A step multiplies each row by its own slot's adapter in two products over
all slots at once (punica's shrink and expand): x A_all^T gives every slot's low-rank projection,
a 0/1 mask keeps only the columns of the row's slot, and the product with B_all (scaling folded
in) adds the row's delta. Rows of the base model and of several adapters share one forward pass;
a step without adapter rows skips the wrappers entirely.

Which adapter holds which slot is decided by the torch-free core (replica/core/adapter_slots.py);
`LoraModel.load_slot` copies an adapter's tensors into a slot when that changes.
"""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from replica.model.packed_linear import PackedLinear
from router.protocol.lora import AdapterError, AdapterRef, read_config, weights_file

# the unfused projections behind a fused module (replica/model/fused.py), in output order
FUSED_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
UNSUPPORTED_OPTIONS = {  # adapter_config.json fields whose non-default value our layers would ignore
    "use_dora": "DoRA", "modules_to_save": "modules_to_save", "lora_bias": "lora_bias",
    "layers_to_transform": None,  # fine: only which layers have tensors, which we read from the file
}

_active = threading.local()  # .rows: the running step's per-row slot mask builder (RowSlots) or None


@dataclass
class LoraWeights:
    """One adapter loaded into host memory: per (unfused) module name, A (r, in) and B (out, r)
    with the module's scaling, and what the adapter is."""

    name: str
    identity: str
    rank: int  # the largest rank of its modules
    modules: dict[str, tuple[torch.Tensor, torch.Tensor, float]]

    @property
    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b, _ in self.modules.values())


class RowSlots:
    """The slot of every row of one step (-1: the base model), and the 0/1 masks built from it,
    one per column layout (slices x rank), built once per step."""

    def __init__(self, slots: torch.Tensor, num_slots: int, active: set[int]) -> None:
        self.slots, self.num_slots = slots, num_slots
        self.active = active  # the slots some row uses
        self._masks: dict[int, torch.Tensor] = {}

    def mask(self, width: int, dtype: torch.dtype) -> torch.Tensor:
        """(rows, num_slots * width): 1 on the `width` columns of each row's slot."""
        m = self._masks.get(width)
        if m is None:
            onehot = (self.slots[:, None] == torch.arange(self.num_slots, device=self.slots.device)[None, :])
            m = self._masks[width] = onehot.to(dtype).repeat_interleave(width, dim=1)
        return m


class LoraLinear(nn.Module):
    """A projection plus a per-row low-rank delta from one of `num_slots` adapters."""

    def __init__(self, base: nn.Module, parts: tuple[str, ...], part_sizes: list[int], num_slots: int,
                 max_rank: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.base = base
        self.in_features, self.out_features = base.in_features, base.out_features
        self.parts, self.max_rank, self.num_slots = parts, max_rank, num_slots
        self.offsets = [sum(part_sizes[:i]) for i in range(len(part_sizes))]
        self.part_sizes = part_sizes
        width = len(parts) * max_rank  # one rank-wide band of A's rows per part
        self.a = torch.zeros(num_slots * width, self.in_features, dtype=dtype, device=device)
        self.b = torch.zeros(num_slots * width, self.out_features, dtype=dtype, device=device)
        self.width = width
        self.loaded = [False] * num_slots  # slot holds a delta for this layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        rows: RowSlots | None = getattr(_active, "rows", None)
        if rows is None or not any(self.loaded[s] for s in rows.active):
            return y  # no row of this step runs an adapter that targets this layer
        flat = x.reshape(-1, self.in_features)
        low = torch.mm(flat, self.a.t()).mul_(rows.mask(self.width, flat.dtype))
        out = y.view(-1, self.out_features)
        return torch.addmm(out, low, self.b).view_as(y)

    def clear(self, slot: int) -> None:
        w = self.width
        self.a[slot * w : (slot + 1) * w].zero_()
        self.b[slot * w : (slot + 1) * w].zero_()
        self.loaded[slot] = False

    def put(self, slot: int, part: int, a: torch.Tensor, b: torch.Tensor, scaling: float) -> None:
        """Part `part`'s A (r, in) and B (out_part, r) into `slot`, scaling folded into B."""
        r = a.shape[0]
        row = slot * self.width + part * self.max_rank
        off, size = self.offsets[part], self.part_sizes[part]
        self.a[row : row + r] = a.to(self.a.dtype)
        self.b[row : row + r, off : off + size] = (b.to(torch.float32) * scaling).t().to(self.b.dtype)
        self.loaded[slot] = True


class LoraModel:
    """The model's Linear layers wrapped for `num_slots` adapters, and which adapter each slot holds."""

    def __init__(self, model: nn.Module, num_slots: int, max_rank: int) -> None:
        self.num_slots, self.max_rank = num_slots, max_rank
        self.targets: dict[str, tuple[LoraLinear, int]] = {}  # unfused module name -> (layer, part)
        self.slot_weights: list[LoraWeights | None] = [None] * num_slots  # what each slot was loaded from
        head = model.get_output_embeddings()
        param = next(model.parameters())
        swaps = []
        for prefix, parent in model.named_modules():
            for child_name, child in parent.named_children():
                if child is head or not isinstance(child, nn.Linear | PackedLinear):
                    continue
                swaps.append((prefix, parent, child_name, child))
        for prefix, parent, child_name, child in swaps:
            parts = FUSED_PARTS.get(child_name, (child_name,))
            sizes = self._part_sizes(parent, child_name, child, len(parts))
            layer = LoraLinear(child, parts, sizes, num_slots, max_rank, param.dtype, param.device)
            setattr(parent, child_name, layer)
            base = f"{prefix}." if prefix else ""
            for i, part in enumerate(parts):
                self.targets[base + part] = (layer, i)

    @staticmethod
    def _part_sizes(parent: nn.Module, name: str, child: nn.Module, n: int) -> list[int]:
        if name == "qkv_proj":
            return list(parent.qkv_sizes)
        if n == 2:
            return [child.out_features // 2] * 2
        return [child.out_features]

    def holds(self, slot: int, identity: str) -> bool:
        held = self.slot_weights[slot]
        return held is not None and held.identity == identity

    def load_slot(self, slot: int, weights: LoraWeights) -> None:
        if self.holds(slot, weights.identity):
            return
        for layer in {id(layer): layer for layer, _ in self.targets.values()}.values():
            if layer.loaded[slot]:
                layer.clear(slot)
        for name, (a, b, scaling) in weights.modules.items():
            layer, part = self.targets[name]
            layer.put(slot, part, a, b, scaling)
        self.slot_weights[slot] = weights

    def check(self, weights: LoraWeights, path: str) -> None:
        """Refuse an adapter whose tensors do not fit this model (by shapes and module names)."""
        for name, (a, b, _) in weights.modules.items():
            if name not in self.targets:
                raise AdapterError(f"{path}: adapter targets {name!r}, which is not a Linear layer of this model")
            layer, part = self.targets[name]
            if a.shape[1] != layer.in_features or b.shape[0] != layer.part_sizes[part]:
                raise AdapterError(
                    f"{path}: {name} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}, but the model's "
                    f"layer maps {layer.in_features} -> {layer.part_sizes[part]} (an adapter of another model?)")
            if a.shape[0] > self.max_rank:
                raise AdapterError(f"{path}: rank {a.shape[0]} of {name} exceeds max_lora_rank {self.max_rank}")


def read_adapter(name: str, identity: str, path: str | Path) -> LoraWeights:
    """A PEFT LoRA adapter directory read with peft's loaders, as (module name -> A, B, scaling)."""
    from peft import PeftConfig  # peft's import is slow: only where adapters are served
    from peft.utils import load_peft_weights
    from peft.utils.other import get_pattern_key

    raw = read_config(path)
    for key, what in UNSUPPORTED_OPTIONS.items():
        if what and raw.get(key):
            raise AdapterError(f"{Path(path) / 'adapter_config.json'}: {what} is not supported")
    try:
        config = PeftConfig.from_pretrained(str(path))
        state = load_peft_weights(str(path), device="cpu")
    except Exception as e:  # peft raises many kinds for a malformed directory
        raise AdapterError(f"{path}: peft could not read the adapter: {type(e).__name__}: {e}") from None
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in state.items():
        module, sep, kind = key.rpartition(".lora_")
        if not sep or kind not in ("A.weight", "B.weight"):
            raise AdapterError(f"{weights_file(path)}: tensor {key!r} is not a LoRA A/B weight of a Linear layer")
        module = module.removeprefix("base_model.model.")
        pairs.setdefault(module, {})[kind[0]] = tensor
    modules: dict[str, tuple[torch.Tensor, torch.Tensor, float]] = {}
    for module, ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"{weights_file(path)}: {module} lacks lora_{'A' if 'A' not in ab else 'B'}")
        a, b = ab["A"].float(), ab["B"].float()
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise AdapterError(f"{weights_file(path)}: {module} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}")
        r = a.shape[0]
        alpha = config.alpha_pattern.get(get_pattern_key(config.alpha_pattern.keys(), module), config.lora_alpha)
        scaling = alpha / math.sqrt(r) if config.use_rslora else alpha / r
        modules[module] = (a, b, scaling)
    if not modules:
        raise AdapterError(f"{weights_file(path)}: no LoRA tensors")
    return LoraWeights(name=name, identity=identity, rank=max(a.shape[0] for a, _, _ in modules.values()), modules=modules)


def set_rows(rows: RowSlots | None) -> None:
    """The running step's row slots (None: no adapter rows; every LoraLinear is its base)."""
    _active.rows = rows


class AdapterStore:
    """Adapters' tensors in host memory, at most `max_cpu_loras` (least recently used out: read
    from disk again when a request needs them), and copied into the model's batch slots."""

    def __init__(self, model: LoraModel, max_cpu_loras: int) -> None:
        if max_cpu_loras < model.num_slots:
            raise ValueError(f"max_cpu_loras ({max_cpu_loras}) must be at least max_loras ({model.num_slots})")
        self.model, self.max_cpu_loras = model, max_cpu_loras
        self.resident: OrderedDict[str, LoraWeights] = OrderedDict()  # by identity
        self.disk_reads = 0  # adapters read from disk (at registration and after an eviction)
        self.read_s = 0.0  # of those reads, a moving average of their time (routers price a load with it)

    def read(self, ref: AdapterRef) -> LoraWeights:
        """`ref`'s tensors, checked against the model, now resident (raises AdapterError)."""
        weights = self.resident.get(ref.identity)
        if weights is None:
            started = time.perf_counter()
            weights = read_adapter(ref.name, ref.identity, ref.path)
            self.model.check(weights, ref.path)
            took = time.perf_counter() - started
            self.read_s = took if not self.disk_reads else 0.8 * self.read_s + 0.2 * took
            self.disk_reads += 1
        self._keep(weights)
        return weights

    def ensure(self, slot: int, ref: AdapterRef) -> None:
        """`ref` in batch slot `slot` before a step that runs it. An adapter that a run-time load
        pushed out of host memory while it sat in its slot is resident again from the slot's copy
        (no disk read on the step path): otherwise it would run unlisted in `resident`, and
        routers would price its replica as a disk read."""
        if self.model.holds(slot, ref.identity):
            self._keep(self.model.slot_weights[slot])
        else:
            self.model.load_slot(slot, self.read(ref))

    def _keep(self, weights: LoraWeights) -> None:
        """`weights` most recently used in host memory; the least recently used beyond the cap out."""
        self.resident[weights.identity] = weights
        self.resident.move_to_end(weights.identity)
        while len(self.resident) > self.max_cpu_loras:
            self.resident.popitem(last=False)

    def forget(self, ref: AdapterRef) -> None:
        self.resident.pop(ref.identity, None)

    def resident_names(self) -> list[str]:
        return sorted(w.name for w in self.resident.values())
