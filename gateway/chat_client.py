"""`prefixgate chat`: a terminal chat against a running gateway, one session, showing how much
of each turn's prompt came from the replica's prefix cache."""

from __future__ import annotations

import json
import uuid

import httpx


def run_chat(url: str, session: str | None = None, model: str | None = None) -> int:
    session = session or f"chat-{uuid.uuid4().hex[:8]}"
    with httpx.Client(base_url=url, timeout=300) as client:
        model = model or client.get("/v1/models").json()["data"][0]["id"]
        print(f"[prefixgate] chatting with {model} at {url} (session {session}); empty line or Ctrl-D quits")
        messages: list[dict] = []
        while True:
            try:
                line = input("you> ").strip()
            except (EOFError, KeyboardInterrupt):
                print()
                return 0
            if not line:
                return 0
            messages.append({"role": "user", "content": line})
            body = {"model": model, "messages": messages, "stream": True, "stream_options": {"include_usage": True}}
            reply, usage = "", None
            with client.stream("POST", "/v1/chat/completions", json=body, headers={"x-session-id": session}) as r:
                if r.status_code != 200:
                    r.read()
                    print(f"[error {r.status_code}] {r.json()['error']['message']}")
                    messages.pop()
                    continue
                replica, route = r.headers.get("x-prefixgate-replica"), r.headers.get("x-prefixgate-route")
                print("bot> ", end="", flush=True)
                for raw in r.iter_lines():
                    if not raw.startswith("data: {"):
                        continue
                    chunk = json.loads(raw[6:])
                    for choice in chunk.get("choices", []):
                        piece = choice["delta"].get("content") or ""
                        reply += piece
                        print(piece, end="", flush=True)
                    usage = chunk.get("usage") or usage
            messages.append({"role": "assistant", "content": reply})
            if usage:
                cached = usage["prompt_tokens_details"]["cached_tokens"]
                print(f"\n  [{cached}/{usage['prompt_tokens']} prompt tokens cached; replica {replica}, route {route}]")
