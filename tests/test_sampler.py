"""The batched sampler's math on made-up logits: the same distributions as the per-row sampler it
replaced, per-request seeds, OpenAI/vLLM penalties, raw logprobs, and grammar masks."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import pytest
import torch

from replica.model.sampler import Sampler, probabilities
from router.protocol.sampling import SamplingParams


@dataclass
class Row:
    request_id: str
    params: SamplingParams
    prompt_token_ids: list[int] = field(default_factory=lambda: [0])
    output_token_ids: list[int] = field(default_factory=list)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)


def reference_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The per-row float64 algorithm the sampler used before it was batched."""
    scores = logits.double() / p.temperature
    if 0 < p.top_k < scores.numel():
        kth = torch.topk(scores, p.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        drop = sorted_probs.cumsum(0) - sorted_probs > p.top_p
        sorted_probs[drop] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return probs


CASES = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.3),
    SamplingParams(temperature=1.7, top_k=5),
    SamplingParams(temperature=0.8, top_p=0.5),
    SamplingParams(temperature=1.2, top_k=40, top_p=0.9),
    SamplingParams(temperature=1.0, top_k=1),
    SamplingParams(temperature=1.0, top_k=10_000),  # larger than the vocabulary: no cut
]


def test_distributions_match_the_per_row_reference():
    torch.manual_seed(0)
    logits = torch.randn(len(CASES), 300) * 3
    batched = probabilities(logits, CASES)
    for i, p in enumerate(CASES):
        ref = reference_probs(logits[i], p).float()
        assert torch.allclose(batched[i], ref, atol=1e-6), p
        assert int((batched[i] > 0).sum()) == int((ref > 0).sum()), p  # the same tokens survive the cuts


def test_greedy_rows_take_the_argmax_next_to_sampled_rows():
    torch.manual_seed(1)
    logits = torch.randn(6, 500)
    rows = [Row(f"r{i}", SamplingParams(temperature=0.0 if i % 2 == 0 else 1.0, seed=i)) for i in range(6)]
    out = Sampler().sample(logits, rows)
    for i in range(0, 6, 2):
        assert out.token_ids[i] == int(logits[i].argmax())
    assert out.logprobs == [None] * 6


def test_seeded_rows_repeat_whatever_shares_the_batch():
    torch.manual_seed(2)
    logits = torch.randn(1, 1000)
    alone = Sampler()
    solo = [alone.sample(logits, [Row("a", SamplingParams(temperature=1.0, seed=7))]).token_ids[0] for _ in range(20)]
    mixed = Sampler()
    got = []
    for step in range(20):
        rows = [Row("x", SamplingParams(temperature=1.0)), Row("a", SamplingParams(temperature=1.0, seed=7)),
                Row(f"y{step}", SamplingParams(temperature=0.5, seed=step))]
        got.append(mixed.sample(logits.repeat(3, 1), rows).token_ids[1])
    assert got == solo
    other = Sampler()
    assert [other.sample(logits, [Row("b", SamplingParams(temperature=1.0, seed=8))]).token_ids[0] for _ in range(20)] != solo


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.9, top_k=5),  # candidates path
                                    SamplingParams(temperature=1.3, top_p=0.97)],  # whole-vocabulary path
                         ids=["top_k", "top_p"])
def test_draws_follow_the_distribution(params):
    """4000 unseeded draws of a 6-token distribution: each frequency within 5 standard errors."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    n = 4000
    out = Sampler().sample(logits.repeat(n, 1), [Row(f"r{i}", params) for i in range(n)])
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=6).double() / n
    expected = probabilities(logits, [params])[0].double()
    assert expected[5] == 0 and counts[5] == 0  # cut by top-k / top-p
    se = (expected * (1 - expected) / n).sqrt()
    assert bool(((counts - expected).abs() <= 5 * se + 1e-9).all()), (counts, expected)


def test_frequency_and_presence_penalties_follow_openai():
    vocab = 10
    logits = torch.linspace(-1, 1, vocab).repeat(2, 1)
    rows = [
        Row("a", SamplingParams(frequency_penalty=0.5, presence_penalty=0.25), [1, 2, 3], [4, 4, 4, 7]),
        Row("b", SamplingParams(presence_penalty=-1.0), [1], [9]),
    ]
    scores = logits.clone()
    Sampler()._apply_penalties(scores, rows)
    expected = logits.clone()
    expected[0, 4] -= 0.5 * 3 + 0.25
    expected[0, 7] -= 0.5 * 1 + 0.25  # prompt tokens 1, 2, 3 are not penalised
    expected[1, 9] += 1.0
    assert torch.allclose(scores, expected)


def test_repetition_penalty_follows_vllm_over_prompt_and_output():
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0, 0.5]])
    row = Row("a", SamplingParams(repetition_penalty=2.0), prompt_token_ids=[0, 1], output_token_ids=[3])
    scores = logits.clone()
    Sampler()._apply_penalties(scores, [row])
    assert scores.tolist() == [[1.0, -4.0, 1.0, -2.0, 0.5]]


def test_penalty_changes_the_greedy_choice():
    logits = torch.tensor([[3.0, 2.9, 0.0]])
    plain = Row("a", SamplingParams(), [2], [0, 0])
    penalised = Row("b", SamplingParams(frequency_penalty=0.2), [2], [0, 0])
    out = Sampler().sample(logits.repeat(2, 1), [plain, penalised])
    assert out.token_ids == [0, 1]


def test_logprobs_are_the_raw_log_softmax():
    torch.manual_seed(3)
    logits = torch.randn(3, 200) * 4
    rows = [Row("a", SamplingParams(logprobs=5, temperature=0.7, seed=1, frequency_penalty=1.0), [0], [5, 6]),
            Row("b", SamplingParams()),
            Row("c", SamplingParams(logprobs=0))]
    out = Sampler().sample(logits, rows)
    raw = torch.log_softmax(logits, dim=-1)
    assert out.logprobs[1] is None
    for i in (0, 2):
        lp = out.logprobs[i]
        assert lp.token_id == out.token_ids[i]
        assert abs(lp.logprob - float(raw[i, lp.token_id])) < 1e-5
        assert len(lp.top) == rows[i].params.logprobs
    top_ids = [t for t, _ in out.logprobs[0].top]
    assert top_ids == raw[0].topk(5).indices.tolist()
    assert all(abs(v - float(raw[0, t])) < 1e-5 for t, v in out.logprobs[0].top)


def test_logit_bias_is_added_to_its_rows_logits_only():
    """OpenAI's logit_bias: +100 makes a token the greedy choice, -100 removes the argmax; rows
    without a bias are untouched, ids past the vocabulary are skipped, logprobs stay raw."""
    torch.manual_seed(4)
    logits = torch.randn(3, 50)
    best = int(logits[0].argmax())
    second = int(logits[2].topk(2).indices[1])
    rows = [Row("up", SamplingParams(logit_bias={7: 100.0, 10_000: 5.0}, logprobs=1)),
            Row("plain", SamplingParams()),
            Row("down", SamplingParams(logit_bias={int(logits[2].argmax()): -100.0}))]
    out = Sampler().sample(logits, rows)
    assert out.token_ids == [7, int(logits[1].argmax()), second]
    assert best != 7 and out.logprobs[0].top[0][0] == best  # raw: the model's own ranking
    assert abs(out.logprobs[0].logprob - float(torch.log_softmax(logits[0], -1)[7])) < 1e-5
    scores = logits.clone()
    sampler = Sampler()
    sampler._apply_logit_bias(scores, sampler._scan(rows)[0], [0])
    expected = logits.clone()
    expected[0, 7] += 100.0
    assert torch.equal(scores, expected)


@pytest.mark.parametrize("bias", [{1: 100.5}, {-1: 1.0}, {True: 1.0}, {1: float("nan")}, {i: 1.0 for i in range(1025)}],
                         ids=["above 100", "negative id", "bool id", "nan", "too many"])
def test_logit_bias_out_of_range_is_refused_naming_it(bias):
    from router.protocol.sampling import InvalidParam

    with pytest.raises(InvalidParam) as e:
        SamplingParams(logit_bias=bias)
    assert e.value.param == "logit_bias"


def test_token_counts_ignore_padding():
    from replica.model.sampler import _token_counts

    counts = _token_counts([[1, 1, 2], [], [0]], 3, 4, torch.device("cpu"))
    assert counts.tolist() == [[0, 2, 1, 0], [0, 0, 0, 0], [1, 0, 0, 0]]


# ---- grammars (the real tokenizer; no model weights) -----------------------------------------
@pytest.fixture(scope="module")
def grammars(default_model_dir):
    from transformers import AutoConfig, AutoTokenizer

    from replica.model.constrained import Grammars

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    vocab = AutoConfig.from_pretrained(default_model_dir).vocab_size
    return Grammars(tokenizer, vocab, [tokenizer.eos_token_id]), tokenizer, vocab


SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]},
                   "n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["ok", "color", "n"],
}


@pytest.mark.slow
def test_grammar_mask_makes_random_logits_produce_valid_json(grammars):
    import jsonschema

    g, tokenizer, vocab = grammars
    sampler = Sampler(g)
    fmt = {"type": "json_schema", "schema": SCHEMA}
    rows = [Row(f"j{i}", SamplingParams(temperature=1.0, seed=i, response_format=fmt)) for i in range(4)]
    rows.append(Row("free", SamplingParams(temperature=1.0, seed=99)))
    for r in rows:
        sampler.add(r)
    gen = torch.Generator().manual_seed(0)
    for _ in range(60):  # bounded: these outputs are a few dozen tokens at most
        live = [r for r in rows[:4] if tokenizer.eos_token_id not in r.output_token_ids] + [rows[4]]
        if len(live) == 1:
            break
        out = sampler.sample(torch.randn(len(live), vocab, generator=gen), live)
        for r, t in zip(live, out.token_ids, strict=True):
            r.output_token_ids.append(t)
    for r in rows[:4]:
        assert r.output_token_ids[-1] == tokenizer.eos_token_id, r.output_token_ids
        doc = json.loads(tokenizer.decode(r.output_token_ids[:-1]))
        jsonschema.validate(doc, SCHEMA)
    assert g.compilations == 1  # four requests, one schema, one compilation
    sampler.forget("j0")
    assert "j0" not in sampler._matchers


def test_unsupported_schema_is_refused_at_add(grammars):
    from replica.model.constrained import GrammarError

    g, _, _ = grammars
    bad = {"type": "json_schema", "schema": {"type": "string", "pattern": "(?<=a)b"}}
    with pytest.raises(GrammarError, match="not supported"):
        Sampler(g).add(Row("x", SamplingParams(response_format=bad)))


def test_degenerate_rows_fall_back_to_argmax_without_failing_the_batch():
    logits = torch.randn(3, 50)
    logits[0] = float("nan")
    logits[1] = float("-inf")
    rows = [Row(f"d{i}", SamplingParams(temperature=1.0, seed=i, top_k=5 if i == 1 else 0)) for i in range(3)]
    out = Sampler().sample(logits, rows)
    assert out.token_ids[0] == int(logits[0].argmax()) and out.token_ids[1] == int(logits[1].argmax())
    assert 0 <= out.token_ids[2] < 50


# ---- the fast path, incremental penalties, one copy per step ---------------------------------
def _seeded_sampler(seed: int = 0) -> Sampler:
    """A sampler whose unseeded draws are reproducible (its shared generator, fixed)."""
    sampler = Sampler()
    sampler._shared["cpu"] = torch.Generator().manual_seed(seed)
    return sampler


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_fast_path_draws_follow_the_distribution(temperature):
    """The common batch (temperature only, unseeded) skips softmax and the noise tensor: 4000
    draws of a 6-token distribution, each frequency within 5 standard errors; greedy rows in the
    same batch still take the argmax."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, float("-inf")]])
    n = 4000
    params = SamplingParams(temperature=temperature)
    rows = [Row(f"r{i}", params if i % 10 else SamplingParams()) for i in range(n)]
    out = _seeded_sampler().sample(logits.repeat(n, 1), rows)
    assert all(out.token_ids[i] == 0 for i in range(0, n, 10))
    drawn = torch.tensor([t for i, t in enumerate(out.token_ids) if i % 10])
    counts = torch.bincount(drawn, minlength=6).double() / len(drawn)
    expected = probabilities(logits, [params])[0].double()
    assert counts[5] == 0  # an impossible token is never drawn
    se = (expected * (1 - expected) / len(drawn)).sqrt()
    assert bool(((counts - expected).abs() <= 5 * se + 1e-9).all()), (counts, expected)


def test_fast_path_is_exact_where_the_distribution_is_a_point():
    """A row with one finite logit always draws it; all-NaN and all -inf rows fall back to the
    argmax, as the full path does."""
    logits = torch.full((4, 30), float("-inf"))
    logits[0, 17] = 3.0
    logits[1] = float("nan")
    logits[3, 4] = -50.0
    rows = [Row(f"p{i}", SamplingParams(temperature=1.5)) for i in range(4)]
    sampler = _seeded_sampler()
    for _ in range(20):
        out = sampler.sample(logits, rows)
        assert out.token_ids == [17, int(logits[1].argmax()), int(logits[2].argmax()), 4]


def reference_penalties(logits: torch.Tensor, rows: list[Row]) -> torch.Tensor:
    """The rebuild-every-step algorithm the pool replaced: counts from the whole output."""
    from replica.model.sampler import _token_counts

    vocab = logits.shape[-1]
    counts = _token_counts([r.output_token_ids for r in rows], len(rows), vocab, logits.device)
    seen = (counts > 0) | (_token_counts([r.prompt_token_ids for r in rows], len(rows), vocab, logits.device) > 0)
    rep = torch.tensor([r.params.repetition_penalty for r in rows]).unsqueeze(1)
    freq = torch.tensor([r.params.frequency_penalty for r in rows]).unsqueeze(1)
    pres = torch.tensor([r.params.presence_penalty for r in rows]).unsqueeze(1)
    out = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    return out - freq * counts - pres * (counts > 0).float()


def test_incremental_penalty_counts_equal_the_rebuilt_ones():
    """Counts kept on the device step by step (a migrated stream's output replayed once, a step
    whose token was not appended replayed again) give the same scores as rebuilding them from
    the whole output every step; forget() frees the request's slot."""
    from replica.model.sampler import _token_counts

    vocab = 40
    rows = [Row("mig", SamplingParams(temperature=1.0, seed=3, frequency_penalty=0.7, repetition_penalty=1.3),
                [1, 2, 3], [5, 5, 9, 1]),  # migrated: four tokens generated elsewhere
            Row("new", SamplingParams(temperature=0.8, presence_penalty=0.4, frequency_penalty=-0.2), [7, 7]),
            Row("plain", SamplingParams(temperature=1.0))]
    sampler = _seeded_sampler(1)
    gen = torch.Generator().manual_seed(5)
    for step in range(25):
        logits = torch.randn(3, vocab, generator=gen) * 2
        scores = logits[:2].clone()
        sampler._apply_penalties(scores, rows[:2])
        assert torch.allclose(scores, reference_penalties(logits[:2], rows[:2]), atol=1e-6), step
        out = sampler.sample(logits, rows)
        for r, t in zip(rows, out.token_ids, strict=True):
            if not (r.request_id == "new" and step == 10):  # this step's token is dropped
                r.output_token_ids.append(t)
        for r in rows[:2]:
            q = sampler._requests[r.request_id]
            if q.counted == r.num_output_tokens:
                expected = _token_counts([r.output_token_ids], 1, vocab, logits.device)[0]
                assert torch.equal(sampler._penalties.counts[q.slot], expected), (step, r.request_id)
    slot = sampler._requests["mig"].slot
    sampler.forget("mig")
    assert "mig" not in sampler._requests and slot in sampler._penalties.free


def test_penalised_tokens_match_a_rebuilding_sampler():
    """Greedy rows under penalties: the same tokens step after step as penalties computed from
    the rebuilt counts (deterministic, so exactly)."""
    vocab = 12
    params = SamplingParams(frequency_penalty=0.3, presence_penalty=0.2, repetition_penalty=1.5)
    row = Row("g", params, [0, 1], [2])
    ref = Row("g", params, [0, 1], [2])
    sampler = Sampler()
    gen = torch.Generator().manual_seed(9)
    for _ in range(30):
        logits = torch.randn(1, vocab, generator=gen)
        token = sampler.sample(logits, [row]).token_ids[0]
        assert token == int(reference_penalties(logits, [ref]).argmax())
        row.output_token_ids.append(token)
        ref.output_token_ids.append(token)


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    logits = torch.zeros(2, 10)
    logits[:, 9] = 50.0  # eos
    logits[:, 8] = 40.0  # a stop token of row 0
    sampler = Sampler(eos_token_ids=[9])
    rows = [Row("a", SamplingParams(min_tokens=2, stop_token_ids=[8])),
            Row("b", SamplingParams(min_tokens=1, ignore_eos=True))]
    assert sampler.sample(logits, rows).token_ids == [int(logits[0, :8].argmax()), 9]
    rows[0].output_token_ids.append(0)
    assert sampler.sample(logits, rows).token_ids[0] == int(logits[0, :8].argmax())
    rows[0].output_token_ids.append(0)
    assert sampler.sample(logits, rows).token_ids[0] == 9


def test_a_seeded_top_k_row_ignores_a_wider_neighbour():
    """A seeded row's noise covers its own top-k candidates, not the widest cut in the batch."""
    torch.manual_seed(6)
    logits = torch.randn(1, 300)
    params = SamplingParams(temperature=1.0, top_k=5, seed=11)
    alone = Sampler()
    solo = [alone.sample(logits, [Row("a", params)]).token_ids[0] for _ in range(15)]
    mixed = Sampler()
    wide = Row("w", SamplingParams(temperature=1.0, top_k=200, seed=2))
    got = [mixed.sample(logits.repeat(2, 1), [wide, Row("a", params)]).token_ids[1] for _ in range(15)]
    assert got == solo


COPIES = ("tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")


@pytest.fixture
def host_copies(monkeypatch):
    """Counts every way a tensor's values reach Python (each a device-to-host copy on a GPU)."""
    calls: list[str] = []
    for name in COPIES:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, _name=name, **kwargs):
            calls.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    return calls


def test_one_device_to_host_copy_per_step(host_copies):
    torch.manual_seed(7)
    vocab = 64
    common = [Row(f"c{i}", SamplingParams(temperature=0.5 + i / 10)) for i in range(6)] + [Row("g", SamplingParams())]
    mixed = [Row("pen", SamplingParams(temperature=1.0, frequency_penalty=0.5, repetition_penalty=1.1), [1], [2, 2]),
             Row("bias", SamplingParams(temperature=0.7, logit_bias={3: 2.0, 4: -1.0})),
             Row("lp", SamplingParams(temperature=0.0, logprobs=4)),
             Row("lp0", SamplingParams(temperature=1.0, logprobs=0, seed=1)),
             Row("min", SamplingParams(temperature=1.0, min_tokens=3, stop_token_ids=[5])),
             Row("topk", SamplingParams(temperature=1.0, top_k=8)),
             Row("topp", SamplingParams(temperature=1.0, top_p=0.7, seed=4)),
             Row("plain", SamplingParams(temperature=1.0))]
    sampler = Sampler(eos_token_ids=[0])
    for rows in (common, mixed, common + mixed):
        for _ in range(3):
            host_copies.clear()
            out = sampler.sample(torch.randn(len(rows), vocab), rows)
            assert host_copies == ["tolist"], host_copies
            for r, t in zip(rows, out.token_ids, strict=True):
                r.output_token_ids.append(t)
    assert out.logprobs[len(common) + 2].top[0][0] == out.token_ids[len(common) + 2]  # greedy: its own best
