"""The prefill half of a disaggregated decision (docs/prefill-decode.md): which prefill replica
computes a prompt for the decode replica the policy chose, and whether one should at all.

A model served with prefill and decode roles runs its prefill replicas as a deployment of their
own, publishing into their own index (`prefill_key_prefix`: their blocks, heartbeats and
registrations). The router decides among the decode replicas as it always has; then, when the
prompt's part the chosen decode replica does not hold is longer than `threshold_tokens` (llm-d's
prefix-based P/D decider: a short uncached part is cheaper to compute where the request decodes
than to hand over), it picks the prefill replica with the least prefill work before this prompt's
would be done, priced with the latency model (router/latency_model.py) the router learns from
the prefill replicas' heartbeats as from the decode replicas': the mean predicted time to this
prompt's first token there (its work ahead at the request's priority, the prompt's part it does
not hold, from the prefill index). Until every prefill replica has a step model (cold, just
restarted), in tokens: the prompt's part it does not hold plus its pending prefill tokens. With the prefill index away, no prefill replica
heartbeating, or nothing over the threshold: no pick, and the decode replica computes the
prompt itself, as a colocated replica does.

Cost per decision: one lookup in the prefill index (the same script and budget as the decode
index's) and a scan of the prefill replicas' heartbeats (a handful; the load table keeps them
fresh in the background). The prefill replicas' ids are re-read from their registrations every
MEMBERS_REFRESH_S.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field
from typing import Literal, get_args

from router.index.redis_index import IndexUnavailable, RedisIndex
from router.latency_model import predict
from router.load_table import LoadTable
from router.protocol.messages import KvSource
from router.protocol.redis_schema import queued_ahead
from router.router_options import PD_THRESHOLD_TOKENS

MEMBERS_REFRESH_S = 1.0  # how often the prefill replicas' registrations are re-read
# why a decision has the prefill pick it has: one picked, or none because the uncached part is
# short, no prefill replica heartbeats, the prefill index did not answer, or a pull copies the prefix
PrefillWhy = Literal["picked", "short", "no_replica", "index", "pull"]
Skipped = Literal["short", "no_replica", "index"]


@dataclass(frozen=True)
class PrefillPick:
    """The prefill half of one decision, and why (the routing audit records both): `source` the
    prefill replica and the blocks it hands over (None: the decode replica computes the prompt),
    `costs` what each live prefill replica was priced at, in `unit` ("s": the latency model's
    mean time to this prompt's first token there; "tokens": prefill tokens ahead of its end)."""

    source: KvSource | None
    why: PrefillWhy
    costs: dict[str, float] = field(default_factory=dict)
    unit: str = ""


class PrefillPicker:
    """One router's view of the prefill replicas of its model: `pick` per decision."""

    def __init__(self, index: RedisIndex, loads: LoadTable, threshold_tokens: int = PD_THRESHOLD_TOKENS) -> None:
        self.index = index
        self.loads = loads
        self.threshold_tokens = threshold_tokens
        self._ids: list[str] = []
        self._read_at = -MEMBERS_REFRESH_S
        self._reading: asyncio.Task | None = None
        self.picks = 0
        self.skipped: dict[Skipped, int] = dict.fromkeys(get_args(Skipped), 0)  # why decisions had no prefill pick
        self._rng = random.Random()  # breaks ties between equally costed prefill replicas

    async def pick(self, hashes: list[int], prompt_tokens: int, decode_matched_blocks: int,
                   block_size: int, priority: int = 0) -> PrefillPick:
        """The prefill replica for a prompt of `prompt_tokens` whose decode replica holds its first
        `decode_matched_blocks` blocks, or none (the decode replica computes it), and why.
        `priority`: the request's scheduling priority (it waits only for the work of its priority
        and better)."""
        uncached = prompt_tokens - decode_matched_blocks * block_size
        if uncached <= self.threshold_tokens:
            return self._skip("short")
        handed = (prompt_tokens - 1) // block_size  # the last token is computed where it decodes
        if handed <= decode_matched_blocks:
            return self._skip("short")
        ids = await self._replicas()
        live = [rid for rid in ids if self.loads.get(rid) is not None]
        if not live:
            return self._skip("no_replica")
        try:
            look = await self.index.lookup(hashes, live)
        except IndexUnavailable:
            return self._skip("index")

        uncached = {rid: max(prompt_tokens - (look.replicas[rid].matched_blocks if rid in look.replicas else 0)
                             * block_size, 0) for rid in live}
        fits = {rid: self.loads.latency.fit(rid) for rid in live}
        if all(fit is not None for fit in fits.values()):
            unit = "s"

            def cost(rid: str) -> float:  # the mean predicted time to this prompt's first token there
                hb = self.loads.get(rid) or {}
                return predict(fits[rid], uncached=uncached[rid], prompt_tokens=prompt_tokens,
                               running=int(hb.get("running", 0)), waiting=int(hb.get("waiting", 0)),
                               pending_prefill=int(hb.get("pending_prefill_tokens", 0)),
                               context=int(hb.get("context_tokens", 0)), ahead=queued_ahead(hb, priority),
                               quantile=False).ttft_s
        else:
            unit = "tokens"

            def cost(rid: str) -> float:  # a replica without a step model yet: prefill tokens ahead of its end
                return uncached[rid] + int((self.loads.get(rid) or {}).get("pending_prefill_tokens", 0))
        # equal costs (idle replicas, heartbeats not yet showing the last pick) are broken at
        # random: by id, prompts sent one at a time to idle replicas all went to the first
        costs = {rid: cost(rid) for rid in live}
        best = min(live, key=lambda rid: (costs[rid], self._rng.random()))
        self.picks += 1
        return PrefillPick(KvSource(best, handed), "picked", costs, unit)

    def _skip(self, why: Skipped) -> PrefillPick:
        self.skipped[why] += 1
        return PrefillPick(None, why)

    async def _replicas(self) -> list[str]:
        """The registered prefill replicas, re-read every MEMBERS_REFRESH_S (in the background
        once known: a decision never waits for it but the first)."""
        if time.monotonic() - self._read_at >= MEMBERS_REFRESH_S and (self._reading is None or self._reading.done()):
            self._reading = asyncio.get_running_loop().create_task(self._read())
            if not self._ids:
                try:
                    await asyncio.wait_for(asyncio.shield(self._reading), max(self.index.config.timeout_s * 4, 0.5))
                except Exception:
                    pass
        return self._ids

    async def _read(self) -> None:
        self._read_at = time.monotonic()
        try:
            ids = await self.index.registered()
        except IndexUnavailable:
            return
        if ids != self._ids:
            self._ids = ids
            await self.loads.include(ids)
