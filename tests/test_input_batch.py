"""The persistent batch (replica/model/input_batch.py) and the step inputs built over it
(replica/model/step_inputs.py): rows kept across steps and written only where a request's
blocks changed, inputs that keep their addresses from step to step, and exact greedy output on
every attention path while requests join, finish and are preempted."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from replica.core.scheduler import ScheduledChunk
from replica.core.sequence import Sequence
from replica.engine import LLMEngine, SamplingParams
from replica.kernels import attention
from replica.kernels.attention_metadata import AttentionMetadata, KVPool, PrefillSegment
from replica.model.input_batch import InputBatch
from replica.model.step_inputs import StepInputs
from tests.helpers.engine import reference_greedy

CPU = torch.device("cpu")


def _seq(rid: str, n: int, blocks: list[int]) -> Sequence:
    seq = Sequence(list(range(n)), SamplingParams(), hash_seed=0, request_id=rid)
    seq.table.block_ids = blocks
    return seq


def test_rows_are_written_only_where_a_request_changed():
    batch = InputBatch(max_rows=3, max_blocks=4, max_tokens=16, block_size=4, device=CPU)
    a, b = _seq("a", 5, [7, 3]), _seq("b", 2, [5])
    assert batch.rows_for([ScheduledChunk(a, 4, 5), ScheduledChunk(b, 1, 2)]).tolist() == [0, 1]
    assert batch.block_table.np[0, :2].tolist() == [7, 3] and batch.block_table.np[1, 0] == 5

    batch.block_table.np[0, 0] = -1  # a row is not rewritten while its request's blocks only grow
    a.table.block_ids.append(9)
    assert batch.rows_for([ScheduledChunk(a, 8, 9)]).tolist() == [0]
    assert batch.block_table.np[0, :3].tolist() == [-1, 3, 9]

    a.table.block_ids = [2, 6]  # preempted and re-admitted: new blocks, the whole row rewritten
    a.num_preemptions += 1
    batch.rows_for([ScheduledChunk(a, 0, 5)])
    assert batch.block_table.np[0, :2].tolist() == [2, 6]

    batch.release("a")  # the lowest free row goes to the next request
    assert batch.rows_for([ScheduledChunk(_seq("c", 1, [1]), 0, 1)]).tolist() == [0]
    assert batch.slots(np.array([1, 0]), np.array([1, 0])).tolist() == [5 * 4 + 1, 1 * 4]


def test_rows_of_requests_waiting_after_a_preemption_are_taken_back_when_rows_run_out():
    batch = InputBatch(max_rows=2, max_blocks=2, max_tokens=8, block_size=4, device=CPU)
    batch.rows_for([ScheduledChunk(_seq("a", 2, [1]), 1, 2), ScheduledChunk(_seq("b", 2, [2]), 1, 2)])
    c = _seq("c", 2, [3])  # a and b wait, preempted; their rows are still held
    assert batch.rows_for([ScheduledChunk(c, 1, 2)]).tolist() == [0]
    assert batch.row_of("a") is None and batch.row_of("b") is None and len(batch) == 1
    with pytest.raises(ValueError, match="past the batch's 2 per row"):
        batch.rows_for([ScheduledChunk(_seq("d", 12, [4, 5, 6]), 0, 12)])


def _inputs(cpu_decode: bool) -> StepInputs:
    pool = KVPool.allocate(1, 64 * 4, 1, 8, torch.float32, CPU)
    return StepInputs(pool, 4, CPU, max_rows=8, max_tokens=64, max_blocks=16, cpu_decode=cpu_decode)


def test_a_decode_step_keeps_its_input_addresses_and_reads_the_persistent_rows():
    inputs = _inputs(cpu_decode=True)
    seqs = [_seq(f"r{i}", 6 + i, [10 + 3 * i, 11 + 3 * i, 12 + 3 * i]) for i in range(3)]
    addresses = set()
    for step in range(2):
        chunks = [ScheduledChunk(s, s.num_tokens - 1, s.num_tokens) for s in seqs]
        ids, positions, meta, sample_rows = inputs.prepare(chunks)
        addresses.add((ids.data_ptr(), positions.data_ptr(), meta.slot_mapping.data_ptr(), meta.decode_lens.data_ptr(),
                       meta.decode_tables.data_ptr(), sample_rows.data_ptr()))
        rows = [inputs.batch.row_of(c.seq.request_id) for c in chunks]
        assert positions[0].tolist() == [c.end - 1 for c in chunks]
        assert ids[0].tolist() == [c.seq.token_ids[-1] for c in chunks]
        assert meta.slot_mapping.tolist() == [c.seq.table.block_ids[(c.end - 1) // 4] * 4 + (c.end - 1) % 4
                                              for c in chunks]
        offsets = meta.decode_offsets.tolist()
        for c, row, start in zip(chunks, rows, offsets, strict=False):
            assert start == row * 16
            assert meta.decode_tables[start : start + 3].tolist() == c.seq.table.block_ids
        for s in seqs:
            s.token_ids.append(step)
    assert len(addresses) == 1


def test_the_torch_path_gets_cascades_and_triton_the_gathered_tables():
    inputs = _inputs(cpu_decode=False)
    shared = [1, 2, 3]
    seqs = [_seq(f"s{i}", 14 + i, shared + [20 + i]) for i in range(3)] + [_seq("lone", 6, [30, 31])]
    chunks = [ScheduledChunk(s, s.num_tokens - 1, s.num_tokens) for s in seqs]
    chunks.append(ScheduledChunk(_seq("p", 9, [40, 41, 42]), 4, 9))  # a prefill after 4 cached tokens
    _, positions, meta, sample_rows = inputs.prepare(chunks)
    assert [c.seq.request_id for c in chunks] == ["s0", "s1", "s2", "lone", "p"]
    assert [(c.start, c.end) for c in meta.decode_cascades] == [(0, 3), (3, 4)]
    assert meta.decode_cascades[0].prefix_blocks.tolist() == shared
    assert meta.decode_block_table.tolist() == [shared + [20], shared + [21], shared + [22], [30, 31, 0, 0]]
    assert meta.decode_lens.tolist() == [14, 15, 16, 6]
    (segment,) = meta.prefills
    assert (segment.q_start, segment.q_end) == (4, 9) and sample_rows.tolist() == [0, 1, 2, 3, 8]
    assert segment.kv_slots.tolist() == [40 * 4 + i for i in range(4)] + [41 * 4 + i for i in range(4)] + [42 * 4]
    assert positions[0, 4:].tolist() == list(range(4, 9))


def test_padding_rows_write_no_slot():
    """Rows past the step's tokens (a compiled or captured step padded to its size) are not
    written to the pool and come back as zeros."""
    pool = KVPool.allocate(1, 8, 1, 4, torch.float32, CPU)
    meta = AttentionMetadata(pool=pool, slot_mapping=torch.tensor([2, 3]), prefills=[PrefillSegment(0, 2, None, None)],
                             block_size=4)
    q, k, v = torch.randn(1, 1, 4, 4), torch.randn(1, 1, 4, 4), torch.randn(1, 1, 4, 4)
    attention.set_metadata(meta)
    try:
        out = attention.attend(0, q, k, v, None, None)
    finally:
        attention.set_metadata(None)
    written = pool.k[0, 0].abs().sum(-1).nonzero().flatten().tolist()
    assert written == [2, 3] and out[0, 2:].abs().sum() == 0


@pytest.mark.slow
@pytest.mark.parametrize("path", ["c_kernel", "torch"])
def test_greedy_output_is_exact_on_each_decode_path_under_preemption(path, tiny_model_dirs):
    """Requests with a shared prompt (cascades on the torch path) join while others decode in a
    pool small enough to preempt; every row is released when its request finishes."""
    model_dir = tiny_model_dirs["qwen3"]
    ref = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa").eval()
    rng = random.Random(7)
    system = [rng.randrange(3, 384) for _ in range(20)]
    prompts = [system + [rng.randrange(3, 384) for _ in range(n)] for n in (3, 9, 14, 5, 11, 2)]
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    expected = [reference_greedy(ref, p, 10, stop_at_eos=False) for p in prompts]
    engine = LLMEngine(model_dir, block_size=4, num_blocks=30, max_num_seqs=5)
    if path == "torch":
        engine.runner.inputs.cpu_decode = False
    elif not engine.runner.inputs.cpu_decode:
        pytest.fail("the C decode kernel did not build here (see replica/kernels/cpu_attention.py's log)")
    ids = [engine.add_request(p, params) for p in prompts[:3]]
    done: dict[str, list[int]] = {}
    steps = 0
    while engine.has_unfinished or len(ids) < len(prompts):
        steps += 1
        if steps in (2, 4, 7):
            ids.append(engine.add_request(prompts[len(ids)], params))
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
    assert [done[i] for i in ids] == expected
    assert engine.stats().preemptions > 0
    assert len(engine.runner.inputs.batch) == 0


def test_fresh_prompts_of_one_length_attend_as_one_batch():
    """Prompts with nothing cached are laid out by length; those of one length form one segment
    whose batched attention equals attending each alone."""
    inputs = _inputs(cpu_decode=False)
    blocks = iter(range(64))
    seqs = {n: _seq(n, int(n[1:]), [next(blocks) for _ in range(4)]) for n in ("a5", "b3", "c5", "d5")}
    chunks = [ScheduledChunk(seqs["a5"], 0, 5), ScheduledChunk(seqs["b3"], 0, 3), ScheduledChunk(seqs["c5"], 0, 5),
              ScheduledChunk(_seq("cached", 9, [50, 51, 52]), 4, 9), ScheduledChunk(seqs["d5"], 0, 5)]
    _, _, meta, sample_rows = inputs.prepare(chunks)
    assert [c.seq.request_id for c in chunks] == ["b3", "a5", "c5", "d5", "cached"]
    assert [(s.q_start, s.q_end, s.count) for s in meta.prefills] == [(0, 3, 1), (3, 18, 3), (18, 23, 1)]
    assert meta.prefills[1].parts() == [(3, 8), (8, 13), (13, 18)]
    assert sample_rows.tolist() == [2, 7, 12, 17, 22]

    torch.manual_seed(0)
    t = 23
    q, k, v = torch.randn(1, 4, t, 8), torch.randn(1, 2, t, 8), torch.randn(1, 2, t, 8)
    meta.pool = KVPool.allocate(1, 64 * 4, 2, 8, torch.float32, CPU)
    one_by_one = AttentionMetadata(pool=meta.pool, slot_mapping=meta.slot_mapping, block_size=4, prefills=[
        PrefillSegment(a, b, s.kv_slots, s.mask) for s in meta.prefills for a, b in s.parts()])
    outs = []
    for m in (meta, one_by_one):
        attention.set_metadata(m)
        try:
            outs.append(attention.attend(0, q, k, v, None, None))
        finally:
            attention.set_metadata(None)
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=1e-6)


def test_a_small_step_runs_on_one_thread_and_a_large_one_as_it_is(tiny_model_dirs):
    """The engine's step (forward, lm_head, sampler) on one thread when the model is small for
    the step's tokens (replica/model/layer_forward.py's rule), the caller's count restored after."""
    engine = LLMEngine(tiny_model_dirs["qwen3"], block_size=4, num_blocks=30)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        with engine.runner.step_threads([ScheduledChunk(_seq("small", 5, [1, 2]), 0, 5)]):
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
        large = [ScheduledChunk(_seq(f"r{i}", 256, list(range(64))), 0, 256) for i in range(8)]
        with engine.runner.step_threads(large):  # 2,048 tokens x 64 x 256 >= 2^23
            assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
