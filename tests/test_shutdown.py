"""`prefixgate serve` stops like a service: SIGTERM (what systemd, Docker and Kubernetes send)
or SIGINT, during start-up or while serving, ends with exit status 0 and nothing of the stack
left running: Serve, Ray's processes, the replicas and the local Redis it started.

Each case runs a real `prefixgate serve` (simulated-compute replicas, its own Ray node and
Redis) in a process of its own, records every process it starts while it runs, signals it and
then checks the process table. The deadlines only guard against a hang; the measured stop
times are in docs/reliability.md.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from gateway.local_redis import free_port

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]


def _descendants(pid: int, seen: dict[int, float]) -> None:
    """Add every living descendant of pid to seen (pid -> create time, so a reused pid is not
    mistaken for one of ours later)."""
    try:
        for child in psutil.Process(pid).children(recursive=True):
            try:
                seen.setdefault(child.pid, child.create_time())
            except psutil.NoSuchProcess:
                pass
    except psutil.NoSuchProcess:
        pass


def _still_running(seen: dict[int, float]) -> list[str]:
    left = []
    for pid, created in seen.items():
        try:
            p = psutil.Process(pid)
            if p.create_time() == created and p.status() != psutil.STATUS_ZOMBIE:
                left.append(f"{pid} {' '.join(p.cmdline())[:120]}")
        except psutil.NoSuchProcess:
            pass
    return left


def _names(seen: dict[int, float]) -> set[str]:
    out = set()
    for pid in seen:
        try:
            out.add(" ".join(psutil.Process(pid).cmdline()))
        except psutil.NoSuchProcess:
            pass
    return out


@pytest.mark.parametrize("signum, moment", [(signal.SIGTERM, "starting"), (signal.SIGTERM, "serving"),
                                            (signal.SIGINT, "serving")],
                         ids=["sigterm-during-start-up", "sigterm-while-serving", "sigint-while-serving"])
def test_serve_stops_cleanly_on_a_signal(tmp_path, signum, moment):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
    log = tmp_path / "serve.log"
    cmd = [sys.executable, "-m", "gateway.cli", "serve", "--engine", "sim", "--replicas", "2", "--num-blocks", "128",
           "--port", str(port), "--metrics-port", str(free_port())]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    seen: dict[int, float] = {}
    try:
        deadline = time.monotonic() + 600  # a hang guard for start-up on a loaded machine
        while True:
            _descendants(proc.pid, seen)
            text = log.read_text(errors="replace")
            assert proc.poll() is None, f"serve exited early ({proc.returncode}):\n{text[-3000:]}"
            names = _names(seen)
            if moment == "starting" and any("raylet" in n for n in names) and "serving" not in text:
                break  # Ray is up and Serve is being deployed: mid start-up
            if moment == "serving" and "serving until Ctrl-C" in text:
                break
            assert time.monotonic() < deadline, f"serve did not reach {moment!r}:\n{text[-3000:]}"
            time.sleep(0.2)
        _descendants(proc.pid, seen)
        assert any("redis-server" in n for n in _names(seen)), _names(seen)
        assert any("raylet" in n for n in _names(seen)), _names(seen)
        signalled = time.monotonic()
        proc.send_signal(signum)
        while proc.poll() is None and time.monotonic() - signalled < 120:  # hang guard
            _descendants(proc.pid, seen)  # anything started while it stops counts too
            time.sleep(0.2)
        took = time.monotonic() - signalled
        text = log.read_text(errors="replace")
        assert proc.poll() == 0, f"exit status {proc.poll()} after {took:.1f}s:\n{text[-3000:]}"
        # Ray's driver exits before the last of its node's processes: wait until they are gone
        gone_by = time.monotonic() + 60
        while (left := _still_running(seen)) and time.monotonic() < gone_by:
            time.sleep(0.2)
        assert not left, f"left running after exit ({took:.1f}s to exit):\n" + "\n".join(left)
        assert "Traceback" not in text and "SIGABRT" not in text and "Aborted" not in text, text[-3000:]
        print(f"[shutdown] {signal.Signals(signum).name} {moment}: exit 0 after {took:.1f}s, "
              f"{len(seen)} processes, none left")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for pid in [int(line.split()[0]) for line in _still_running(seen)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
