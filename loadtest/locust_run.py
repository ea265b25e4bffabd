"""One headless Locust run: what it sends (LoadSpec) and how it runs (run_locust).

Shared by `prefixgate loadtest run|compare` (loadtest/cli.py) and `prefixgate loadtest
headtohead` (loadtest/headtohead.py). Locust runs as a subprocess of this interpreter
(`python -m locust`), so its gevent monkey-patching never touches the caller's process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from loadtest.summary import load_records, summarize

LOCUSTFILE = Path(__file__).with_name("locustfile.py")
REPO = Path(__file__).resolve().parent.parent


@dataclass
class LoadSpec:
    """What Locust sends: identical across the policies of a comparison."""

    workload: str = "chat"  # chat | trace | chat,trace
    users: int = 4
    spawn_rate: float = 4.0
    duration_s: int = 120  # hard stop; a run normally ends when every user ran out of work
    seed: int = 0
    system_prompts: int = 4
    system_tokens: int = 300
    user_tokens: int = 48
    turns: int = 4
    turns_min: int = 0  # > 0: each chat has uniform [turns_min, turns] turns
    sessions_per_user: int = 2
    think_min: float = 0.5
    think_max: float = 1.5
    max_tokens: int = 24
    trace_file: str | None = None
    trace_start: int = 0
    trace_requests: int = 100
    trace_speedup: float = 1.0
    trace_block_tokens: int = 16
    trace_max_prompt: int = 1024
    trace_max_output: int = 16

    def user_classes(self) -> list[str]:
        names = {"chat": "ChatUser", "trace": "TraceUser"}
        out = []
        for w in self.workload.split(","):
            if w.strip() not in names:
                raise ValueError(f"unknown workload {w!r}; use chat, trace or chat,trace")
            out.append(names[w.strip()])
        return out

    def locust_argv(self, url: str, out_dir: Path, label: str) -> list[str]:
        argv = [
            sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless",
            "-u", str(self.users), "-r", str(self.spawn_rate), "-t", f"{self.duration_s}s",
            "--host", url, "--csv", str(out_dir / "locust"), "--only-summary", "--loglevel", "WARNING",
            "--records", str(out_dir / "records.jsonl"), "--run-label", label,
            "--seed", str(self.seed), "--system-prompts", str(self.system_prompts),
            "--system-tokens", str(self.system_tokens), "--user-tokens", str(self.user_tokens),
            "--turns", str(self.turns), "--turns-min", str(self.turns_min), "--sessions-per-user", str(self.sessions_per_user),
            "--think-min", str(self.think_min), "--think-max", str(self.think_max),
            "--max-tokens", str(self.max_tokens),
            "--trace-start", str(self.trace_start), "--trace-requests", str(self.trace_requests),
            "--trace-speedup", str(self.trace_speedup), "--trace-block-tokens", str(self.trace_block_tokens),
            "--trace-max-prompt", str(self.trace_max_prompt), "--trace-max-output", str(self.trace_max_output),
        ]
        if self.trace_file:
            argv += ["--trace-file", self.trace_file]
        return argv + self.user_classes()


def run_locust(spec: LoadSpec, url: str, out_dir: Path, label: str = "") -> dict:
    """One headless Locust run; returns its summary (also written to out_dir/summary.json)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    records = out_dir / "records.jsonl"
    if records.exists():
        records.unlink()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    log = out_dir / "locust.log"
    started = time.time()
    with log.open("w") as f:
        proc = subprocess.run(spec.locust_argv(url, out_dir, label), stdout=f, stderr=subprocess.STDOUT,
                              env=env, cwd=REPO, timeout=spec.duration_s + 120)
    summary = summarize(load_records(records), label or None)
    summary["locust_exit_code"] = proc.returncode
    summary["wall_s"] = time.time() - started
    summary["settings"] = asdict(spec)
    if proc.returncode not in (0, 1):  # 1: some request failed (counted in errors)
        tail = log.read_text()[-3000:]
        summary["locust_failure"] = tail
        print(f"[loadtest] locust exited with {proc.returncode}; last output:\n{tail}", file=sys.stderr)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary
