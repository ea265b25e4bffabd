"""Streaming chat answers, read the way a client does: status, replica, text, finish reasons,
usage, error chunks and where [DONE] came; and what a well-formed stream is."""

from __future__ import annotations

import json


async def _stream(client, url, body, headers=None, on_line=None) -> dict:
    """One streaming request, parsed: status, replica header, text, finish reasons, usage,
    error chunks, and where the [DONE] lines were. `on_line(out)` runs after each line (a
    fault injected mid-stream)."""
    out = {"status": None, "replica": None, "text": "", "finish": [], "usage": None, "errors": [], "done_at": [],
           "lines": 0}
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers or {}) as r:
        out["status"] = r.status_code
        if r.status_code != 200:
            await r.aread()
            out["errors"].append(r.text)
            return out
        out["replica"] = r.headers["x-prefixgate-replica"]
        async for line in r.aiter_lines():
            if not line:
                continue
            out["lines"] += 1
            if line == "data: [DONE]":
                out["done_at"].append(out["lines"])
            elif line.startswith("data: "):
                _take(out, json.loads(line[6:]))
            if on_line is not None:
                on_line(out)
    return out


def _take(out: dict, chunk: dict) -> None:
    if "error" in chunk:
        out["errors"].append(chunk["error"])
        return
    for c in chunk["choices"]:
        out["text"] += c["delta"].get("content") or ""
        if c["finish_reason"]:
            out["finish"].append(c["finish_reason"])
    out["usage"] = chunk.get("usage") or out["usage"]


def _assert_well_formed(s: dict) -> None:
    assert s["status"] == 200 and not s["errors"], s
    assert s["done_at"] == [s["lines"]], s  # exactly one [DONE], and it is the last line
    assert len(s["finish"]) == 1 and s["usage"] is not None, s
    assert s["usage"]["total_tokens"] == s["usage"]["prompt_tokens"] + s["usage"]["completion_tokens"]
