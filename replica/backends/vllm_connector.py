"""The K/V connector a vLLM replica runs with roles (docs/vllm.md, "Prefill and decode on vLLM
replicas"): vLLM's own file-based connector (`ExampleConnector`: each layer's K/V of a prompt as
a safetensors file under a shared directory) limited to the prompts prefixgate hands over.

vLLM loads this class by name in its engine core (`kv_transfer_config.kv_connector_module_path`),
once on the scheduler side and once beside the model; it imports vLLM, so only a vLLM replica's
processes import it. What it changes of ExampleConnector, which saves every prompt it has not
saved before and loads every prompt whose folder exists:

- a request saves only when its `kv_transfer_params` say `do_remote_decode` (the prefill
  replica's one-token request) and loads only when they say `do_remote_prefill` (the decode
  replica's request), each with the hand-over's id (`prefixgate_handover`); every other request,
  short prompts included, neither reads nor writes a file.
- the folder is keyed by the prompt's saved tokens and the hand-over's id: two hand-overs of one
  prompt (two tenants, two adapters) never share files, and deleting one's leaves the other's.
- the load covers the tokens the save wrote (the prompt's full blocks but its last token):
  ExampleConnector looked one token shorter, so a prompt whose length is 1 more than a multiple
  of the block size was never found.
- a prompt is saved in the step that computes its last chunk, all its blocks at once (a prompt
  split over steps by `max_num_batched_tokens`: the earlier chunks' K/V is in the pool by then);
  ExampleConnector saved at a request's first step, so only what that step computed.
- a request loads once: one resumed after a preemption computes again (its files may be gone).
- the prefill request's finished output carries the hand-over's `kv_transfer_params`: the
  folder, the tokens saved and the bytes written (`saved_tokens` 0: nothing saved).

Files are never deleted here: the decode replica deletes a hand-over's folder once its vLLM has
loaded it (replica/backends/vllm_backend.py), and sweeps folders left by hand-overs it gave up on.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import (
    ExampleConnector,
    ExampleConnectorMetadata,
)

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

HANDOVER_KEY = "prefixgate_handover"  # kv_transfer_params: the hand-over's id (the decode request's id)


def saved_tokens(prompt_len: int, block_size: int) -> int:
    """The prompt's tokens whose K/V a hand-over moves: its full blocks, less its last token
    (the decode replica computes that one to produce the first output token)."""
    return max(0, (prompt_len - 1) // block_size * block_size)


class PrefixgateHandoverConnector(ExampleConnector):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._stores: dict[str, str] = {}  # request id -> hand-over id: save this prompt
        self._saved: dict[str, int] = {}  # request id -> tokens saved (in the step its prompt's last chunk ran)
        self._pending: dict[str, tuple[list[int], list[int]]] = {}  # to save, prompt not all run: (tokens, blocks)

    # ---- scheduler side --------------------------------------------------------------------
    def _folder(self, prompt: list[int], handover: str) -> str:
        n = saved_tokens(len(prompt), self._block_size)
        return self._generate_foldername_debug(torch.tensor(prompt)[:n], [handover], create_folder=False)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        params = request.kv_transfer_params or {}
        handover = params.get(HANDOVER_KEY)
        if not isinstance(handover, str) or not handover:
            return 0, False
        if params.get("do_remote_decode"):
            self._stores[request.request_id] = handover
            return 0, False
        if not params.get("do_remote_prefill") or params.get("prefixgate_loaded"):
            return 0, False
        prompt = list(request.prompt_token_ids or [])
        n = saved_tokens(len(prompt), self._block_size)
        if n <= num_computed_tokens or not os.path.isdir(self._folder(prompt, handover)):
            return 0, False
        return n - num_computed_tokens, False

    def update_state_after_alloc(self, request: Request, blocks: Any, num_external_tokens: int) -> None:
        if num_external_tokens > 0:
            self._requests_need_load[request.request_id] = request
            request.kv_transfer_params["prefixgate_loaded"] = True  # once: a resumed request computes

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ExampleConnectorMetadata:
        meta = ExampleConnectorMetadata()
        bs = self._block_size
        for new in scheduler_output.scheduled_new_reqs:
            tokens = list(new.prompt_token_ids or [])
            rid = new.req_id
            if rid in self._requests_need_load:
                handover = self._requests_need_load.pop(rid).kv_transfer_params[HANDOVER_KEY]
                meta.add_request(tokens, new.block_ids[0], bs, is_store=False, mm_hashes=[handover])
            elif rid in self._stores and rid not in self._saved:
                self._pending[rid] = (tokens, list(new.block_ids[0]))
                self._save_if_run(meta, rid, new.num_computed_tokens + scheduler_output.num_scheduled_tokens.get(rid, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            if rid in self._pending:  # a prompt to save, computed in chunks: its blocks so far
                tokens, blocks = self._pending[rid]
                added = cached.new_block_ids[i]
                if added is not None:
                    blocks = list(added[0]) if rid in cached.resumed_req_ids else blocks + list(added[0])
                self._pending[rid] = (tokens, blocks)
                self._save_if_run(meta, rid, cached.num_computed_tokens[i] + scheduler_output.num_scheduled_tokens[rid])
            # resumed after a preemption with a load planned
            if rid not in self._requests_need_load or rid not in cached.resumed_req_ids:
                continue
            request = self._requests_need_load.pop(rid)
            total = cached.num_computed_tokens[i] + scheduler_output.num_scheduled_tokens[rid]
            meta.add_request(request.all_token_ids[:total], cached.new_block_ids[i][0], bs, is_store=False,
                             mm_hashes=[request.kv_transfer_params[HANDOVER_KEY]])
        self._requests_need_load.clear()
        return meta

    def _save_if_run(self, meta: ExampleConnectorMetadata, rid: str, run_after_step: int) -> None:
        """Save the prompt in this step if it computes the prompt's last chunk (the K/V of every
        slot is in the pool once the step's attention has run: save_kv_layer reads it then)."""
        tokens, blocks = self._pending[rid]
        if run_after_step < len(tokens):
            return
        del self._pending[rid]
        n = saved_tokens(len(tokens), self._block_size)
        if n > 0:
            meta.add_request(tokens, blocks, self._block_size, is_store=True, mm_hashes=[self._stores[rid]])
            self._saved[rid] = n

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._pending.pop(request.request_id, None)
        handover = self._stores.pop(request.request_id, None)
        n = self._saved.pop(request.request_id, 0)
        if handover is None:
            return False, None
        params: dict[str, Any] = {HANDOVER_KEY: handover, "saved_tokens": 0}
        folder = self._folder(list(request.prompt_token_ids or []), handover)
        if n and os.path.isdir(folder):  # saved during the step that computed it (synchronously)
            nbytes = sum(e.stat().st_size for e in os.scandir(folder) if e.is_file())
            params.update(saved_tokens=n, path=folder, bytes=nbytes)
        return False, params
