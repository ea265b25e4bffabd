"""The model's forward compiled by torch.compile (inductor), for EngineConfig(compile=True).

What is compiled is the base model (embeddings, every decoder layer, the final norm): inductor
fuses the small operations between the matrix products (norms, rotary embedding, activation,
residual adds) into a few C++ loops per layer. Paged attention and the oneDNN linear layers
stay opaque operators inside the graph (`prefixgate::paged_attention`,
`prefixgate::packed_linear`), so the step's metadata (decode groups, cascades, prefill
chunks) varies freely without touching the graph. lm_head runs after it, on the rows that
sample only, as transformers does with `logits_to_keep`.

One graph serves every batch: the token dimension is dynamic, and a step of one token is
padded to two (a size of 1 would be specialised into a second graph). Compiled artifacts
go to inductor's FX graph and AOTAutograd caches under the user's cache directory
(`$XDG_CACHE_HOME/prefixgate/inductor`, or TORCHINDUCTOR_CACHE_DIR when set), so a restarted
replica re-traces the graph but does not re-run inductor. The compile happens in warm_up(),
at engine start, never in a request's step.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from torch._dynamo import config as dynamo_config
from torch._inductor.runtime.cache_dir_utils import default_cache_dir

from replica.kernels import attention
from replica.kernels.attention_metadata import AttentionMetadata, KVPool, PrefillSegment
from replica.model import packed_linear

log = logging.getLogger("prefixgate.replica.compile")

# the CausalLM heads whose forward is `lm_head(base_model(...)[rows])`, nothing more
COMPILABLE = frozenset({"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"})
MIN_TOKENS = 2  # sizes 0 and 1 get specialised graphs of their own: pad a one-token step
MAX_TOKENS = 1 << 16  # the dynamic dimension needs a bound; far above any step's token budget
RECOMPILE_LIMIT = 64  # graphs of `_body` one process may hold (dynamo's default: 8)


def cache_dir() -> Path:
    """TORCHINDUCTOR_CACHE_DIR if the user chose one (not torch's own default under /tmp, which
    torch writes into the environment at its first use), else the user's cache directory."""
    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if current and os.path.abspath(current) != os.path.abspath(default_cache_dir()):
        return Path(current)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "prefixgate" / "inductor"


@dataclass
class CompileStats:
    seconds: float = 0.0  # warm-up: trace, compile (or cache load), first runs
    cache_dir: str = ""
    graphs: int = 0  # graphs compiled by warm_up (one per thread count: every size shares it)
    fx_cache_hits: int = 0
    fx_cache_misses: int = 0
    sizes: list[int] = field(default_factory=list)  # token counts warmed up


class CompiledForward:
    """model(input_ids, positions) -> logits of `sample_rows`, through the compiled base model."""

    def __init__(self, model: nn.Module) -> None:
        if type(model).__name__ not in COMPILABLE:
            raise ValueError(f"compile=True supports {sorted(COMPILABLE)}, not {type(model).__name__}")
        directory = str(cache_dir())
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = directory  # inductor reads it at every cache access
        torch._inductor.config.fx_graph_cache = True
        self.base, self.lm_head = model.model, model.lm_head
        self.layers = packed_linear.layers_of(self.base)
        self.stats = CompileStats(cache_dir=directory)
        # dynamo counts graphs per code object, and every CompiledForward compiles the same
        # `_body`: a graph per thread count per engine (model, dtype) would reach its default 8
        # in a process that starts a few engines (the test suite's); a replica has one engine
        dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, RECOMPILE_LIMIT)
        self._compiled = torch.compile(self._body, fullgraph=True)  # static but for the marked token dim

    def _body(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.base(input_ids=input_ids, position_ids=positions, use_cache=False).last_hidden_state

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, sample_rows: torch.Tensor) -> torch.Tensor:
        n = input_ids.shape[1]
        if n < MIN_TOKENS:  # padding rows: token 0 at position 0, never written to the pool
            pad = MIN_TOKENS - n
            input_ids = torch.nn.functional.pad(input_ids, (0, pad))
            positions = torch.nn.functional.pad(positions, (0, pad))
        for t in (input_ids, positions):
            torch._dynamo.mark_dynamic(t, 1, min=MIN_TOKENS, max=MAX_TOKENS)
        packed_linear.activate(self.layers)
        try:
            hidden = self._compiled(input_ids, positions)
        finally:
            packed_linear.activate({})  # hold no model's layers between steps
        return self.lm_head(hidden[0, sample_rows])

    @torch.inference_mode()
    def warm_up(self, pool: KVPool, block_size: int, sizes: list[int]) -> CompileStats:
        """Compile (or load from the cache) and run each size once, at engine start: on a fresh
        pool, the slots it writes are overwritten before anything reads them."""
        from torch._dynamo.utils import counters

        before = dict(counters["inductor"]), counters["stats"]["unique_graphs"]
        t0 = time.perf_counter()
        for n in sizes:
            meta = AttentionMetadata(pool=pool, slot_mapping=torch.arange(n, device=pool.k.device),
                                     prefills=[PrefillSegment(0, n, None, None)], block_size=block_size)
            ids = torch.zeros(1, n, dtype=torch.long, device=pool.k.device)
            attention.set_metadata(meta)
            try:
                self(ids, torch.arange(n, device=ids.device)[None], torch.tensor([n - 1], device=ids.device))
            finally:
                attention.set_metadata(None)
        s = self.stats  # summed over the warm-ups (one per thread count the steps run on)
        s.seconds += time.perf_counter() - t0
        s.sizes += sizes
        s.fx_cache_hits += counters["inductor"]["fxgraph_cache_hit"] - before[0].get("fxgraph_cache_hit", 0)
        s.fx_cache_misses += counters["inductor"]["fxgraph_cache_miss"] - before[0].get("fxgraph_cache_miss", 0)
        s.graphs += counters["stats"]["unique_graphs"] - before[1]
        log.info("compiled forward ready in %.1f s (FX graph cache: %d hits, %d misses, dir %s)",
                 s.seconds, s.fx_cache_hits, s.fx_cache_misses, s.cache_dir)
        return s
