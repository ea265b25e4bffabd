"""Which TCP ports a process tree listens on, and on which address (`ss -ltnp`, filtered to
the tree). Used to check that a local `prefixgate serve` keeps to loopback (docs/deploy.md):

    python infra/scripts/listeners.py PID          # e.g. the pid of `prefixgate serve`
"""

from __future__ import annotations

import ipaddress
import re
import subprocess
import sys
from dataclasses import dataclass

import psutil


@dataclass(frozen=True)
class Listener:
    address: str
    port: int
    pid: int
    name: str

    @property
    def loopback(self) -> bool:
        """127.0.0.0/8, ::1, or IPv4 loopback as IPv6 (gRPC's ::ffff:127.0.0.1)."""
        try:
            ip = ipaddress.ip_address(self.address)
        except ValueError:  # "*" (every interface) or a name
            return False
        mapped = getattr(ip, "ipv4_mapped", None)
        return (mapped or ip).is_loopback


def tree(pid: int) -> dict[int, str]:
    """pid -> process title (Ray titles its processes, e.g. ray::ServeReplica:...)."""
    root = psutil.Process(pid)
    found = {}
    for proc in [root, *root.children(recursive=True)]:
        try:
            found[proc.pid] = " ".join(proc.cmdline())[:60] or proc.name()
        except psutil.Error:
            pass
    return found


def listeners(pid: int) -> list[Listener]:
    return listening(tree(pid))


def listening(pids: dict[int, str]) -> list[Listener]:
    """The listening TCP sockets of these processes (pid -> name)."""
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    found = set()
    for line in out.splitlines():
        fields = line.split()
        if len(fields) < 4:
            continue
        address, _, port = fields[3].rpartition(":")
        for owner in map(int, re.findall(r"pid=(\d+)", line)):
            if owner in pids:
                found.add(Listener(address.strip("[]"), int(port), owner, pids[owner]))
    return sorted(found, key=lambda x: (x.loopback, x.name, x.port))


def main(argv: list[str]) -> int:
    rows = listeners(int(argv[0]))
    for x in rows:
        print(f"{x.address:>15}:{x.port:<6} {'loopback' if x.loopback else 'ALL/OTHER':9} {x.name}")
    print(f"{sum(not x.loopback for x in rows)} of {len(rows)} listening sockets beyond loopback")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
