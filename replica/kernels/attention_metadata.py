"""What paged attention reads: the K/V pool and one step's metadata, as tensors.

StepInputs.prepare (replica/model/step_inputs.py) builds an AttentionMetadata once per step;
every layer's attention reads it, whichever backend attends: the torch path (and on CPU its C
decode kernel) in replica/kernels/attention.py, or the Triton kernels of
replica/kernels/triton_attention.py. Kept apart from both so that each backend depends on these
types and neither on the other.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class KVPool:
    """K and V for every layer: [num_layers, kv_heads, num_blocks * block_size, head_dim].

    Head-major, so a gather of whole blocks is already laid out [kv_heads, tokens, head_dim],
    the shape attention multiplies: no second copy to reorder it.
    """

    k: torch.Tensor
    v: torch.Tensor

    @classmethod
    def allocate(cls, layers: int, slots: int, kv_heads: int, head_dim: int, dtype, device) -> KVPool:
        shape = (layers, kv_heads, slots, head_dim)
        return cls(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))


@dataclass
class PrefillSegment:
    """Queries rows [q_start, q_end) of one request attending over kv_slots (its whole context).

    `count` > 1: that many requests' prompts of equal length, side by side, none with a cached
    prefix (kv_slots None): attended as one batch, each causally over its own new K/V.
    """

    q_start: int
    q_end: int
    kv_slots: torch.Tensor | None  # None: no cached prefix, attend over the new K/V directly
    mask: torch.Tensor | None  # [q, kv] bool, None when plain causal
    count: int = 1

    def parts(self) -> list[tuple[int, int]]:
        """Each request's query rows [start, end)."""
        n = (self.q_end - self.q_start) // self.count
        return [(self.q_start + i * n, self.q_start + (i + 1) * n) for i in range(self.count)]


@dataclass
class DecodeGroup:
    """Decode rows [start, end) whose contexts have similar lengths, padded to the longest.

    Decodes are sorted by context length and cut into groups whose padded size stays within
    twice their real tokens, so the K/V gathered per layer follows the tokens that exist (32
    short contexts next to 1 long one never pad the short ones to the long one's length).
    """

    start: int
    end: int
    block_tables: torch.Tensor  # [b, M] block ids of each row's context
    mask: torch.Tensor | None  # [1, b, 1, M * block_size] True where a slot is valid; None: all
    # derived once per step, read by every layer
    flat_tables: torch.Tensor = field(init=False, repr=False)
    invalid: torch.Tensor | None = field(init=False, repr=False)  # ~mask: the slots every layer masks out

    def __post_init__(self) -> None:
        self.flat_tables = self.block_tables.reshape(-1)
        self.invalid = None if self.mask is None else ~self.mask


@dataclass
class DecodeCascade:
    """Decode rows [start, end) whose contexts start with the same physical `prefix_blocks`.

    The prefix's keys are multiplied by all these rows at once (one matrix product per KV head)
    and each row's softmax spans those scores and its own suffix's, so a system prompt shared by
    many requests is read once per step instead of once per request. `prefix_blocks` None: no
    shared prefix. `groups` cover [start, end) with absolute row ranges, block tables past the prefix.
    """

    start: int
    end: int
    prefix_blocks: torch.Tensor | None
    groups: list[DecodeGroup] = field(default_factory=list)


@dataclass
class AttentionMetadata:
    pool: KVPool
    slot_mapping: torch.Tensor  # [T] pool slot of each new token
    prefills: list[PrefillSegment] = field(default_factory=list)
    block_size: int = 16
    num_decodes: int = 0  # the first num_decodes rows are single-token decodes
    decode_cascades: list[DecodeCascade] = field(default_factory=list)  # cover rows [0, num_decodes)
    max_context: int = 0  # longest context in the step (checked against a sliding window)
    decode_lens: torch.Tensor | None = None  # [num_decodes] each decode row's context length
    # the decode rows for the CPU kernel (replica/kernels/cpu_attention.py): the persistent block
    # table, read in place (replica/model/input_batch.py); None: another attention reads them
    decode_tables: torch.Tensor | None = None  # every row's block table, flat
    decode_offsets: torch.Tensor | None = None  # [num_decodes + 1] where each decode row's table starts in it
    # for the Triton kernels: each decode row's blocks up to the longest context, in row order
    decode_block_table: torch.Tensor | None = None  # [num_decodes, width]
