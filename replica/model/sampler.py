"""Next-token choice for a whole batch on the logits' device.

Per step: raw log-softmax for the requests that asked for logprobs (vLLM's default "raw"
logprobs: the model's own distribution, before any bias, penalty, temperature or mask),
logit_bias, min_tokens' masks, the grammar bitmask of constrained requests, penalties, then
greedy argmax or temperature / top-k / top-p sampling. Every row is handled by batched tensor ops; the only device-to-host copy is the one
`tolist()` of the results at the end. Seeded requests draw their noise from their own
torch.Generator, so a request's tokens do not depend on what else shares the batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from replica.model.constrained import GrammarMatcher, Grammars, allocate_bitmask, apply_bitmask
from router.protocol.sampling import SamplingParams

LOGPROB_FLOOR = -9999.0  # JSON has no -inf; OpenAI and vLLM report this for impossible tokens


class Row(Protocol):
    """What the sampler reads of a request (replica.core.sequence.Sequence has all of it)."""

    request_id: str
    params: SamplingParams
    prompt_token_ids: list[int]

    @property
    def output_token_ids(self) -> list[int]: ...

    @property
    def num_output_tokens(self) -> int: ...


@dataclass
class TokenLogprob:
    """The chosen token's raw logprob and the `k` most likely tokens (id, logprob), best first."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]  # per row; None where the request did not ask


class Sampler:
    def __init__(self, grammars: Grammars | None = None, eos_token_ids: list[int] | tuple[int, ...] = ()) -> None:
        self.grammars = grammars
        self.eos_token_ids = list(eos_token_ids)  # masked, with stop_token_ids, before min_tokens
        self._generators: dict[str, torch.Generator] = {}
        self._matchers: dict[str, GrammarMatcher] = {}
        self._device_generators: dict[tuple[str, str], torch.Generator] = {}
        self._shared: dict[str, torch.Generator] = {}
        self._biases: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # logit_bias ids and values, per request

    # ---- per-request state ---------------------------------------------------------------
    def add(self, row: Row) -> None:
        """Set up a request's grammar before it is scheduled: a schema that cannot compile is
        refused here (GrammarError, a ValueError), never in the middle of a batch."""
        p = row.params
        if not p.constrained:
            return
        if self.grammars is None:
            raise ValueError("response_format is not available on this engine")
        matcher = self.grammars.matcher(p.response_format)
        for token in row.output_token_ids:  # a migrated stream: replay what was already generated
            matcher.accept(token)
        self._matchers[row.request_id] = matcher

    def forget(self, request_id: str) -> None:
        self._generators.pop(request_id, None)
        self._matchers.pop(request_id, None)
        self._biases.pop(request_id, None)

    def _generator(self, request_id: str, seed: int, device: torch.device) -> torch.Generator:
        gen = self._generators.get(request_id)
        if gen is None:
            gen = self._generators[request_id] = torch.Generator(device=device).manual_seed(seed)
        return gen

    def _shared_generator(self, device: torch.device) -> torch.Generator:
        gen = self._shared.get(str(device))
        if gen is None:
            gen = self._shared[str(device)] = torch.Generator(device=device)
            gen.seed()
        return gen

    # ---- the step ------------------------------------------------------------------------
    def sample(self, logits: torch.Tensor, rows: list[Row]) -> SamplerOutput:
        """logits: [N, V] on any device and dtype; one row per request, in order."""
        n = len(rows)
        params = [r.params for r in rows]
        logits = logits.float()
        want_lp = [i for i, p in enumerate(params) if p.logprobs is not None]
        raw_lp = torch.log_softmax(logits[want_lp], dim=-1) if want_lp else None

        # masks and penalties write in place: never into the runner's own output
        early = [i for i, r in enumerate(rows) if r.num_output_tokens < r.params.min_tokens]
        biased = [i for i, p in enumerate(params) if p.logit_bias]
        scores = logits.clone() if early or biased or any(p.penalized or p.constrained for p in params) else logits
        self._apply_logit_bias(scores, rows, biased)
        self._apply_min_tokens(scores, rows, early)
        self._apply_grammar(scores, rows)
        self._apply_penalties(scores, rows)

        tokens = scores.argmax(dim=-1)
        sampled = [i for i, p in enumerate(params) if not p.greedy]
        if sampled:
            idx = torch.tensor(sampled, device=scores.device)
            chosen = self._sample_rows(scores[idx], [rows[i] for i in sampled], tokens[idx])
            tokens = tokens.index_copy(0, idx, chosen)

        lp_rows: list[TokenLogprob | None] = [None] * n
        if raw_lp is not None:
            lp_idx = torch.tensor(want_lp, device=scores.device)
            chosen_lp = raw_lp.gather(1, tokens[lp_idx].unsqueeze(1)).squeeze(1)
            k = max(params[i].logprobs for i in want_lp)
            top_lp, top_ids = raw_lp.topk(k, dim=-1) if k else (raw_lp[:, :0], raw_lp[:, :0].long())
            token_list, chosen_list, top_lp_list, top_id_list = (
                tokens.tolist(), chosen_lp.tolist(), top_lp.tolist(), top_ids.tolist()
            )
            for j, i in enumerate(want_lp):
                kk = params[i].logprobs
                lp_rows[i] = TokenLogprob(
                    token_list[i], finite_logprob(chosen_list[j]),
                    [(t, finite_logprob(v)) for t, v in zip(top_id_list[j][:kk], top_lp_list[j][:kk], strict=True)],
                )
        else:
            token_list = tokens.tolist()
        for row, token in zip(rows, token_list, strict=True):
            matcher = self._matchers.get(row.request_id)
            if matcher is not None:
                matcher.accept(token)
        return SamplerOutput(token_list, lp_rows)

    def _apply_logit_bias(self, scores: torch.Tensor, rows: list[Row], biased: list[int]) -> None:
        """OpenAI's logit_bias: each listed token's bias added to its logit (ids past this
        model's vocabulary were refused at the gateway; here they are skipped). A request's ids
        and values become tensors on its first step, not on every step."""
        for i in biased:
            bias = self._biases.get(rows[i].request_id)
            if bias is None:
                items = [(t, b) for t, b in rows[i].params.logit_bias.items() if t < scores.shape[-1]]
                bias = self._biases[rows[i].request_id] = (
                    torch.tensor([t for t, _ in items], dtype=torch.long, device=scores.device),
                    torch.tensor([b for _, b in items], dtype=scores.dtype, device=scores.device))
            scores[i].index_add_(0, *bias)

    def _apply_min_tokens(self, scores: torch.Tensor, rows: list[Row], early: list[int]) -> None:
        """vLLM's min_tokens: until a request has that many tokens, its end-of-sequence ids (unless
        ignore_eos) and stop_token_ids cannot be chosen."""
        for i in early:
            p = rows[i].params
            banned = list(p.stop_token_ids) + ([] if p.ignore_eos else self.eos_token_ids)
            banned = [t for t in banned if 0 <= t < scores.shape[-1]]
            if banned:
                scores[i, banned] = float("-inf")

    def _apply_grammar(self, scores: torch.Tensor, rows: list[Row]) -> None:
        constrained = [i for i, r in enumerate(rows) if r.request_id in self._matchers]
        if not constrained:
            return
        bitmask = allocate_bitmask(len(rows), scores.shape[-1])
        live = []
        for i in constrained:
            matcher = self._matchers[rows[i].request_id]
            if not matcher.done:
                matcher.fill(bitmask, i)
                live.append(i)
        if live:
            apply_bitmask(scores, bitmask, live)

    @staticmethod
    def _apply_penalties(scores: torch.Tensor, rows: list[Row]) -> None:
        which = [i for i, r in enumerate(rows) if r.params.penalized]
        if not which:
            return
        device, vocab = scores.device, scores.shape[-1]
        idx = torch.tensor(which, device=device)
        sub = scores[idx]
        outputs = [rows[i].output_token_ids for i in which]
        counts = _token_counts(outputs, len(which), vocab, device)
        rep = torch.tensor([rows[i].params.repetition_penalty for i in which], device=device).unsqueeze(1)
        if any(rows[i].params.repetition_penalty != 1.0 for i in which):
            seen = counts > 0
            prompts = [rows[i].prompt_token_ids for i in which]
            seen |= _token_counts(prompts, len(which), vocab, device) > 0
            penalized = torch.where(sub > 0, sub / rep, sub * rep)
            sub = torch.where(seen, penalized, sub)
        freq = torch.tensor([rows[i].params.frequency_penalty for i in which], device=device).unsqueeze(1)
        pres = torch.tensor([rows[i].params.presence_penalty for i in which], device=device).unsqueeze(1)
        sub = sub - freq * counts - pres * (counts > 0).float()
        scores[idx] = sub

    def _sample_rows(self, scores: torch.Tensor, rows: list[Row], argmax: torch.Tensor) -> torch.Tensor:
        """Temperature, top-k, top-p, then one draw per row. Rows with a top-k cut work on their
        best candidates only (one topk, already sorted for top-p); the others on the vocabulary."""
        params = [r.params for r in rows]
        out = torch.empty(len(rows), dtype=torch.long, device=scores.device)
        for group in _groups(params, scores.shape[-1]):
            idx = torch.tensor(group, device=scores.device)
            sub = scores[idx]
            probs, ids = _distribution(sub, [params[j] for j in group])
            pos = self._draw(probs, [rows[j] for j in group])
            chosen = ids.gather(1, pos.unsqueeze(1)).squeeze(1) if ids is not None else pos
            # a degenerate distribution (all masked: NaN, or nothing left) must not fail the step:
            # its draw has no positive probability, and the row falls back to the argmax
            ok = probs.gather(1, pos.unsqueeze(1)).squeeze(1) > 0
            out[idx] = torch.where(ok, chosen, argmax[idx])
        return out

    def _draw(self, probs: torch.Tensor, rows: list[Row]) -> torch.Tensor:
        """Exponential race: argmax(p / q), q ~ Exp(1), picks index t with probability p_t, and
        lets every seeded row draw its q from its own generator."""
        device = probs.device
        noise = torch.empty_like(probs)
        seeded = [j for j, r in enumerate(rows) if r.params.seed is not None]
        unseeded = [j for j, r in enumerate(rows) if r.params.seed is None]
        if unseeded:
            shared = torch.empty((len(unseeded), probs.shape[1]), device=device, dtype=probs.dtype)
            shared.exponential_(generator=self._shared_generator(device))
            noise[torch.tensor(unseeded, device=device)] = shared
        for j in seeded:
            noise[j].exponential_(generator=self._generator(rows[j].request_id, rows[j].params.seed, device))
        noise.clamp_(min=torch.finfo(noise.dtype).tiny)  # a drawn 0 would make 0/0 = NaN win argmax
        return torch.div(probs, noise, out=noise).argmax(dim=-1)


def probabilities(scores: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The [N, V] distribution each row is drawn from (after temperature, top-k, top-p), computed
    by the sampler's own code path: for tests."""
    scores = scores.float()
    out = torch.zeros_like(scores)
    for group in _groups(params, scores.shape[-1]):
        idx = torch.tensor(group, device=scores.device)
        probs, ids = _distribution(scores[idx], [params[j] for j in group])
        out[idx] = probs if ids is None else torch.zeros_like(scores[idx]).scatter_(1, ids, probs)
    return out


def _groups(params: list[SamplingParams], vocab: int) -> list[list[int]]:
    """Row indices with a top-k cut, and those without (each group handled in one batch)."""
    cut = [j for j, p in enumerate(params) if 0 < p.top_k < vocab]
    full = [j for j, p in enumerate(params) if not 0 < p.top_k < vocab]
    return [g for g in (cut, full) if g]


def _distribution(scores: torch.Tensor, params: list[SamplingParams]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(probs, ids): rows that all have a top-k cut get probabilities over their kmax best
    candidates (ids maps them back to tokens); rows without get them over the vocabulary (ids None)."""
    device, vocab = scores.device, scores.shape[-1]
    temps = torch.tensor([p.temperature for p in params], device=device).unsqueeze(1)
    ks = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    if all(ks):
        values, ids = scores.topk(max(ks), dim=-1)  # sorted, best first
        beyond = torch.arange(values.shape[1], device=device).unsqueeze(0) >= torch.tensor(ks, device=device).unsqueeze(1)
        probs = torch.softmax(values.masked_fill(beyond, float("-inf")) / temps, dim=-1)
        return _top_p_sorted(probs, params), ids
    probs = torch.softmax(scores / temps, dim=-1)
    if all(p.top_p >= 1.0 for p in params):
        return probs, None
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    return torch.zeros_like(probs).scatter_(1, order, _top_p_sorted(sorted_probs, params)), None


def _top_p_sorted(probs: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Keep each row's smallest set of most likely tokens whose mass reaches top_p (rows sorted
    best first)."""
    if all(p.top_p >= 1.0 for p in params):
        return probs
    # rows without a cut get an infinite threshold: a float32 cumsum can pass 1.0 by rounding
    cut = [p.top_p if p.top_p < 1.0 else float("inf") for p in params]
    top_p = torch.tensor(cut, device=probs.device, dtype=probs.dtype).unsqueeze(1)
    return probs.masked_fill(probs.cumsum(dim=-1) - probs > top_p, 0.0)


def _token_counts(seqs: list[list[int]], rows: int, vocab: int, device: torch.device) -> torch.Tensor:
    """[rows, vocab] float counts of each token id in each row's list (one host-to-device copy)."""
    counts = torch.zeros((rows, vocab), device=device)
    longest = max((len(s) for s in seqs), default=0)
    if longest == 0:
        return counts
    ids = torch.full((rows, longest), vocab, dtype=torch.long)  # padding goes to a spare column
    for r, s in enumerate(seqs):
        if s:
            ids[r, : len(s)] = torch.tensor(s, dtype=torch.long)
    ids = ids.to(device)
    padded = torch.zeros((rows, vocab + 1), device=device)
    padded.scatter_add_(1, ids, torch.ones_like(ids, dtype=padded.dtype))
    return padded[:, :vocab]


def finite_logprob(x: float) -> float:
    """A logprob as JSON can carry it: -inf (an impossible token) and NaN become LOGPROB_FLOOR."""
    return x if x > LOGPROB_FLOOR else LOGPROB_FLOOR
