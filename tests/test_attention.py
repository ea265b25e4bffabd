"""Paged attention: decode groups follow the real tokens, match dense attention in fp32 and
bf16, and models needing unimplemented attention features are refused at load time."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from replica.core.scheduler import ScheduledChunk
from replica.core.sequence import Sequence
from replica.engine import LLMEngine, SamplingParams
from replica.kernels import attention
from replica.kernels.attention import UnsupportedModelError
from replica.kernels.attention_metadata import AttentionMetadata, DecodeCascade, DecodeGroup, KVPool

pytestmark = pytest.mark.engine  # tiny models and engines of its own


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 5000), min_size=1, max_size=80))
def test_decode_groups_pad_at_most_twice_the_real_tokens(lengths):
    lengths = sorted(lengths)
    groups = attention.plan_decode_groups(lengths)
    assert groups[0][0] == 0 and groups[-1][1] == len(lengths)
    assert all(a[1] == b[0] for a, b in zip(groups, groups[1:], strict=False))
    for start, end in groups:
        real = sum(lengths[start:end])
        assert (end - start) * lengths[end - 1] <= 2 * real or end - start == 1


def test_short_rows_are_not_padded_to_a_long_one():
    groups = attention.plan_decode_groups([40] * 32 + [4000])
    assert groups == [(0, 32), (32, 33)]


def _dense_reference(q, k_ctx, v_ctx, scale):
    """q: [H, D]; k_ctx, v_ctx: [L, KVH, D] -> [H, D], float64 for a tight reference."""
    h, kvh = q.shape[0], k_ctx.shape[1]
    k = k_ctx.double().repeat_interleave(h // kvh, dim=1).transpose(0, 1)  # [H, L, D]
    v = v_ctx.double().repeat_interleave(h // kvh, dim=1).transpose(0, 1)
    probs = torch.softmax(torch.einsum("hd,hld->hl", q.double(), k) * scale, dim=-1)
    return torch.einsum("hl,hld->hd", probs, v)


@pytest.mark.parametrize("shared", [0, 3])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_grouped_decode_matches_dense_attention(dtype, tol, shared):
    """Mixed lengths in scattered blocks. With `shared`, two cascades: rows starting with the same
    3 blocks (a cached system prompt), rows starting with another copy of it (2 blocks), each
    prefix attended once and merged with each row's own suffix; plus rows sharing nothing."""
    torch.manual_seed(0)
    bs, heads, kv_heads, d = 4, 8, 2, 16
    clusters = [(shared, (3, 5, 8, 9, 30, 64, 201)), (max(shared - 1, 0), (7, 40)), (0, (2, 17, 33))]
    lengths = [p * bs + n for p, ns in clusters for n in ns]
    total = sum(p for p, _ in clusters) + sum(-(-n // bs) for _, ns in clusters for n in ns)
    pool = KVPool.allocate(1, total * bs, kv_heads, d, dtype, "cpu")  # [1, KVH, slots, D]
    pool.k.normal_()
    pool.v.normal_()
    perm = iter(torch.randperm(total).tolist())  # scattered blocks, as in a busy pool
    meta = AttentionMetadata(pool=pool, slot_mapping=torch.empty(0, dtype=torch.long), block_size=bs,
                             num_decodes=len(lengths))
    tables, row = [], 0
    for p, suffix in clusters:
        prefix = [next(perm) for _ in range(p)]
        own = [[next(perm) for _ in range(-(-n // bs))] for n in suffix]
        tables += [prefix + t for t in own]
        cascade = DecodeCascade(row, row + len(suffix), torch.tensor(prefix) if p else None)
        for start, end in attention.plan_decode_groups(list(suffix)):
            width = -(-suffix[end - 1] // bs)
            rows = [t + [0] * (width - len(t)) for t in own[start:end]]
            valid = torch.arange(width * bs)[None, :] < torch.tensor(suffix[start:end])[:, None]
            cascade.groups.append(DecodeGroup(row + start, row + end, torch.tensor(rows), valid[None, :, None, :]))
        meta.decode_cascades.append(cascade)
        row += len(suffix)
    q = torch.randn(heads, len(lengths), d).to(dtype)
    scale = d**-0.5
    out = torch.empty(len(lengths), heads, d, dtype=dtype)
    attention._decode(q, pool.k[0], pool.v[0], meta, scale, out)
    for i, n in enumerate(lengths):
        slots = torch.tensor([b * bs + o for b in tables[i] for o in range(bs)][:n])
        ref = _dense_reference(q[:, i], pool.k[0][:, slots].transpose(0, 1), pool.v[0][:, slots].transpose(0, 1), scale)
        assert torch.allclose(out[i].double(), ref, atol=tol, rtol=tol), (i, (out[i].double() - ref).abs().max())


def test_decodes_cluster_by_the_physical_prefix_they_share():
    """Two copies of a system prompt (computed by requests admitted in the same step) give two
    cascades; rows sharing too little to be worth one are attended without a prefix."""
    from replica.model.step_inputs import _prefix_clusters

    def chunk(blocks, n, rid):
        seq = Sequence(list(range(n)), SamplingParams(), hash_seed=0, request_id=rid)
        seq.table.block_ids = blocks
        return ScheduledChunk(seq, n - 1, n)

    a = [chunk([1, 2, 3, 10 + i], 14 + i % 2, f"a{i}") for i in range(3)]  # copy 1: blocks 1, 2, 3
    b = [chunk([4, 5, 6, 20 + i], 15, f"b{i}") for i in range(3)]  # copy 2: blocks 4, 5, 6
    lone = [chunk([7, 8], 6, "lone"), chunk([9], 3, "short")]  # nothing shared / no full block yet
    clusters = _prefix_clusters([lone[0], b[0], a[0], lone[1], a[1], b[1], a[2], b[2]], 4)
    got = {tuple(c.seq.request_id for c in rows): shared for rows, shared in clusters}
    assert got == {("a0", "a2", "a1"): 3, ("b0", "b1", "b2"): 3, ("short", "lone"): 0}
    assert [shared for _, shared in clusters][-1] == 0  # the prefix-free rows come last
    two_rows_one_block = [chunk([1, 30], 6, "x"), chunk([1, 31], 6, "y")]  # saves 1 block read: not worth it
    assert _prefix_clusters(two_rows_one_block, 4) == [(two_rows_one_block, 0)]


def test_shared_prefix_is_found_and_bounded():
    """The runner finds the blocks all decodes share, never including a row's current token."""
    from replica.core.scheduler import ScheduledChunk
    from replica.core.sequence import Sequence
    from replica.model.step_inputs import _common_prefix_blocks

    def chunk(blocks, n):
        seq = Sequence(list(range(n)), SamplingParams(), hash_seed=0)
        seq.table.block_ids = blocks
        return ScheduledChunk(seq, n - 1, n)

    assert _common_prefix_blocks([chunk([1, 2, 3, 7], 14), chunk([1, 2, 3, 8], 13)], 4) == 3
    assert _common_prefix_blocks([chunk([1, 2, 9], 9), chunk([1, 2, 3, 8], 13)], 4) == 2
    assert _common_prefix_blocks([chunk([1, 2, 3], 12), chunk([1, 2, 3, 8], 13)], 4) == 2  # 12th token is current
    assert _common_prefix_blocks([chunk([5, 2], 8), chunk([1, 2], 8)], 4) == 0
    assert _common_prefix_blocks([chunk([1, 2, 3], 12)], 4) == 0  # one row: nothing to share


def _save(config, tmp_path) -> str:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    return str(tmp_path)


_SMALL = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
              num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256, head_dim=16)


@pytest.mark.slow
def test_softcapping_model_is_refused(tmp_path):
    from transformers import Gemma2Config

    path = _save(Gemma2Config(**_SMALL, attn_logit_softcapping=50.0), tmp_path)
    with pytest.raises(UnsupportedModelError, match="soft-capping"):
        LLMEngine(path, block_size=4, num_blocks=16)


def test_attention_sinks_are_refused(tmp_path):
    from transformers import GptOssConfig

    config = GptOssConfig(**_SMALL, num_local_experts=2, num_experts_per_tok=1, sliding_window=None,
                          layer_types=["full_attention"])
    path = _save(config, tmp_path)
    with pytest.raises(UnsupportedModelError, match="sinks"):
        LLMEngine(path, block_size=4, num_blocks=16)


@pytest.mark.slow
def test_sliding_window_shorter_than_the_context(tmp_path):
    from transformers import MistralConfig

    path = _save(MistralConfig(**_SMALL, sliding_window=64), tmp_path)
    with pytest.raises(UnsupportedModelError, match="max_model_len <= 64"):
        LLMEngine(path, block_size=4, num_blocks=16)
    engine = LLMEngine(path, block_size=4, num_blocks=64, max_model_len=64)  # the window never binds
    out = engine.generate([[5, 6, 7, 8, 9]], SamplingParams(max_tokens=20, ignore_eos=True))[0]
    assert len(out.token_ids) == 20 and engine.max_model_len == 64


@pytest.mark.slow
@pytest.mark.parametrize("d", [16, 64, 128])  # the generic function and the two of fixed head size
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_cpu_decode_kernel_matches_dense_attention(dtype, tol, d):
    """replica/kernels/cpu_attention.c against dense attention, 4 query heads per KV head (8 rows make a
    full chunk of 32 queries): rows of mixed lengths over scattered blocks, one of a single token;
    then rows that all start with the same two blocks (read once per chunk), one of exactly those
    two blocks, ten rows so a second chunk follows."""
    from replica.kernels import cpu_attention

    assert cpu_attention.library() is not None, "scripts/bootstrap.sh installs the C compiler it is built with"
    torch.manual_seed(1)
    _check_decode_kernel(dtype, tol, d, [1, 3, 4, 9, 17, 64, 201], sharing=[False] * 4 + [True] * 3)
    _check_decode_kernel(dtype, tol, d, [8, 16, 17, 64, 201, 9, 12, 40, 33, 100], sharing=[True] * 10)


def _check_decode_kernel(dtype, tol, d, lengths: list[int], sharing: list[bool]) -> None:
    from replica.kernels import cpu_attention

    bs, heads, kv_heads = 4, 8, 2
    pool = KVPool.allocate(1, 300 * bs, kv_heads, d, dtype, "cpu")
    pool.k.normal_()
    pool.v.normal_()
    free = iter(torch.randperm(300).tolist())
    shared = [next(free), next(free)]  # the rows marked sharing start with these two blocks
    tables = [(shared if s else []) + [next(free) for _ in range(-(-n // bs) - (2 if s else 0))]
              for n, s in zip(lengths, sharing, strict=True)]
    flat = torch.tensor([b for t in tables for b in t])
    offsets = torch.tensor([0] + [len(t) for t in tables]).cumsum(0)
    q = torch.randn(len(lengths), heads, d).to(dtype)
    out = torch.empty(len(lengths), heads, d, dtype=dtype)
    scale = d**-0.5
    assert cpu_attention.supports(pool.k[0], heads, bs)
    cpu_attention.decode(q, pool.k[0], pool.v[0], flat, offsets, torch.tensor(lengths), bs, scale, out)
    for i, n in enumerate(lengths):
        slots = torch.tensor([b * bs + o for b in tables[i] for o in range(bs)][:n])
        ref = _dense_reference(q[i], pool.k[0][:, slots].transpose(0, 1), pool.v[0][:, slots].transpose(0, 1), scale)
        assert torch.allclose(out[i].double(), ref, atol=tol, rtol=tol), (i, (out[i].double() - ref).abs().max())


def test_cpu_decode_kernel_refuses_other_index_types():
    from replica.kernels import cpu_attention

    pool = KVPool.allocate(1, 8, 1, 16, torch.float32, "cpu")
    q, out = torch.randn(1, 1, 16), torch.empty(1, 1, 16)
    with pytest.raises(ValueError, match="int64"):
        cpu_attention.decode(q, pool.k[0], pool.v[0], torch.tensor([0], dtype=torch.int32), torch.tensor([0, 1]),
                             torch.tensor([3]), 4, 0.25, out)


@pytest.mark.slow
def test_engines_stepping_on_their_own_threads_keep_their_own_steps(tiny_model_dirs):
    """The step's metadata is per thread: two engines of one process, each stepping on its own
    thread (as AsyncLLMEngine does), give the tokens each gives alone."""
    import threading

    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14], [5, 6, 7, 8, 20]]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    engines = {f: LLMEngine(tiny_model_dirs[f], block_size=4, num_blocks=64) for f in ("llama", "qwen2")}
    alone = {f: [o.token_ids for o in e.generate(prompts, params)] for f, e in engines.items()}
    for e in engines.values():
        e.blocks.clear_cache()
    together: dict[str, list[list[int]]] = {}
    start = threading.Barrier(len(engines))

    def run(family: str) -> None:
        start.wait(timeout=60)
        together[family] = [o.token_ids for o in engines[family].generate(prompts, params)]

    threads = [threading.Thread(target=run, args=(f,)) for f in engines]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert together == alone
