"""A replica's LoRA adapters in host memory, modelled: at most `max_cpu_loras` resident, least
recently used out (replica/model/lora.py's `AdapterStore` is the real one), a disk read of
`load_ms` for one that is not. One model for the simulator's replicas (router/sim/replica.py) and
the live sim engine's (replica/backends/sim_engine.py), so the fleet harness compares like with like.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from router.protocol.lora import MAX_CPU_LORAS

LORA_LOAD_MS = 100.0  # reading a rank-16 adapter of a large model from NVMe, a few hundred MB


@dataclass(frozen=True)
class LoraConfig:
    """A modelled replica's adapter memory, as the live settings name it (docs/lora.md)."""

    max_cpu_loras: int = MAX_CPU_LORAS  # adapters resident in host memory
    load_ms: float = LORA_LOAD_MS  # reading one from disk

    def __post_init__(self) -> None:
        if self.max_cpu_loras < 1 or self.load_ms < 0:
            raise ValueError("max_cpu_loras must be >= 1 and the load time >= 0")


class AdapterLru:
    """One replica's adapters in host memory: an LRU of identities, and the disk reads it made."""

    def __init__(self, config: LoraConfig) -> None:
        self.config = config
        self.resident: OrderedDict[str, None] = OrderedDict()
        self.loads = 0  # disk reads

    def holds(self, identity: str | None) -> bool:
        """No adapter, or one resident: the request starts without a read."""
        return identity is None or identity in self.resident

    def use(self, identity: str | None) -> bool:
        """A request under `identity` starts: whether it reads the adapter from disk first. The
        adapter is then the most recently used; past `max_cpu_loras` the least recently used goes."""
        if identity is None:
            return False
        read = identity not in self.resident
        if read:
            self.loads += 1
            self.resident[identity] = None
            while len(self.resident) > self.config.max_cpu_loras:
                self.resident.popitem(last=False)
        self.resident.move_to_end(identity)
        return read

    def heartbeat(self) -> dict[str, str | int]:
        """The heartbeat's LoRA fields: resident identities, and the read time once one was made
        (a live replica reports 0 until it has measured a read)."""
        return {"lora_resident": " ".join(self.resident),
                "lora_load_ms": round(self.config.load_ms) if self.loads else 0}
