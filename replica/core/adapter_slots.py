"""Which LoRA adapters hold the batch's `max_loras` slots (vLLM's meaning of the limit).

Torch-free scheduling state: the scheduler admits a request for an adapter only when that
adapter holds a slot or one can be given to it (free, or held by an adapter no running request
uses, least recently used first). The model copies an adapter's tensors into its slot at the
step (replica/model/lora.py); a slot keeps its adapter until another needs the room, so a busy
adapter is not copied again per request.
"""

from __future__ import annotations

from collections import Counter, OrderedDict


class AdapterSlots:
    def __init__(self, max_loras: int) -> None:
        if max_loras < 1:
            raise ValueError("max_loras must be at least 1")
        self.max_loras = max_loras
        self.slot_of: OrderedDict[str, int] = OrderedDict()  # adapter -> slot, least recently used first
        self.users: Counter[str] = Counter()  # running requests per adapter
        self.loads = 0  # adapters given a slot (a copy into the model's slot tensors)

    def can_admit(self, adapter: str) -> bool:
        return adapter in self.slot_of or len(self.slot_of) < self.max_loras or self._idle() is not None

    def acquire(self, adapter: str) -> int:
        """The adapter's slot, taking a free or idle one if it has none; one more user."""
        if adapter not in self.slot_of:
            if len(self.slot_of) < self.max_loras:
                slot = min(set(range(self.max_loras)) - set(self.slot_of.values()))
            else:
                idle = self._idle()
                if idle is None:
                    raise RuntimeError(f"no slot for adapter {adapter!r}: can_admit first")
                slot = self.slot_of.pop(idle)
            self.slot_of[adapter] = slot
            self.loads += 1
        self.slot_of.move_to_end(adapter)
        self.users[adapter] += 1
        return self.slot_of[adapter]

    def release(self, adapter: str) -> None:
        self.users[adapter] -= 1
        if self.users[adapter] <= 0:
            del self.users[adapter]

    def drop(self, adapter: str) -> None:
        """An unloaded adapter leaves its slot (it has no users: the engine refuses otherwise)."""
        self.slot_of.pop(adapter, None)

    def running(self) -> list[str]:
        """Adapters with running requests (vLLM's `running_lora_adapters`)."""
        return sorted(self.users)

    def _idle(self) -> str | None:
        return next((a for a in self.slot_of if not self.users[a]), None)
