"""The live routing audit's records (docs/routing-audit.md): what each process writes, as JSON lines.

With `audit_dir` set (`prefixgate serve --audit-dir DIR`), every process that routes or serves
writes its own file in DIR, so no two processes append to one file:

  router-{pid}.jsonl         a `Decision` per request the router placed: the prompt's block
                             hashes, where it went, the router's decision as it sent it to the
                             replica (`route`, a messages.RouteDecision: the policy's choice,
                             the reason, the pull hint), and what the policy saw (matched
                             blocks, loads and costs of each replica it scored)
  replica-{replica_id}.jsonl a `Blocks` per cache change (the replica's block events, as its
                             publisher sends them to the index) and an `Outcome` per finished
                             request (its cached prompt tokens, when its first token came)

`loadtest/live_audit.py` joins them by request id and replays the block events to know what every
replica really held when each decision was made. Times are wall-clock (time.time()), so the
files of one machine compare directly; on a cluster they are as good as the nodes' clocks.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec

from router.protocol.messages import RouteDecision


class Decision(msgspec.Struct, tag="decision", kw_only=True, omit_defaults=True):
    """A routed request: the decision itself (`route`, the struct the replica was sent) plus
    what the router observed around it."""

    t: float
    request_id: str
    hashes: list[int]  # the prompt's leading block hashes, up to publish_depth (what the index holds)
    prompt_tokens: int
    replica: str  # where the request went (Ray may place it on another than `route.replica_id`)
    route: RouteDecision  # the decision: the policy's choice, its reason and pull hint
    session_replica: str | None = None  # the session's last replica, as the lookup said
    seen: dict[str, int] = {}  # matched blocks of each scored replica, as the policy saw them
    loads: dict[str, list[int]] = {}  # running, waiting, pending prefill tokens of each scored replica
    costs: dict[str, float] = {}  # the policy's cost of each scored replica (tokens)
    balance_tokens: float = 0.0  # costs within this of the cheapest count as a tie (affinity's balance_tolerance)
    capacity: dict[str, int] = {}  # device blocks of each scored replica, from its heartbeat
    cache_blind: bool = False  # the policy does not read matches (hashing, least-loaded, ...)
    # a model with prefill replicas: why the decision has its prefill pick (`route.prefill`; one of
    # router/prefill_pick.py's PrefillWhy) and what each live prefill replica was priced at, in
    # `prefill_unit` ("s": the latency model's mean time to the prompt's first token; "tokens")
    prefill_why: str = ""
    prefill_costs: dict[str, float] = {}
    prefill_unit: str = ""


class Blocks(msgspec.Struct, tag="blocks", kw_only=True, omit_defaults=True):
    t: float
    replica: str
    op: str  # "+" stored, "-" removed, "0" all cleared
    hashes: list[int] = []
    medium: str = "device"


class Outcome(msgspec.Struct, tag="outcome", kw_only=True, omit_defaults=True):
    t: float  # when the request finished on the replica
    request_id: str
    replica: str
    prompt_tokens: int
    cached_tokens: int  # prompt tokens the replica did not compute (its cache, lower tiers, a pull)
    first_token_t: float | None = None


Record = Decision | Blocks | Outcome
_decoder = msgspec.json.Decoder(Record)


class AuditWriter:
    """Appends records to one file, one JSON line each, from any thread of one process. Each
    line is one unbuffered write, so a process killed mid-run leaves complete lines."""

    def __init__(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self.path = Path(path)
        self._file = open(path, "ab", buffering=0)  # noqa: SIM115 (held for the process's life)
        self._encoder = msgspec.json.Encoder()
        self._lock = threading.Lock()

    @classmethod
    def for_process(cls, audit_dir: str | Path, role: str, name: str | None = None) -> AuditWriter:
        """`DIR/{role}-{name or pid}.jsonl`."""
        return cls(Path(audit_dir) / f"{role}-{name if name is not None else os.getpid()}.jsonl")

    def write(self, record: Record) -> None:
        line = self._encoder.encode(record) + b"\n"
        with self._lock:
            if not self._file.closed:
                self._file.write(line)

    def close(self) -> None:
        with self._lock:
            self._file.close()


def now() -> float:
    return time.time()


def read_dir(audit_dir: str | Path) -> Iterator[Record]:
    """Every record of every file in `audit_dir`, file by file (a torn last line is skipped)."""
    for path in sorted(Path(audit_dir).glob("*.jsonl")):
        with open(path, "rb") as f:
            for line in f:
                if not line.endswith(b"\n"):
                    break  # the writer died mid-line
                yield _decoder.decode(line)
