"""How a decoder draws the next token, one rule for every stage that decodes: dflash-generate's
answers and dflash-eval's target (its own tokens, and the distribution speculative sampling accepts
drafts against).

    probs = sampling_probs(logits, Sampling(temperature=0.7, top_p=0.9, top_k=50))  # [n, V] -> same

Temperature first, then top-k, then top-p, as transformers' and vLLM's samplers apply them.
Top-p keeps the smallest set of most likely tokens whose mass reaches top_p: a token is kept while
the mass of the tokens before it is below top_p, so the token that crosses top_p is kept and one
that would start after the mass already equals top_p is not (transformers' TopPLogitsWarper,
vLLM's top-p).
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class Sampling:
    """Resolved decoding settings: the distribution (temperature 0 is greedy; top_k 0 and top_p 1
    keep every token), the most tokens an answer may have and the seed of the run's generators."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 256  # every stage sets it from its config; this is only code's default
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """[n, V] probabilities -> [n, V], each row cut to its smallest most-likely set of mass >= top_p
    (the most likely token is always kept) and renormalised."""
    if top_p >= 1:
        return probs
    sorted_p, order = probs.sort(dim=-1, descending=True)
    keep = sorted_p.cumsum(-1) - sorted_p < top_p  # the mass before the token is still below top_p
    kept = torch.zeros_like(probs).scatter(-1, order, sorted_p * keep)
    return kept / kept.sum(-1, keepdim=True)


def sampling_probs(logits: torch.Tensor, s: Sampling) -> torch.Tensor:
    """[n, V] logits -> [n, V] float32 probabilities after temperature, top-k, then top-p. Not for
    greedy settings (temperature 0): those take the argmax."""
    scores = logits.float() / s.temperature
    if 0 < s.top_k < scores.shape[-1]:
        kth = torch.topk(scores, s.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    return top_p_filter(torch.softmax(scores, dim=-1), s.top_p)
