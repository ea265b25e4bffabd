"""Memory and imports of the stack's processes, read from /proc (Linux): how light a gateway
or a sim replica is. Ray titles Serve replica processes `ray::ServeReplica:APP:DEPLOYMENT` (plus `.method` while
one of its tasks runs)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ProcMemory:
    pid: int
    title: str
    rss_mb: float  # resident set
    pss_mb: float  # shared pages divided among the processes sharing them
    uss_mb: float  # private pages only: what the process alone costs
    torch_loaded: bool  # a torch shared library is mapped


def serve_replica_pids(app: str, deployment: str) -> list[int]:
    """PIDs of this machine's Serve replica processes of one deployment of one app."""
    title = f"ray::ServeReplica:{app}:{deployment}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        # while the actor runs a task Ray retitles it `...:DEPLOYMENT.method` (a health check, a
        # request): that is the same replica
        if cmdline.startswith(title) and cmdline[len(title): len(title) + 1] in (b"", b"\0", b" ", b"."):
            pids.append(int(entry.name))
    return sorted(pids)


def proc_memory(pid: int) -> ProcMemory:
    fields: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            fields[key] = int(parts[0])  # kB
    maps = Path(f"/proc/{pid}/maps").read_text()
    title = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
    uss = fields.get("Private_Clean", 0) + fields.get("Private_Dirty", 0)
    return ProcMemory(pid, title, fields.get("Rss", 0) / 1024, fields.get("Pss", 0) / 1024, uss / 1024,
                      "libtorch" in maps)


def summary(mems: list[ProcMemory]) -> dict[str, float | int]:
    """Count, mean and max of RSS/PSS/USS in MB, and how many have torch mapped."""
    if not mems:
        return {"count": 0}
    out: dict[str, float | int] = {"count": len(mems), "torch_loaded": sum(m.torch_loaded for m in mems)}
    for key in ("rss_mb", "pss_mb", "uss_mb"):
        values = [getattr(m, key) for m in mems]
        out[f"{key}_mean"] = round(sum(values) / len(values), 1)
        out[f"{key}_max"] = round(max(values), 1)
    return out
