"""Deterministic synthetic workloads: chat text and scaled-down Mooncake trace prompts.

Pure functions of (seed, indices), with no Locust or network, so every policy in a comparison
sees exactly the same prompts and tests can check the mapping without a server.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

from router.sim.trace import TOKEN_ID_RANGE, TRACE_BLOCK_TOKENS, block_tokens  # noqa: F401 (re-exported)

# Common English words, each a single token (with its leading space) in SmolLM2's tokenizer, so
# "N words" is N prompt tokens there and close to it for other BPE tokenizers.
WORDS = """
time year people way day man thing woman life child world school state family student group
country problem hand part place case week company system program question work government number
night point home water room mother area money story fact month lot right study book eye job word
business issue side kind head house service friend father power hour game line end member law car
city community name president team minute idea body information back parent face level office
door health person art war history party result change morning reason research girl moment air
teacher force education river garden window table paper music market energy light field model
value order report plan data answer stone bridge cloud forest island ocean valley mountain engine
metal glass coffee bread apple horse bird dog cat fish tree flower seed leaf road street train ship
plane travel letter phone screen camera image color sound voice song dance movie film picture
kitchen dinner lunch breakfast sugar salt oil milk cheese cake wine beer tea rain snow wind storm
summer winter spring autumn north south east west center edge corner circle square shape size
weight speed distance price cost profit trade bank store shop class lesson course test exam skill
rule court police doctor nurse patient hospital medicine disease heart blood brain skin bone
muscle blue green red black white yellow brown small large early late fast slow happy quick simple
clear strong quiet warm cold bright dark heavy soft hard clean fresh young old new good great high
low long short open close build write read learn teach speak listen watch carry bring hold move
stay leave start stop turn follow create design measure explain describe compare choose decide
improve protect support
""".split()



def rng_for(*parts: object) -> random.Random:
    """An independent, reproducible stream per (seed, user, session, ...) tuple."""
    return random.Random(":".join(str(p) for p in parts))


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def system_prompt(seed: int, index: int, n_tokens: int) -> str:
    """System prompt number `index` of the shared pool; distinct from its first tokens, so two
    prompts never share a cache block."""
    head = f"You are assistant {index} of deployment {seed}. Follow these notes:"
    return f"{head} {words(rng_for(seed, 'system', index), max(n_tokens - 16, 1))}."


def chat_turns(seed: int, user: int, session: int, turns: int, turns_min: int = 0) -> int:
    """Turns of chat `session` of user `user`: `turns` for every chat unless turns_min is set
    (0 < turns_min < turns), then uniform in [turns_min, turns], drawn from a stream of its
    own so the prompts themselves do not change with it: uneven session lengths."""
    if turns_min <= 0 or turns_min >= turns:
        return turns
    return rng_for(seed, "turns", user, session).randint(turns_min, turns)


def user_message(rng: random.Random, mean_tokens: int) -> str:
    n = max(1, round(rng.uniform(0.5, 1.5) * mean_tokens))
    return f"Question: {words(rng, n)}?"


# ---- Mooncake trace ---------------------------------------------------------------------------
@dataclass(frozen=True)
class TraceRequest:
    """One trace row, scaled down: what a TraceUser sends and when."""

    index: int
    at_s: float  # send time relative to the replay start, after compression
    prompt: list[int]
    max_tokens: int
    hash_ids: tuple[int, ...]


@dataclass
class TraceSpec:
    path: str
    start: int = 0  # first row to replay
    requests: int = 200  # rows to replay
    speedup: float = 1.0  # arrival times divided by this
    block_tokens: int = 16  # synthetic tokens per hash id (the trace's 512)
    max_prompt_tokens: int = 1024
    max_output_tokens: int = 16
    seed: int = 0


def hash_block(seed: int, hash_id: int, n: int) -> list[int]:
    """The synthetic token block for one trace hash id: equal ids give equal tokens. The one
    mapping the fleet replay and the simulator use too (router/sim/trace.py)."""
    return block_tokens(hash_id, n, seed)


def scale_row(row: dict, index: int, spec: TraceSpec, t0_ms: float) -> TraceRequest:
    """Lengths scale by block_tokens/512 (prefix structure kept exactly), then are capped."""
    ratio = spec.block_tokens / TRACE_BLOCK_TOKENS
    ids = [int(h) for h in row["hash_ids"]]
    n_prompt = min(math.ceil(row["input_length"] * ratio), len(ids) * spec.block_tokens, spec.max_prompt_tokens)
    prompt: list[int] = []
    for h in ids:
        if len(prompt) >= n_prompt:
            break
        prompt.extend(hash_block(spec.seed, h, spec.block_tokens))
    max_tokens = min(max(1, math.ceil(row.get("output_length", 1) * ratio)), spec.max_output_tokens)
    at_s = (float(row["timestamp"]) - t0_ms) / 1000.0 / spec.speedup
    return TraceRequest(index, at_s, prompt[: max(n_prompt, 1)], max_tokens, tuple(ids))


def default_trace_path() -> str:
    """shared/traces/ inside the checkout, else next to it (the shared folder of a workspace)."""
    repo = Path(__file__).resolve().parent.parent
    for base in (repo / "shared", repo.parent / "shared"):
        p = base / "traces" / "mooncake_conversation_trace.jsonl"
        if p.exists():
            return str(p)
    return str(repo / "shared" / "traces" / "mooncake_conversation_trace.jsonl")


def load_trace(spec: TraceSpec) -> list[TraceRequest]:
    rows = []
    with Path(spec.path).open() as f:
        for i, line in enumerate(f):
            if i < spec.start:
                continue
            if len(rows) >= spec.requests:
                break
            if line.strip():
                rows.append(json.loads(line))
    if not rows:
        return []
    t0 = float(rows[0]["timestamp"])
    return [scale_row(r, spec.start + i, spec, t0) for i, r in enumerate(rows)]
