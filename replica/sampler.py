"""Next-token choice per request: greedy, or temperature / top-k / top-p with a per-request seed."""

from __future__ import annotations

import torch

from replica.sampling_params import SamplingParams


class Sampler:
    def __init__(self) -> None:
        self._generators: dict[str, torch.Generator] = {}
        self._shared = torch.Generator()
        self._shared.seed()

    def forget(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    def _generator(self, request_id: str, params: SamplingParams) -> torch.Generator:
        if params.seed is None:
            return self._shared
        gen = self._generators.get(request_id)
        if gen is None:
            gen = self._generators[request_id] = torch.Generator().manual_seed(params.seed)
        return gen

    def sample(self, logits: torch.Tensor, requests: list[tuple[str, SamplingParams]]) -> list[int]:
        """logits: [N, V] float32 on any device; one (request_id, params) per row."""
        greedy = logits.argmax(dim=-1).tolist()
        out: list[int] = []
        for row, (request_id, params) in enumerate(requests):
            if params.greedy:
                out.append(greedy[row])
                continue
            scores = logits[row].cpu().double() / params.temperature
            if params.top_k > 0 and params.top_k < scores.numel():
                kth = torch.topk(scores, params.top_k).values[-1]
                scores = scores.masked_fill(scores < kth, float("-inf"))
            probs = torch.softmax(scores, dim=-1)
            if params.top_p < 1.0:
                sorted_probs, order = probs.sort(descending=True)
                cumulative = sorted_probs.cumsum(0)
                drop = cumulative - sorted_probs > params.top_p  # keep the smallest set reaching top_p
                sorted_probs[drop] = 0.0
                probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
            if not bool(torch.isfinite(probs).all()) or float(probs.sum()) <= 0.0:
                out.append(greedy[row])  # degenerate distribution: never fail the whole step
                continue
            token = torch.multinomial(probs, 1, generator=self._generator(request_id, params))
            out.append(int(token))
        return out
