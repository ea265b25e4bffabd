"""Locust users for prefixgate: multi-turn chats (ChatUser) and Mooncake trace replay (TraceUser).

Run directly (`locust -f loadtest/locustfile.py --host URL ...`) or through
`prefixgate loadtest run|compare`. Every request streams (SSE, include_usage) so we can time the
first token ourselves; each one is reported to Locust (the request plus custom entries TTFT,
TPOT, prompt/cached tokens, replica) and, with --records, appended as one JSON line for
loadtest.summary, which computes hit rate, stickiness and percentiles Locust cannot.

Workload settings are Locust custom arguments (each also readable from a PG_* environment
variable). Everything random comes from rng streams derived from --seed and the user's spawn
index, so two runs with the same settings send the same prompts (replies are greedy).
"""

from __future__ import annotations

import itertools
import json
import os
import time

import gevent
import requests
from locust import User, constant, events, task
from locust.exception import StopUser

from loadtest.workload import (
    TraceRequest,
    TraceSpec,
    chat_turns,
    default_trace_path,
    load_trace,
    rng_for,
    system_prompt,
    user_message,
)

DEFAULT_TRACE = default_trace_path()


@events.init_command_line_parser.add_listener
def _arguments(parser) -> None:
    g = parser.add_argument_group("prefixgate workload")
    g.add_argument("--seed", type=int, default=0, env_var="PG_SEED", help="global seed of all prompts")
    g.add_argument("--system-prompts", type=int, default=4, env_var="PG_SYSTEM_PROMPTS",
                   help="K shared system prompts; each chat picks one")
    g.add_argument("--system-tokens", type=int, default=300, env_var="PG_SYSTEM_TOKENS",
                   help="length of each system prompt, tokens (approx.)")
    g.add_argument("--user-tokens", type=int, default=48, env_var="PG_USER_TOKENS",
                   help="mean user message length, tokens (uniform 0.5x-1.5x)")
    g.add_argument("--turns", type=int, default=4, env_var="PG_TURNS", help="turns per chat session")
    g.add_argument("--turns-min", type=int, default=0, env_var="PG_TURNS_MIN",
                   help="if set (< --turns): each chat has uniform [turns-min, turns] turns (uneven sessions)")
    g.add_argument("--sessions-per-user", type=int, default=0, env_var="PG_SESSIONS_PER_USER",
                   help="chats per user, then it stops (0: until --run-time)")
    g.add_argument("--think-min", type=float, default=0.5, env_var="PG_THINK_MIN", help="seconds")
    g.add_argument("--think-max", type=float, default=1.5, env_var="PG_THINK_MAX", help="seconds")
    g.add_argument("--max-tokens", type=int, default=24, env_var="PG_MAX_TOKENS", help="reply length cap")
    g.add_argument("--model-name", default="", env_var="PG_MODEL", help="default: the gateway's /v1/models")
    g.add_argument("--request-timeout", type=float, default=180.0, env_var="PG_REQUEST_TIMEOUT")
    g.add_argument("--records", default="", env_var="PG_RECORDS", help="JSON-lines file of per-request records")
    g.add_argument("--run-label", default="", env_var="PG_RUN_LABEL", help="stored in each record (e.g. the policy)")
    g.add_argument("--trace-file", default=DEFAULT_TRACE, env_var="PG_TRACE_FILE")
    g.add_argument("--trace-start", type=int, default=0, env_var="PG_TRACE_START")
    g.add_argument("--trace-requests", type=int, default=200, env_var="PG_TRACE_REQUESTS")
    g.add_argument("--trace-speedup", type=float, default=1.0, env_var="PG_TRACE_SPEEDUP",
                   help="arrival times are divided by this")
    g.add_argument("--trace-block-tokens", type=int, default=16, env_var="PG_TRACE_BLOCK_TOKENS",
                   help="synthetic tokens per trace hash id (the trace's 512)")
    g.add_argument("--trace-max-prompt", type=int, default=1024, env_var="PG_TRACE_MAX_PROMPT")
    g.add_argument("--trace-max-output", type=int, default=16, env_var="PG_TRACE_MAX_OUTPUT")


class _Records:
    """Append-only JSON-lines sink shared by the users of this process (gevent: no locking)."""

    fd: int | None = None

    @classmethod
    def write(cls, path: str, record: dict) -> None:
        if not path:
            return
        if cls.fd is None:
            cls.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.write(cls.fd, (json.dumps(record) + "\n").encode())


class _Finish:
    """Counts users that ran out of work; when all have, the run ends without waiting for -t."""

    done = 0

    @classmethod
    def user_done(cls, environment) -> None:
        cls.done += 1
        target = getattr(environment.parsed_options, "num_users", None)
        if target and cls.done >= target and environment.runner is not None:
            gevent.spawn_later(0.2, environment.runner.quit)
        raise StopUser()


_MODEL_NAME: dict[str, str] = {}


class GatewayUser(User):
    """Base: one HTTP session per user, streaming requests, measurement and reporting."""

    abstract = True
    wait_time = constant(0)  # pacing (think time, trace schedule) happens inside the tasks
    _spawned = itertools.count()

    def on_start(self) -> None:
        self.opts = self.environment.parsed_options
        self.index = next(type(self)._spawned)
        self.base = (self.host or "http://127.0.0.1:8000").rstrip("/")
        self.http = requests.Session()
        self.model = self._model_name()

    def on_stop(self) -> None:
        self.http.close()

    def _model_name(self) -> str:
        if self.opts.model_name:
            return self.opts.model_name
        if self.base not in _MODEL_NAME:
            r = self.http.get(f"{self.base}/v1/models", timeout=30)
            r.raise_for_status()
            _MODEL_NAME[self.base] = r.json()["data"][0]["id"]
        return _MODEL_NAME[self.base]

    def stream(self, path: str, payload: dict, headers: dict, meta: dict, chat: bool) -> dict:
        """Send one streaming request; returns its record (with the reply text under "text")."""
        rec: dict = {"ts": time.time(), "user": type(self).__name__, "label": self.opts.run_label,
                     "uid": self.index, **meta, "ok": False, "status": None, "error": None,
                     "prompt_tokens": 0, "cached_tokens": 0, "completion_tokens": 0,
                     "ttft_s": None, "tpot_s": None, "latency_s": None, "replica": None, "route": None}
        t0 = time.perf_counter()
        t_headers = first = last = None
        parts: list[str] = []
        usage = None
        done = False
        try:
            with self.http.post(f"{self.base}{path}", json=payload, headers=headers, stream=True,
                                timeout=self.opts.request_timeout) as resp:
                t_headers = time.perf_counter()
                rec["status"] = resp.status_code
                rec["replica"] = resp.headers.get("x-prefixgate-replica")
                rec["route"] = resp.headers.get("x-prefixgate-route")
                if resp.status_code != 200:
                    rec["error"] = f"HTTP {resp.status_code}: {resp.text[:160]}"
                else:
                    for line in resp.iter_lines():
                        if not line.startswith(b"data:"):
                            continue
                        data = line[5:].strip()
                        if data == b"[DONE]":
                            done = True
                            break
                        obj = json.loads(data)
                        if "error" in obj:
                            rec["error"] = f"stream error: {obj['error'].get('message', obj['error'])}"[:200]
                            break
                        if obj.get("usage"):
                            usage = obj["usage"]
                        for choice in obj.get("choices", ()):
                            piece = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
                            if piece:
                                last = time.perf_counter()
                                first = first or last
                                parts.append(piece)
                    if rec["error"] is None and not done:
                        rec["error"] = "stream ended without [DONE]"
                    elif rec["error"] is None and usage is None:
                        rec["error"] = "no usage in stream"
        except (requests.RequestException, ValueError) as e:
            rec["error"] = f"{type(e).__name__}: {e}"[:200]
        except gevent.GreenletExit:
            # the run ended (-t) with this request in flight: keep it, so a request that never
            # answers shows up instead of vanishing
            rec.update(error=f"cut off by the end of the run after {time.perf_counter() - t0:.1f}s",
                       aborted=True, latency_s=time.perf_counter() - t0)
            _Records.write(self.opts.records, rec)
            raise
        end = time.perf_counter()
        rec["latency_s"] = end - t0
        if usage is not None:
            rec["prompt_tokens"] = usage.get("prompt_tokens", 0)
            rec["completion_tokens"] = usage.get("completion_tokens", 0)
            rec["cached_tokens"] = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        # the gateway sends headers only once the first token exists: the fallback when no text
        start_of_output = first or t_headers
        if start_of_output is not None:
            rec["ttft_s"] = start_of_output - t0
        if first is not None and last is not None and rec["completion_tokens"] > 1:
            rec["tpot_s"] = (last - first) / (rec["completion_tokens"] - 1)
        rec["ok"] = rec["error"] is None
        self._report(rec)
        _Records.write(self.opts.records, rec)
        rec["text"] = "".join(parts)
        return rec

    def _report(self, rec: dict) -> None:
        fire = self.environment.events.request.fire
        exc = None if rec["ok"] else RuntimeError(rec["error"])
        fire(request_type="SSE", name=rec["name"], response_time=rec["latency_s"] * 1000,
             response_length=rec["completion_tokens"], exception=exc, context={})
        if not rec["ok"]:
            return
        if rec["ttft_s"] is not None:
            fire(request_type="METRIC", name="TTFT", response_time=rec["ttft_s"] * 1000, response_length=0,
                 exception=None, context={})
        if rec["tpot_s"] is not None:
            fire(request_type="METRIC", name="TPOT", response_time=rec["tpot_s"] * 1000, response_length=0,
                 exception=None, context={})
        # token counts ride in response_length: Locust's "Average size" column is the mean count
        fire(request_type="TOKENS", name="prompt tokens", response_time=0, response_length=rec["prompt_tokens"],
             exception=None, context={})
        fire(request_type="TOKENS", name="cached tokens", response_time=0, response_length=rec["cached_tokens"],
             exception=None, context={})
        fire(request_type="REPLICA", name=str(rec["replica"]), response_time=rec["ttft_s"] * 1000 if rec["ttft_s"] else 0,
             response_length=rec["cached_tokens"], exception=None, context={})


class ChatUser(GatewayUser):
    """A chat client: one of K shared system prompts, a session id, T turns with think time,
    resending the whole history (with the model's actual replies) every turn."""

    _spawned = itertools.count()

    def on_start(self) -> None:
        super().on_start()
        self.sessions = 0

    @task
    def converse(self) -> None:
        o = self.opts
        if o.sessions_per_user and self.sessions >= o.sessions_per_user:
            _Finish.user_done(self.environment)
        j = self.sessions
        self.sessions += 1
        rng = rng_for(o.seed, "chat", self.index, j)
        k = rng.randrange(max(o.system_prompts, 1))
        sid = f"chat-{o.seed}-{self.index}-{j}"
        messages = [{"role": "system", "content": system_prompt(o.seed, k, o.system_tokens)}]
        prev = None
        gevent.sleep(rng.uniform(0.0, o.think_min))  # users do not all start in lockstep
        turns = chat_turns(o.seed, self.index, j, o.turns, o.turns_min)
        for turn in range(1, turns + 1):
            messages.append({"role": "user", "content": user_message(rng, o.user_tokens)})
            payload = {"model": self.model, "messages": messages, "max_tokens": o.max_tokens,
                       "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
            meta = {"name": "chat", "session": sid, "turn": turn, "system_prompt": k, "prev_replica": prev}
            rec = self.stream("/v1/chat/completions", payload, {"x-session-id": sid}, meta, chat=True)
            if not rec["ok"]:
                return
            messages.append({"role": "assistant", "content": rec["text"]})
            prev = rec["replica"]
            if turn < turns:
                gevent.sleep(rng.uniform(o.think_min, o.think_max))


class TraceUser(GatewayUser):
    """Open-loop replay of the Mooncake trace, scaled down: all TraceUsers of the process share
    one schedule and take its rows in order, each sent at its compressed arrival time (or as
    soon as a user is free: `lag_s` records how late). Prompts are token ids, so rows sharing
    leading hash ids share leading tokens exactly."""

    _spawned = itertools.count()
    _schedule: list[TraceRequest] | None = None
    _next = 0
    _t0: float | None = None

    @classmethod
    def _load(cls, o) -> list[TraceRequest]:
        if cls._schedule is None:
            spec = TraceSpec(o.trace_file, o.trace_start, o.trace_requests, o.trace_speedup,
                             o.trace_block_tokens, o.trace_max_prompt, o.trace_max_output, o.seed)
            cls._schedule = load_trace(spec)
        return cls._schedule

    @task
    def replay(self) -> None:
        cls = TraceUser
        schedule = cls._load(self.opts)
        if cls._next >= len(schedule):
            _Finish.user_done(self.environment)
        item = schedule[cls._next]
        cls._next += 1
        if cls._t0 is None:
            cls._t0 = time.monotonic()
        delay = cls._t0 + item.at_s - time.monotonic()
        if delay > 0:
            gevent.sleep(delay)
        payload = {"model": self.model, "prompt": item.prompt, "max_tokens": item.max_tokens,
                   "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
        meta = {"name": "trace", "trace_index": item.index, "lag_s": max(0.0, -delay), "turn": None,
                "first_hash_id": item.hash_ids[0] if item.hash_ids else None}
        self.stream("/v1/completions", payload, {}, meta, chat=False)
