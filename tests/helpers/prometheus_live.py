"""Evaluate dashboard queries in a real Prometheus that scrapes a Ray node's metrics port.

Starts `prometheus` (Debian's package; scripts/bootstrap.sh installs it) on a free loopback
port with a throwaway TSDB, scraping one Ray metrics export port every 3 s, and answers
"how many series does this query return now". tests/test_metrics.py uses it to check that
every panel of both dashboards is filled against the running stack. By hand:

    .venv/bin/python -m tests.prometheus_live --url http://127.0.0.1:8000 --metrics-port 9500
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

from tests.helpers.promql import substitute

WINDOW = "5m"  # $interval in the live check (the dashboards' default); Ray refreshes values every ~10 s


class LivePrometheus:
    def __init__(self, metrics_port: int, scrape_interval_s: float = 3.0) -> None:
        from gateway.local_redis import free_port

        self.metrics_port = metrics_port
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="prefixgate-prom-"))
        (self.dir / "prometheus.yml").write_text(
            "global:\n"
            f"  scrape_interval: {int(scrape_interval_s * 1000)}ms\n"
            # a scrape that times out marks every series stale (instant queries go empty): on a
            # loaded machine Ray's export answers in seconds, so give it the whole interval
            f"  scrape_timeout: {int(scrape_interval_s * 1000)}ms\n"
            "scrape_configs:\n"
            "  - job_name: ray\n"
            "    static_configs:\n"
            f"      - targets: ['127.0.0.1:{metrics_port}']\n"
        )
        self.proc: subprocess.Popen | None = None
        self.started_at = 0.0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 60.0) -> LivePrometheus:
        binary = shutil.which("prometheus")
        if binary is None:
            raise RuntimeError("prometheus is not installed (apt-get install prometheus; scripts/bootstrap.sh does)")
        self.proc = subprocess.Popen(
            [binary, f"--config.file={self.dir / 'prometheus.yml'}", f"--storage.tsdb.path={self.dir / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
            stdout=subprocess.DEVNULL, stderr=open(self.dir / "prometheus.log", "wb"),
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited: {(self.dir / 'prometheus.log').read_text()[-2000:]}")
            try:
                if httpx.get(f"{self.url}/-/ready", timeout=2).status_code == 200:
                    self.started_at = time.monotonic()
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"prometheus not ready after {timeout_s:.0f}s")

    def query(self, expr: str) -> list[dict]:
        r = httpx.get(f"{self.url}/api/v1/query", params={"query": expr}, timeout=30)
        body = r.json()
        if body.get("status") != "success":
            raise ValueError(f"{body.get('errorType')}: {body.get('error')} in {expr}")
        return body["data"]["result"]

    def series(self, dashboard_expr: str) -> int:
        """Series a dashboard query returns now (Grafana variables at "All", window 1m);
        label_values(m, l) counts the label's values."""
        expr = substitute(dashboard_expr.replace("$interval", WINDOW))
        m = re.match(r"^\s*label_values\((.*),\s*([a-zA-Z_]\w*)\s*\)\s*$", expr, re.S)
        if m:
            expr = f"count by ({m.group(2)}) ({m.group(1)})"
        return len(self.query(expr))

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


def send_traffic(url: str, model: str, seconds: float) -> int:
    """Two-turn chats sharing a system prompt, back to back for `seconds`; returns requests sent."""
    system = "You are a careful assistant for a travel agency. Answer in one short sentence. " * 4
    deadline, sent, i = time.monotonic() + seconds, 0, 0
    while time.monotonic() < deadline:
        messages = [{"role": "system", "content": system}, {"role": "user", "content": f"Suggest city {i}."}]
        for _ in range(2):
            r = httpx.post(f"{url}/v1/chat/completions", json={"model": model, "messages": messages, "max_tokens": 6},
                           headers={"x-session-id": f"live-{i}"}, timeout=120)
            r.raise_for_status()
            sent += 1
            messages += [{"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]},
                         {"role": "user", "content": "Another?"}]
        i += 1
    return sent


def main(argv: list[str] | None = None) -> int:
    from tests.helpers.metrics import our_dashboard_queries, ray_serve_llm_queries

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", required=True, help="the gateway, for traffic")
    p.add_argument("--metrics-port", type=int, required=True)
    p.add_argument("--model", default="SmolLM2-135M-Instruct")
    p.add_argument("--traffic-s", type=float, default=40.0)
    args = p.parse_args(argv)
    prom = LivePrometheus(args.metrics_port).start()
    try:
        sent = send_traffic(args.url, args.model, args.traffic_s)
        time.sleep(12)  # Ray's next export
        print(f"{sent} requests sent")
        empty = 0
        for name, queries in (("prefixgate", our_dashboard_queries()), ("ray serve llm", ray_serve_llm_queries())):
            for q in queries:
                n = prom.series(q)
                empty += n == 0
                print(f"{name:14s} {n:3d}  {' '.join(q.split())[:150]}")
        print(f"{empty} queries returned nothing")
        return 1 if empty else 0
    finally:
        prom.stop()


if __name__ == "__main__":
    raise SystemExit(main())
