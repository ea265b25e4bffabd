"""SimEngine: our engine (replica/core/engine_core.py) whose forward pass is a sleep of the modelled
step time (ServiceSleep, its StepExecutor).

Everything but the model is real and shared with LLMEngine: the BlockManager (prefix cache, LRU, events to the
publisher), the Scheduler (chunked prefill, admission, preemption) and the usage accounting
(`num_cached_tokens`). Each `step()` schedules as LLMEngine does, then sleeps what the
service model (router/costs/service.py, the one the simulator uses) says that step costs, divided
by `time_scale`. Output tokens are deterministic fake ids (a hash of the prompt and the position,
never an end-of-sequence id), so the same prompt gives the same answer, like greedy decoding;
their text is a printable word per token, no tokenizer needed. With K/V tiers below the pool
(`host_blocks`, `disk_blocks`) the BlockManager's tier bookkeeping runs as on a real replica
(no bytes: mover None); the step that admits a prompt with lower-tier hits is charged their
copy back into the pool at the modelled tier rates (router/sim/tiers.py, as in the simulator).
LoRA adapters root their requests' hashes and hold the scheduler's batch slots as on our engine;
host memory is the simulator's model (`max_cpu_loras` resident, a read of `lora_load_ms` for
one that is not), reported in the heartbeat as a live replica reports its own.

It imports neither torch nor transformers, so hundreds fit on a few cores. On a busy machine a
step can take longer than modelled (the sleep wakes late, the step's own Python work, the loop
thread not getting the CPU): `step_lag()` reports actual vs modelled step time, and a run with
more than 10% lag does not measure what it claims (scale time down until the lag is small).
"""

from __future__ import annotations

import time
from array import array
from collections.abc import Sequence as Seq
from typing import Any

import xxhash

from replica.core.detokenizer import Detokenizer
from replica.core.engine_core import EngineCore
from replica.core.engine_types import InvalidRequestError, RequestOutput, TierUsage
from replica.core.scheduler import ScheduledChunk
from replica.core.sequence import Sequence
from replica.engine_config import SimEngineConfig
from router.costs.adapter_memory import AdapterLru, LoraConfig
from router.costs.tier_costs import copy_s, tier_rate
from router.protocol.messages import GenerateRequest, KvSource
from router.protocol.sampling import SamplingParams

__all__ = ["ManualClock", "SimEngine", "StepLag", "fake_token_text"]

LAG_LIMIT = 0.10  # a step more than 10% over its modelled time counts as lagging
_LAG_BUCKETS = 1000  # histogram of actual/modelled in 1% buckets, last one open-ended


class StepLag:
    """Actual vs modelled step time: a running sum plus a histogram for the tail."""

    def __init__(self) -> None:
        self.steps = 0
        self.modelled_s = 0.0
        self.actual_s = 0.0
        self.over_limit = 0
        self.max_ratio = 0.0
        self._hist = [0] * _LAG_BUCKETS

    def record(self, modelled_s: float, actual_s: float) -> None:
        ratio = actual_s / modelled_s if modelled_s > 0 else 1.0
        self.steps += 1
        self.modelled_s += modelled_s
        self.actual_s += actual_s
        self.over_limit += ratio > 1 + LAG_LIMIT
        self.max_ratio = max(self.max_ratio, ratio)
        self._hist[min(int(ratio * 100), _LAG_BUCKETS - 1)] += 1

    def quantile(self, q: float) -> float:
        """Upper edge of the bucket holding quantile q of actual/modelled."""
        if not self.steps:
            return 0.0
        need, seen = q * self.steps, 0
        for i, n in enumerate(self._hist):
            seen += n
            if seen >= need:
                return (i + 1) / 100
        return self.max_ratio

    def summary(self) -> dict[str, float | int | bool]:
        mean = self.actual_s / self.modelled_s if self.modelled_s else 0.0
        return {
            "steps": self.steps,
            "modelled_s": round(self.modelled_s, 4),
            "actual_s": round(self.actual_s, 4),
            "mean_ratio": round(mean, 4),  # time-weighted: total actual / total modelled
            "p50_ratio": self.quantile(0.50),
            "p99_ratio": self.quantile(0.99),
            "max_ratio": round(self.max_ratio, 4),
            "steps_over_10pct": self.over_limit,
            "valid": mean <= 1 + LAG_LIMIT,
        }


_WORDS = (
    "alpha bravo cedar delta ember fjord glade harbor island juniper kestrel lagoon meadow nectar "
    "orchid prairie quartz river summit tundra umber valley willow xenon yarrow zephyr amber basil "
    "coral dune echo fern granite hazel iris jade kelp lotus maple nova olive pebble quill reed "
    "sage thistle upland violet wren yew zinnia acorn birch clover dahlia elm flint grove heath "
    "ivy jasper knoll larch moss"
).split()


def fake_token_text(token_id: int) -> str:
    """The printable text of a fake token: one word, space-led."""
    return " " + _WORDS[token_id % len(_WORDS)]


class _WordTokenizer:
    """Just enough of a tokenizer for the Detokenizer's stop-string handling."""

    eos_token_id = None

    @staticmethod
    def decode(ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(fake_token_text(t) for t in ids)


class _WordDetokenizer(Detokenizer):
    """Fake tokens are whole words: without stop strings to look for, a token's text is simply
    appended (the fleet harness runs hundreds of these engines on a few cores)."""

    def __init__(self) -> None:
        super().__init__(_WordTokenizer())

    def update(self, seq: Sequence, check_stops: bool = True) -> str | None:
        if seq.params.stop or seq.detok_state is not None:
            return super().update(seq, check_stops)
        seq.output_text = _WordTokenizer.decode(seq.output_token_ids) if not seq.output_text else (
            seq.output_text + fake_token_text(seq.token_ids[-1]))
        return None


class ManualClock:
    """A clock that moves only when slept on: a SimEngine on it runs its modelled time at once, and
    every time it reads (arrivals, steps, objectives, the step model) is the modelled one, the
    same on any machine however busy (tests of what the engine decides from time)."""

    def __init__(self, start: float = 0.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += max(seconds, 0.0)


class ServiceSleep:
    """The simulated forward pass (a StepExecutor): sleep what the service model says the step
    costs, then draw each sequence's deterministic fake token."""

    def __init__(self, engine: SimEngine) -> None:
        self.engine = engine
        self.start = 0.0  # when this step was due (set by SimEngine.step)
        self.wall = 0.0  # the last step's modelled wall time

    def execute(self, chunks, admitted):
        e = self.engine
        self.wall = e.modelled_step_s(chunks, admitted) / e.config.time_scale
        remaining = self.start + self.wall - e.clock()
        if remaining > 0:
            e.wait(remaining)
        samplers = [c.seq for c in chunks if c.samples]
        return samplers, [e.fake_token(seq) for seq in samplers], [None] * len(samplers)


class SimEngine(EngineCore):
    """Our engine (replica/core/engine_core.py) with its forward pass replaced by ServiceSleep."""

    def __init__(self, config: SimEngineConfig | None = None, *, clock: ManualClock | None = None, **kwargs) -> None:
        """`clock`: a ManualClock to run on modelled time (None: the wall clock, steps slept)."""
        self.config = config = config or SimEngineConfig(**kwargs)
        self.wait = clock.sleep if clock is not None else time.sleep
        if config.time_scale <= 0:
            raise ValueError("time_scale must be positive")
        self.service = config.service_model()
        self.wall_service = self.service.scaled(config.time_scale)
        self.sleep = ServiceSleep(self)
        super().__init__(
            model_id=config.model_id, block_size=config.block_size, num_blocks=config.num_blocks,
            max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=config.max_model_len, vocab_size=config.vocab_size, eos_token_ids=set(),
            detokenizer=_WordDetokenizer(), executor=self.sleep,
            host_blocks=int(config.host_blocks), disk_blocks=int(config.disk_blocks), mover=None,
            max_loras=config.max_loras, long_prefill_token_threshold=config.long_prefill_token_threshold,
            clock=clock if clock is not None else time.monotonic,
        )

        self.lag = StepLag()
        self._avoid = set(config.eos_token_ids)  # never emitted, so never an end of sequence
        self._digest: dict[str, int] = {}  # request id -> prompt digest (seeds the fake tokens)
        self._due: float | None = None  # modelled end of the last step, while work remains
        self.transfer = config.transfer_model()
        for tier in self.blocks.tiers:  # a tier slower than recomputing is never read back
            tier.promote = self.transfer.tier_pays(tier.medium)
        # hinted requests still "pulling": (wall time due, seq, blocks), in arrival order. As on
        # a real replica (replica/kv_io/kv_pull.py) the pull happens before the engine sees the
        # request, so it delays that request alone, never the running batch's steps
        self._pulling: list[tuple[float, Sequence, int]] = []
        self.pulls = 0  # hints that copied at least one block
        self.pulled_blocks = 0
        self.pull_times: list[float] = []  # modelled seconds per pull (bounded below)
        self.adapter_memory = AdapterLru(LoraConfig(config.max_cpu_loras, config.lora_load_ms))

    # ---- submission ---------------------------------------------------------------------
    def add_request(self, prompt: str | Seq[int], params: SamplingParams | None = None, request_id: str | None = None,
                    cache_salt: str | None = None, *, kv_pull_blocks: int = 0, **keywords) -> str:
        """As LLMEngine.add_request, token ids only (the gateway tokenises); `kv_pull_blocks`: a
        pull hint of that many leading blocks, modelled (`add`)."""
        request = self.request(prompt, params, request_id, cache_salt, **keywords)
        if kv_pull_blocks:
            request.pull = KvSource(replica_id="", num_blocks=kv_pull_blocks)
        return self.add(request)

    def add(self, request: GenerateRequest, kv_prefix: Any = None) -> str:
        """Queue `request`; its pull hint (`request.pull`) is modelled (`_land_pulls`): the
        request waits the modelled transfer of its hinted blocks not held here. Under an adapter
        (its identity roots the prompt's hashes) not in the modelled host memory, it waits the
        read first. Either delays this request alone; an adapter's compute is not modelled."""
        if kv_prefix is not None:
            raise InvalidRequestError("the sim engine models pulls (a pull hint); it takes no K/V")
        seq = self.new_sequence(request)
        self._digest[seq.request_id] = xxhash.xxh64_intdigest(array("I", seq.prompt_token_ids).tobytes(), seed=seq.params.seed or 0)
        bs = self.config.block_size
        hinted = request.pull.num_blocks if request.pull is not None else 0
        pull = min(hinted, len(seq.table.hashes), max(seq.num_prompt_tokens - 1, 0) // bs)
        missing = sum(h not in self.blocks.hash_to_block for h in seq.table.hashes[:pull])
        wait_s = self.transfer.pull_s(missing * bs) if missing else 0.0
        if missing:
            self.pulls += 1
            if len(self.pull_times) < 100_000:
                self.pull_times.append(wait_s)
        if seq.adapter is not None and self.adapter_memory.use(self.adapters[seq.adapter].identity):
            wait_s += self.config.lora_load_ms / 1000
        if wait_s:
            self.requests[seq.request_id] = seq
            self._pulling.append((self.clock() + wait_s / self.config.time_scale, seq, pull if missing else 0))
        else:
            self.enqueue(seq)
        return seq.request_id

    def _land_pulls(self) -> None:
        """Hinted requests whose modelled transfer has ended: their blocks not held here go into
        the BlockManager as if computed (begin/finish_import, events to the index included), so
        the scheduler finds them as hits. The holder is assumed to still hold them (this process
        cannot see its cache)."""
        now = self.clock()
        due = [p for p in self._pulling if p[0] <= now]  # waits differ: not always the first ones
        for item in due:
            self._pulling.remove(item)
            _, seq, n = item
            if n:
                hashes = seq.table.hashes[:n]
                self.pulled_blocks += self.blocks.finish_import(self.blocks.begin_import(hashes), hashes, seq.token_ids)
            self.scheduler.add(seq)

    def pull_rates(self) -> dict[str, int]:
        """Heartbeat fields the router prices pulls with: this engine's modelled rates."""
        return {
            "kv_pull_bytes_per_s": int(self.transfer.bytes_per_s),
            "prefill_tokens_per_s": int(self.transfer.prefill_tokens_per_s),
        }

    def abort(self, request_id: str) -> bool:
        seq = self.requests.get(request_id)
        pulling = [p for p in self._pulling if p[1] is seq] if seq is not None else []
        if pulling:  # never reached the scheduler
            self.requests.pop(request_id, None)
            self.forget(request_id)
            self._pulling.remove(pulling[0])
            seq.finish_reason = "abort"
            return True
        return super().abort(request_id)

    def forget(self, request_id: str) -> None:
        self._digest.pop(request_id, None)

    def _lora_stats(self) -> dict:
        """The slots' fields, and the modelled host memory's as a live replica reports its own:
        resident identities, the read time once one was made (0 before)."""
        stats = super()._lora_stats()
        if stats:
            memory = self.adapter_memory
            stats.update(lora_resident=list(memory.resident),
                         lora_load_s=memory.config.load_ms / 1000 if memory.loads else 0.0)
        return stats

    def queued_elsewhere(self) -> tuple[int, int]:
        return len(self._pulling), sum(seq.num_tokens for _, seq, _ in self._pulling)  # a pulling request is queued work

    # ---- stepping -----------------------------------------------------------------------
    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_work or bool(self._pulling)

    def modelled_step_s(self, chunks: list[ScheduledChunk], admitted: set[int]) -> float:
        """Unscaled service time of one step: its decode batch and prefill tokens, plus copying
        back the lower-tier hits of the prompts it admits (the copies run before the forward
        pass, so the whole step waits for them)."""
        decodes = prefill_tokens = started = 0
        copy = 0.0
        for c in chunks:
            n = c.end - c.start
            if n == 1 and c.start >= c.seq.num_prompt_tokens:
                decodes += 1
            else:
                prefill_tokens += n
                if id(c.seq) in admitted:
                    started += 1
                    copy += copy_s(self.transfer, c.seq.table.promoted, self.config.block_size)
        return self.service.engine_step_s(decodes, prefill_tokens, started) + copy

    def tier_usage(self) -> dict[str, TierUsage]:
        """The core's tier figures with the modelled copies: bytes moved (blocks x block bytes)
        and the modelled rate back into the pool, which the heartbeat reports for the router."""
        usage = super().tier_usage()
        tiers = self.blocks.tiers
        block_bytes = self.transfer.pull_bytes(self.config.block_size)
        for tier, lower in zip(tiers, [*tiers[1:], None], strict=False):
            u = usage[tier.medium]
            u.promotion_bytes_per_s = int(tier_rate(self.transfer, tier.medium))
            u.bytes_in = int(u.demotions * block_bytes)
            spilled = lower.stats.demotions if lower is not None else 0  # moved on down
            u.bytes_out = int((u.promotions + spilled) * block_bytes)
        return usage

    def step(self) -> list[RequestOutput]:
        now = self.clock()
        # when the previous step left work, this one was due at that step's modelled end: a
        # late wake-up counts as lag, and a short late run is made up by sleeping less now
        start = self.sleep.start = self._due if self._due is not None and self._due <= now else now
        self._land_pulls()
        steps = self._steps
        outputs = super().step()
        if self._steps == steps:  # nothing was scheduled
            self._due = None
            if self._pulling:  # idle until the next transfer lands: sleep, never spin
                self.wait(min(max(self._pulling[0][0] - self.clock(), 0.0), 0.01))
            return outputs
        self.lag.record(self.sleep.wall, self.clock() - start)
        self._due = start + self.sleep.wall if self.scheduler.has_work else None
        return outputs

    def fake_token(self, seq: Sequence) -> int:
        pos = seq.num_tokens
        digest = self._digest.get(seq.request_id, 0)
        token = xxhash.xxh64_intdigest(pos.to_bytes(8, "little"), seed=digest) % self.vocab_size
        while token in self._avoid or token in seq.params.stop_token_ids:
            token = (token + 1) % self.vocab_size
        return token

    def step_lag(self) -> dict[str, float | int | bool]:
        return self.lag.summary()
