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
    Sampler._apply_penalties(scores, rows)
    expected = logits.clone()
    expected[0, 4] -= 0.5 * 3 + 0.25
    expected[0, 7] -= 0.5 * 1 + 0.25  # prompt tokens 1, 2, 3 are not penalised
    expected[1, 9] += 1.0
    assert torch.allclose(scores, expected)


def test_repetition_penalty_follows_vllm_over_prompt_and_output():
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0, 0.5]])
    row = Row("a", SamplingParams(repetition_penalty=2.0), prompt_token_ids=[0, 1], output_token_ids=[3])
    scores = logits.clone()
    Sampler._apply_penalties(scores, [row])
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
    Sampler()._apply_logit_bias(scores, rows, [0])
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
