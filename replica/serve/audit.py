"""A replica's part of the live routing audit (router/protocol/audit_log.py): its block events,
as its publisher sends them to the index, and each finished request's cached prompt tokens."""

from __future__ import annotations

from router.protocol.audit_log import AuditWriter, Blocks, Outcome, now
from router.protocol.media import DEVICE


class AuditListener:
    """A KVEventListener (router/protocol/events.py) that writes each change as a `Blocks`
    record; like the publisher, only blocks within `depth` of their prompt's start."""

    def __init__(self, writer: AuditWriter, replica_id: str, depth: int) -> None:
        self.writer, self.replica_id, self.depth = writer, replica_id, depth

    def stored(self, hashes: list[int], positions: list[int], medium: str = DEVICE) -> None:
        keep = [h for h, p in zip(hashes, positions, strict=True) if p < self.depth]
        if keep:
            self.writer.write(Blocks(t=now(), replica=self.replica_id, op="+", hashes=keep, medium=medium))

    def removed(self, hashes: list[int], medium: str = DEVICE) -> None:
        self.writer.write(Blocks(t=now(), replica=self.replica_id, op="-", hashes=list(hashes), medium=medium))

    def cleared(self) -> None:
        self.writer.write(Blocks(t=now(), replica=self.replica_id, op="0"))


def outcome(writer: AuditWriter, replica_id: str, request_id: str, prompt_tokens: int, cached_tokens: int,
            first_token_t: float | None) -> None:
    writer.write(Outcome(t=now(), request_id=request_id, replica=replica_id, prompt_tokens=prompt_tokens,
                         cached_tokens=cached_tokens, first_token_t=first_token_t))
