"""`prefixgate serve` stops like a service: SIGTERM (what systemd, Docker and Kubernetes send)
or SIGINT, during start-up or while serving, ends with exit status 0 and nothing of the stack
left running: Serve, Ray's processes, the replicas and the local Redis it started.

Each case runs a real `prefixgate serve` (simulated-compute replicas, its own Ray node and
Redis) in a process of its own, records every process it starts while it runs, signals it and
then checks the process table. The deadlines only guard against a hang; the measured stop
times are in docs/reliability.md.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest

from gateway.local_redis import free_port

pytestmark = [pytest.mark.slow, pytest.mark.serve]  # `prefixgate serve` in a subprocess
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


class _Streams:
    """Streaming completions in flight while the signal arrives: each thread records its first
    token (an event the test waits on) and how its stream ended."""

    def __init__(self, port: int, n: int, max_tokens: int, headers: dict | None = None) -> None:
        self.started = [threading.Event() for _ in range(n)]
        self.ended: list[str | None] = [None] * n
        self.threads = [threading.Thread(target=self._run, args=(port, i, max_tokens, headers or {}), daemon=True)
                        for i in range(n)]
        for t in self.threads:
            t.start()

    def _run(self, port: int, i: int, max_tokens: int, headers: dict) -> None:
        body = {"model": "any", "prompt": f"in flight {i}", "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
        try:
            with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, headers=headers,
                              timeout=120) as r:
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    self.started[i].set()
                    choice = (event.get("choices") or [{}])[0]
                    if choice.get("finish_reason"):
                        self.ended[i] = choice["finish_reason"]
                    elif "error" in event:
                        self.ended[i] = "error: " + event["error"].get("message", "")
        except httpx.HTTPError as e:
            self.ended[i] = f"{type(e).__name__}: {e}"
        finally:
            self.started[i].set()


def _model(port: int, headers: dict | None = None) -> str:
    return httpx.get(f"http://127.0.0.1:{port}/v1/models", headers=headers or {}, timeout=30).json()["data"][0]["id"]


@pytest.mark.parametrize("signum, moment, target, keyed, ingress", [
    (signal.SIGTERM, "starting", "main", False, "proxy"), (signal.SIGTERM, "serving", "main", True, "proxy"),
    (signal.SIGINT, "serving", "group", False, "proxy"), (signal.SIGTERM, "serving", "group", False, "haproxy")],
    ids=["sigterm-during-start-up", "sigterm-while-serving-with-api-keys", "sigint-to-the-group-while-serving",
         "sigterm-to-the-group-while-serving-behind-haproxy"])
def test_serve_stops_cleanly_on_a_signal(tmp_path, signum, moment, target, keyed, ingress):
    """Signalled alone (as `kill PID`, systemd's SIGTERM) or with its whole process group (a
    terminal's Ctrl-C): exit 0, nothing left, no wait for Serve's 30 s controller timeout, and
    streams in flight when the signal comes end rather than hang.

    The keyed case starts it as a user of `--api-keys FILE` does: the start-up demo uses a
    configured key, keyed requests are served (the streams in flight carry one), others get 401.
    The HAProxy case (`--ingress haproxy`, gateway/ingress.py) serves the streams through HAProxy
    and the gateways' own HTTP servers, and HAProxy goes with the rest. The SIGINT case records the
    live routing audit (`--audit-dir`) and reads it back with `prefixgate loadtest audit`."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
    log = tmp_path / "serve.log"
    cmd = [sys.executable, "-m", "gateway.cli", "serve", "--engine", "sim", "--replicas", "2", "--num-blocks", "256",
           "--port", str(port), "--metrics-port", str(free_port()), "--ingress", ingress]
    audit = tmp_path / "audit" if signum == signal.SIGINT else None  # the live routing audit, as a user asks for it
    if audit is not None:
        cmd += ["--audit-dir", str(audit)]
    headers = None
    if keyed:
        keys = tmp_path / "keys.json"
        keys.write_text(json.dumps({"sk-alpha": "alpha", "sk-beta": "beta"}))
        cmd += ["--api-keys", str(keys)]
        headers = {"authorization": "Bearer sk-beta"}
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    seen: dict[int, float] = {}
    streams = None
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
        if moment == "serving":  # the front that takes HTTP is the one asked for
            assert any("haproxy" in n for n in _names(seen)) == (ingress == "haproxy"), _names(seen)
            assert f"port {port} ({ingress})" in log.read_text(errors="replace")
            # header bytes Serve cannot decode: a 400 on either front (gateway/http_guard.py)
            bad = httpx.get(f"http://127.0.0.1:{port}/health", headers=[(b"x-session-id", b"a\xffb")], timeout=30)
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "x-session-id", bad.text
        if keyed:
            assert "demo answer" in log.read_text(errors="replace")
            assert _model(port, headers)
            assert httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=30).status_code == 401
        if moment == "serving":  # under load: streams that have their first token when the signal comes
            streams = _Streams(port, 4, max_tokens=200, headers=headers)
            for ev in streams.started:
                assert ev.wait(300), "a stream never started"
            assert all(e is None for e in streams.ended), streams.ended
        signalled = time.monotonic()
        if target == "group":
            os.killpg(proc.pid, signum)
        else:
            proc.send_signal(signum)
        while proc.poll() is None and time.monotonic() - signalled < 120:  # hang guard
            _descendants(proc.pid, seen)  # anything started while it stops counts too
            time.sleep(0.2)
        took = time.monotonic() - signalled
        text = log.read_text(errors="replace")
        assert proc.poll() == 0, f"exit status {proc.poll()} after {took:.1f}s:\n{text[-3000:]}"
        if streams is not None:
            for t in streams.threads:
                t.join(120)
            # the streams end (completed or cut by the stop), none left hanging on a half-stopped stack
            assert not any(t.is_alive() for t in streams.threads), f"in-flight streams: {streams.ended}"
        # Ray's driver exits before the last of its node's processes: wait until they are gone
        gone_by = time.monotonic() + 60
        while (left := _still_running(seen)) and time.monotonic() < gone_by:
            time.sleep(0.2)
        assert not left, f"left running after exit ({took:.1f}s to exit):\n" + "\n".join(left)
        assert "Traceback" not in text and "SIGABRT" not in text and "Aborted" not in text, text[-3000:]
        assert "Controller failed to shut down" not in text, text[-3000:]
        if audit is not None:  # what the run recorded reads back (the demo's request at least finished)
            r = subprocess.run([sys.executable, "-m", "gateway.cli", "loadtest", "audit", str(audit)], cwd=ROOT,
                               capture_output=True, text=True, timeout=120)
            assert r.returncode == 0 and "routing audit:" in r.stdout, r.stdout + r.stderr
            assert any(audit.glob("replica-*.jsonl")) and any(audit.glob("router-*.jsonl"))
        print(f"[shutdown] {signal.Signals(signum).name} to {target} {moment}: exit 0 after {took:.1f}s, "
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
