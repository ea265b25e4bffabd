"""Next-token choice for a whole batch on the logits' device.

Per step: raw log-softmax for the requests that asked for logprobs (vLLM's default "raw"
logprobs: the model's own distribution, before any bias, penalty, temperature or mask),
logit_bias, min_tokens' masks, the grammar bitmask of constrained requests, penalties, then
greedy argmax or temperature / top-k / top-p sampling. Every row is handled by batched tensor
ops; the only device-to-host copy is the one `tolist()` of the results at the end (the tokens,
and the logprobs packed into the same copy).

A request's parameters are read once, when it is first seen (`_Request`, kept until forget()),
so a step costs one cheap pass over its rows. A batch where no row needs anything but greedy
or plain temperature sampling (the common batch) skips straight to one max, one inverse-CDF
draw and one copy. Unseeded rows draw by inverse CDF (one uniform per row: far cheaper than a
full-width noise tensor on a CPU); seeded requests draw their exponential-race noise from their
own torch.Generator, so a request's tokens do not depend on what else shares the batch.
Penalised requests keep their token counts on the device across steps (`_PenaltyPool`).
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


@dataclass(slots=True, eq=False)
class _Request:
    """One request's parameters, read once instead of on every step, and the per-request
    tensors its features need (built on first use, dropped by forget())."""

    request_id: str
    params: SamplingParams
    greedy: bool
    plain: bool  # sampled with temperature only: unseeded, no top-k, no top-p
    simple: bool  # greedy or plain, and nothing that touches the logits (min_tokens aside)
    penalized: bool
    constrained: bool
    temperature: float
    min_tokens: int
    banned: torch.Tensor | None = None  # min_tokens: ids masked until it has that many tokens
    bias: tuple[torch.Tensor, torch.Tensor] | None = None  # logit_bias: ids and values
    slot: int = -1  # its row in the penalty pool (-1: none yet)
    counted: int = -1  # output tokens its pool row has counted (-1: not built)

    @classmethod
    def of(cls, request_id: str, p: SamplingParams) -> _Request:
        greedy = p.greedy
        plain = not greedy and p.seed is None and p.top_k == 0 and p.top_p >= 1.0
        featured = p.penalized or p.logprobs is not None or bool(p.logit_bias) or p.constrained
        return cls(request_id, p, greedy, plain, (greedy or plain) and not featured, p.penalized, p.constrained,
                   float(p.temperature), int(p.min_tokens))


class _PenaltyPool:
    """Each penalised request's output-token counts and prompt-seen mask as one row (slot) of
    [slots, vocab] device tensors, with its three penalties beside them: a step gathers its rows
    in one op and adds its sampled tokens in another, instead of rebuilding the counts from the
    whole output (O(output length) per step, on the host)."""

    def __init__(self) -> None:
        self.counts: torch.Tensor | None = None  # [capacity, vocab] float32
        self.prompt: torch.Tensor | None = None  # [capacity, vocab] bool (rows with repetition_penalty)
        self.coefs: torch.Tensor | None = None  # [capacity, 3]: repetition, frequency, presence
        self.free: list[int] = []

    def fits(self, vocab: int, device: torch.device) -> bool:
        return self.counts is not None and self.counts.shape[1] == vocab and self.counts.device == device

    def reset(self, vocab: int, device: torch.device, capacity: int = 8) -> None:
        """A fresh pool (first use, or the vocabulary or device changed: every slot is void)."""
        self.counts = torch.zeros((capacity, vocab), device=device)
        self.prompt = torch.zeros((capacity, vocab), dtype=torch.bool, device=device)
        self.coefs = torch.zeros((capacity, 3), device=device)
        self.free = list(range(capacity - 1, -1, -1))

    def take(self, row: Row) -> int:
        """A slot for a newly seen request: its penalties and its prompt's mask, built once."""
        if not self.free:
            self._grow()
        slot = self.free.pop()
        p = row.params
        self.coefs[slot] = torch.tensor([p.repetition_penalty, p.frequency_penalty, p.presence_penalty])
        self.prompt[slot] = False
        if p.repetition_penalty != 1.0 and row.prompt_token_ids:
            self.prompt[slot] = _token_counts([row.prompt_token_ids], 1, self.prompt.shape[1], self.prompt.device)[0] > 0
        return slot

    def replay(self, slot: int, row: Row) -> None:
        """Count a row's whole output once: a migrated stream's tokens, or a step whose
        sampled token was not the one appended."""
        self.counts[slot] = _token_counts([row.output_token_ids], 1, self.counts.shape[1], self.counts.device)[0]

    def release(self, slot: int) -> None:
        self.free.append(slot)

    def _grow(self) -> None:
        old = self.counts.shape[0]
        self.counts = torch.cat([self.counts, torch.zeros_like(self.counts)])
        self.prompt = torch.cat([self.prompt, torch.zeros_like(self.prompt)])
        self.coefs = torch.cat([self.coefs, torch.zeros_like(self.coefs)])
        self.free.extend(range(2 * old - 1, old - 1, -1))


class Sampler:
    def __init__(self, grammars: Grammars | None = None, eos_token_ids: list[int] | tuple[int, ...] = ()) -> None:
        self.grammars = grammars
        self.eos_token_ids = list(eos_token_ids)  # masked, with stop_token_ids, before min_tokens
        self._generators: dict[str, torch.Generator] = {}
        self._matchers: dict[str, GrammarMatcher] = {}
        self._shared: dict[str, torch.Generator] = {}
        self._requests: dict[str, _Request] = {}
        self._penalties = _PenaltyPool()
        self._scratch: dict[torch.device, torch.Tensor] = {}

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
        self._drop(request_id)

    def _drop(self, request_id: str) -> None:
        q = self._requests.pop(request_id, None)
        if q is not None and q.slot >= 0:
            self._penalties.release(q.slot)

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

    def _scan(self, rows: list[Row]) -> tuple[list[_Request], list[int], bool]:
        """Each row's cached parameters, the rows still under min_tokens, and whether every row
        is simple: the step's one pass over its rows in Python."""
        get = self._requests.get
        reqs: list[_Request] = []
        early: list[int] = []
        simple = True
        for i, r in enumerate(rows):
            q = get(r.request_id)
            if q is None or q.params is not r.params:
                q = self._new(r)
            reqs.append(q)
            simple = simple and q.simple
            if q.min_tokens and r.num_output_tokens < q.min_tokens:
                early.append(i)
        return reqs, early, simple

    def _new(self, row: Row) -> _Request:
        self._drop(row.request_id)  # its params changed: nothing cached for the old ones holds
        q = self._requests[row.request_id] = _Request.of(row.request_id, row.params)
        return q

    # ---- the step ------------------------------------------------------------------------
    def sample(self, logits: torch.Tensor, rows: list[Row]) -> SamplerOutput:
        """logits: [N, V] on any device and dtype; one row per request, in order."""
        if not rows:
            return SamplerOutput([], [])
        reqs, early, simple = self._scan(rows)
        logits = logits.float()
        if simple and not early:  # the common batch: nothing to mask, bias, penalise or report
            return SamplerOutput(self._choose(logits, reqs).tolist(), [None] * len(rows))
        return self._sample_featured(logits, rows, reqs, early)

    def _sample_featured(self, logits: torch.Tensor, rows: list[Row], reqs: list[_Request],
                         early: list[int]) -> SamplerOutput:
        """The full order of the module docstring, each feature for the rows that use it."""
        device = logits.device
        want_lp = [i for i, q in enumerate(reqs) if q.params.logprobs is not None]
        raw_lp = torch.log_softmax(logits[_index(want_lp, device)], dim=-1) if want_lp else None
        biased = [i for i, q in enumerate(reqs) if q.params.logit_bias]
        penalized = [i for i, q in enumerate(reqs) if q.penalized]
        constrained = [i for i, q in enumerate(reqs) if q.constrained and rows[i].request_id in self._matchers]

        # masks and penalties write in place: never into the runner's own output
        scores = logits.clone() if early or biased or penalized or constrained else logits
        self._apply_logit_bias(scores, reqs, biased)
        self._apply_min_tokens(scores, reqs, early)
        self._apply_grammar(scores, rows, constrained)
        counted = self._apply_penalties(scores, rows, reqs, penalized)
        tokens = self._choose(scores, reqs)
        if counted is not None:
            self._count_sampled(tokens, rows, reqs, penalized, counted)

        token_list, lp_rows = self._to_host(tokens, raw_lp, want_lp, reqs)
        for i in constrained:
            self._matchers[rows[i].request_id].accept(token_list[i])
        return SamplerOutput(token_list, lp_rows)

    def _to_host(self, tokens: torch.Tensor, raw_lp: torch.Tensor | None, want_lp: list[int],
                 reqs: list[_Request]) -> tuple[list[int], list[TokenLogprob | None]]:
        """The step's one device-to-host copy: the tokens, and the logprobs of the rows that
        asked packed behind them (float64 holds token ids and float32 logprobs exactly)."""
        n = tokens.shape[0]
        lp_rows: list[TokenLogprob | None] = [None] * n
        if raw_lp is None:
            return tokens.tolist(), lp_rows
        m = len(want_lp)
        chosen_lp = raw_lp.gather(1, tokens[_index(want_lp, tokens.device)].unsqueeze(1)).squeeze(1)
        k = max(reqs[i].params.logprobs for i in want_lp)
        top_lp, top_ids = raw_lp.topk(k, dim=-1) if k else (raw_lp[:, :0], raw_lp[:, :0].long())
        flat = torch.cat([tokens.double(), chosen_lp.double(), top_lp.double().flatten(),
                          top_ids.double().flatten()]).tolist()
        token_list = [int(t) for t in flat[:n]]
        top_values, top_tokens = flat[n + m: n + m + m * k], flat[n + m + m * k:]
        for j, i in enumerate(want_lp):
            kk = reqs[i].params.logprobs
            ids, values = top_tokens[j * k: j * k + kk], top_values[j * k: j * k + kk]
            lp_rows[i] = TokenLogprob(token_list[i], finite_logprob(flat[n + j]),
                                      [(int(t), finite_logprob(v)) for t, v in zip(ids, values, strict=True)])
        return token_list, lp_rows

    def _apply_logit_bias(self, scores: torch.Tensor, reqs: list[_Request], biased: list[int]) -> None:
        """OpenAI's logit_bias: each listed token's bias added to its logit (ids past this
        model's vocabulary were refused at the gateway; here they are skipped). A request's ids
        and values become tensors on its first step, not on every step; one add for all rows."""
        if not biased:
            return
        for i in biased:
            q = reqs[i]
            if q.bias is None:
                items = [(t, b) for t, b in q.params.logit_bias.items() if t < scores.shape[-1]]
                q.bias = (torch.tensor([t for t, _ in items], dtype=torch.long, device=scores.device),
                          torch.tensor([b for _, b in items], dtype=scores.dtype, device=scores.device))
        ids = [reqs[i].bias[0] for i in biased]
        values = torch.cat([reqs[i].bias[1] for i in biased])
        scores.index_put_((_row_index(biased, ids), torch.cat(ids)), values, accumulate=True)

    def _apply_min_tokens(self, scores: torch.Tensor, reqs: list[_Request], early: list[int]) -> None:
        """vLLM's min_tokens: until a request has that many tokens, its end-of-sequence ids (unless
        ignore_eos) and stop_token_ids cannot be chosen. Each request's ids become a tensor once."""
        if not early:
            return
        for i in early:
            q = reqs[i]
            if q.banned is None:
                p = q.params
                banned = list(p.stop_token_ids) + ([] if p.ignore_eos else self.eos_token_ids)
                banned = [t for t in banned if 0 <= t < scores.shape[-1]]
                q.banned = torch.tensor(banned, dtype=torch.long, device=scores.device)
        ids = [reqs[i].banned for i in early]
        scores.index_put_((_row_index(early, ids), torch.cat(ids)), torch.tensor(float("-inf"), device=scores.device))

    def _apply_grammar(self, scores: torch.Tensor, rows: list[Row], constrained: list[int]) -> None:
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

    def _apply_penalties(self, scores: torch.Tensor, rows: list[Row], reqs: list[_Request] | None = None,
                         which: list[int] | None = None) -> torch.Tensor | None:
        """OpenAI's frequency and presence penalties over the output, vLLM's repetition penalty
        over prompt and output, from the counts kept in the pool. Returns the rows' slots (for
        _count_sampled), or None where no row is penalised."""
        if reqs is None:
            reqs = [self._requests.get(r.request_id) or self._new(r) for r in rows]
        if which is None:
            which = [i for i, q in enumerate(reqs) if q.penalized]
        if not which:
            return None
        device, vocab = scores.device, scores.shape[-1]
        pool = self._penalties
        if not pool.fits(vocab, device):
            for q in self._requests.values():
                q.slot, q.counted = -1, -1
            pool.reset(vocab, device)
        for i in which:
            q = reqs[i]
            if q.slot < 0:
                q.slot = pool.take(rows[i])
            if q.counted != rows[i].num_output_tokens:
                pool.replay(q.slot, rows[i])
                q.counted = rows[i].num_output_tokens
        slots = _index([reqs[i].slot for i in which], device)
        idx = _index(which, device)
        sub, counts, coefs = scores[idx], pool.counts[slots], pool.coefs[slots]
        if any(reqs[i].params.repetition_penalty != 1.0 for i in which):
            seen = (counts > 0) | pool.prompt[slots]
            rep = coefs[:, 0:1]
            penalized = torch.where(sub > 0, sub / rep, sub * rep)
            sub = torch.where(seen, penalized, sub)
        sub = sub - coefs[:, 1:2] * counts - coefs[:, 2:3] * (counts > 0).float()
        scores[idx] = sub
        return slots

    def _count_sampled(self, tokens: torch.Tensor, rows: list[Row], reqs: list[_Request], which: list[int],
                       slots: torch.Tensor) -> None:
        """Add each penalised row's sampled token to its counts, on the device (the engine appends
        it to the row's output; a row whose next output length does not match is replayed)."""
        chosen = tokens[_index(which, tokens.device)]
        ones = torch.ones(chosen.shape, device=tokens.device)
        self._penalties.counts.index_put_((slots, chosen), ones, accumulate=True)
        for i in which:
            reqs[i].counted = rows[i].num_output_tokens + 1

    # ---- the draw ------------------------------------------------------------------------
    def _choose(self, scores: torch.Tensor, reqs: list[_Request]) -> torch.Tensor:
        """Each row's token: argmax for greedy rows, an inverse-CDF draw straight from the
        scores for plain rows, the full top-k / top-p / seeded path for the rest."""
        best, tokens = scores.max(dim=-1)  # the first maximal index, as argmax
        plain = [i for i, q in enumerate(reqs) if q.plain]
        other = [i for i, q in enumerate(reqs) if not q.greedy and not q.plain]
        if plain:
            tokens = self._put(tokens, plain, self._draw_plain(scores, best, tokens, reqs, plain))
        if other:
            idx = _index(other, scores.device)
            tokens = tokens.index_copy(0, idx, self._sample_rows(scores[idx], [reqs[i] for i in other], tokens[idx]))
        return tokens

    @staticmethod
    def _put(tokens: torch.Tensor, rows: list[int], chosen: torch.Tensor) -> torch.Tensor:
        if len(rows) == tokens.shape[0]:
            return chosen
        return tokens.index_copy(0, _index(rows, tokens.device), chosen)

    def _draw_plain(self, scores: torch.Tensor, best: torch.Tensor, argmax: torch.Tensor, reqs: list[_Request],
                    rows: list[int]) -> torch.Tensor:
        """softmax(scores / T) drawn without normalising it: exp((s - max) / T), its running sum,
        and one uniform per row scaled by the row's total, found by binary search."""
        device = scores.device
        if len(rows) == scores.shape[0]:
            weights = torch.sub(scores, best.unsqueeze(1), out=self._scratch_like(scores.shape, device))
        else:  # a gather, then in place (index_select into a buffer is far slower on a CPU)
            idx = _index(rows, device)
            weights = scores[idx].sub_(best[idx].unsqueeze(1))
            argmax = argmax[idx]
        temps = [reqs[i].temperature for i in rows]
        if any(t != temps[0] for t in temps):
            weights.div_(torch.tensor(temps, device=device).unsqueeze(1))
        elif temps[0] != 1.0:
            weights.div_(temps[0])
        return self._inverse_cdf(weights.exp_(), argmax)

    def _inverse_cdf(self, weights: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
        """Token t with probability weights[t] / sum(weights), per row, from one uniform: the first
        index whose running sum passes u * total (so a zero weight is never chosen). Overwrites
        weights. A degenerate row (NaN or nothing left) takes `fallback`, as the race did."""
        cdf = weights.cumsum_(dim=-1)
        total = cdf[:, -1:]
        u = torch.rand(total.shape, device=cdf.device, generator=self._shared_generator(cdf.device)).mul_(total)
        pos = torch.searchsorted(cdf, u, right=True).squeeze(1)
        ok = (pos < cdf.shape[1]) & (total.squeeze(1) > 0)
        return torch.where(ok, pos.clamp_(max=cdf.shape[1] - 1), fallback)

    def _scratch_like(self, shape: tuple[int, int], device: torch.device) -> torch.Tensor:
        """A reused [rows, vocab] float buffer: a step allocates (and on a CPU, page-faults) no
        full-size tensor for its draw."""
        buf = self._scratch.get(device)
        numel = shape[0] * shape[1]
        if buf is None or buf.numel() < numel:
            buf = self._scratch[device] = torch.empty(numel, device=device)
        return buf[:numel].view(shape)

    def _sample_rows(self, scores: torch.Tensor, reqs: list[_Request], argmax: torch.Tensor) -> torch.Tensor:
        """Temperature, top-k, top-p, then one draw per row. Rows with a top-k cut work on their
        best candidates only (one topk, already sorted for top-p); the others on the vocabulary."""
        params = [q.params for q in reqs]
        out = torch.empty(len(reqs), dtype=torch.long, device=scores.device)
        for group in _groups(params, scores.shape[-1]):
            idx = _index(group, scores.device)
            sub = scores[idx]
            probs, ids = _distribution(sub, [params[j] for j in group])
            pos = self._draw(probs, [reqs[j] for j in group], [params[j].top_k for j in group])
            chosen = ids.gather(1, pos.unsqueeze(1)).squeeze(1) if ids is not None else pos
            # a degenerate distribution (all masked: NaN, or nothing left) must not fail the step:
            # its draw has no positive probability, and the row falls back to the argmax
            ok = probs.gather(1, pos.unsqueeze(1)).squeeze(1) > 0
            out[idx] = torch.where(ok, chosen, argmax[idx])
        return out

    def _draw(self, probs: torch.Tensor, reqs: list[_Request], top_ks: list[int]) -> torch.Tensor:
        """A position per row with probability probs[row, pos]. Unseeded rows: inverse CDF (one
        uniform each). Seeded rows: the exponential race argmax(p / q), q ~ Exp(1) from the
        request's own generator over its own candidates (its top_k, or the vocabulary), so its
        draws do not depend on the batch."""
        device, width = probs.device, probs.shape[1]
        seeded = [j for j, q in enumerate(reqs) if q.params.seed is not None]
        pos = torch.zeros(len(reqs), dtype=torch.long, device=device)
        if len(seeded) < len(reqs):
            unseeded = [j for j, q in enumerate(reqs) if q.params.seed is None]
            idx = _index(unseeded, device)
            pos = pos.index_copy(0, idx, self._inverse_cdf(probs[idx], pos[idx]))
        if seeded:
            idx = _index(seeded, device)
            noise = torch.ones((len(seeded), width), device=device, dtype=probs.dtype)
            for row, j in enumerate(seeded):
                q = reqs[j]
                gen = self._generator(q.request_id, q.params.seed, device)
                k = top_ks[j] if 0 < top_ks[j] < width else width
                noise[row, :k].exponential_(generator=gen)
            noise.clamp_(min=torch.finfo(noise.dtype).tiny)  # a drawn 0 would make 0/0 = NaN win argmax
            pos = pos.index_copy(0, idx, torch.div(probs[idx], noise, out=noise).argmax(dim=-1))
        return pos


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


def _index(rows: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.long, device=device)


def _row_index(rows: list[int], per_row: list[torch.Tensor]) -> torch.Tensor:
    """rows[j] repeated len(per_row[j]) times: the row half of an index_put_ over several rows
    (output_size given, so a GPU does not sync to learn it)."""
    lengths = [t.numel() for t in per_row]
    device = per_row[0].device
    return torch.repeat_interleave(_index(rows, device), _index(lengths, device), output_size=sum(lengths))


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
    cut = [j for j, p in enumerate(params) if p.top_p < 1.0]
    if not cut:
        return probs, None
    if len(cut) < len(params):  # sort only the rows with a top-p cut: a sort costs the most here
        idx = torch.tensor(cut, device=device)
        probs[idx] = _top_p_unsorted(probs[idx], [params[j] for j in cut])
        return probs, None
    return _top_p_unsorted(probs, params), None


def _top_p_unsorted(probs: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Top-p over rows in vocabulary order: sorted, cut, put back."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    return torch.zeros_like(probs).scatter_(1, order, _top_p_sorted(sorted_probs, params))


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
