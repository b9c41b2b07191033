"""Speculative decoding, one prompt at a time: the drafter proposes, the target verifies in one
forward.

One draft-verify cycle, at `start` = the position of the last committed token (the *anchor*, whose
keys/values are not yet in the target's cache):

    drafts  = drafter.propose(new context, anchor, start, B-1)  # tokens for start+1 .. start+B-1
    logits  = target([anchor, drafts...] at positions start .. start+B-1, KV cache)
    accepted, next = accept(drafts, logits)                     # longest agreeing prefix + 1 token
    commit drafts[:accepted] + [next]; crop the cache to start+accepted+1; next becomes the anchor

The loop and its counting are the DFlash authors' (z-lab/dflash `dflash/model.py`, `spec_generate`):
every cycle drafts a whole block and records accepted + 1 (the target's own token) uncut; the loop
runs while the anchor's position is below the length limit (`while start < max_length`), so its last
cycle may emit only tokens past the limit, and stops after the first cycle whose output holds a stop
token (a prefill token that is one still gets its cycle); the output is then cut at the limit and
after the first stop token. The prefill's token is not a cycle. Beside those uncut counts
(`Decoded.acceptance_lengths`, the authors' tau), `Decoded.emitted` holds what each cycle
contributes to the cut output, cycles that contribute nothing dropped: it differs only in the last
cycle, and it is what a replay from stored responses can reproduce exactly (train/path_tau.py).

A drafter only ever sees *committed* context (features of the anchor and the accepted drafts of the
previous cycle), so it never has to roll back: it keeps the context keys/values it has seen and
forgets its block's own after each proposal.

Acceptance rules (`accept`):
- temperature 0: accept the longest prefix of drafts equal to the target's argmax, then the target's
  argmax at the first disagreement (or after the last draft). The output equals greedy decoding.
- temperature > 0: standard speculative sampling (Leviathan et al.; Chen et al.): accept draft x
  with probability min(1, p(x)/q(x)), on rejection sample from norm(max(p - q, 0)). Drafts are
  greedy by default even when the target samples (vLLM's default `draft_sample_method`), so q is a
  point mass on x (q(x) = 1), which gives:
    accept x with probability p(x); on rejection sample from p with x removed, renormalised.
  The emitted token is then distributed as p: P(x) = p(x), and for y != x,
  P(y) = (1 - p(x)) * p(y) / (1 - p(x)) = p(y). p is the target's distribution after temperature,
  top-k and top-p. With `draft_sampling = "probabilistic"` (vLLM's "probabilistic") each draft is
  drawn from q = softmax(draft logits / temperature), the temperature alone as vLLM applies it to
  the draft logits (a DSpark drafter's left to right through its Markov head, each after the
  drawn one), and the general rule applies with that q.
"""

from __future__ import annotations

import functools
import inspect
import time
from dataclasses import dataclass, field
from typing import Protocol, Sequence

import torch

from dflash_common.drafter.layer_ids import hf_hidden_states_index
from dflash_common.sampling import Sampling, sampling_probs


class Drafter(Protocol):
    """What the engine asks of a drafter."""

    block_size: int  # default B; the engine may be given another
    layer_ids: list[int]  # target layers whose outputs it reads as context, in concatenation order

    def begin(self, prompt_ids: Sequence[int]) -> None:
        """Start a new prompt: forget all context."""

    def propose(
        self, context: torch.Tensor, anchor: int, start: int, num_drafts: int, draw=None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """`context` [n, K*H]: target features (layer outputs of `layer_ids`, concatenated) at
        positions start-n .. start-1, all committed and never handed over before. `anchor` is the
        token at `start`. Returns `num_drafts` token ids (long) for positions
        start+1 .. start+num_drafts; with `draw` (`draw_from`: drafts sampled from the drafter),
        those ids and the distributions they were drawn from [num_drafts, V]."""


GREEDY = Sampling()


@dataclass
class Decoded:
    """One prompt's decoding: new tokens (the prefill's first) and the acceptance length of each
    cycle."""

    tokens: list[int]
    acceptance_lengths: list[int] = field(default_factory=list)  # accepted + 1 per cycle, uncut
    prefill_s: float = 0.0
    decode_s: float = 0.0  # everything after the prefill, drafter included
    # tokens each cycle contributes to `tokens` (cut at the limit and the stop token); cycles that
    # contribute none are left out, so only the last entry can differ from acceptance_lengths
    emitted: list[int] = field(default_factory=list)

    @property
    def time_per_token(self) -> float:
        # As the reference: decode time over all new tokens, the prefill's included.
        return self.decode_s / len(self.tokens)


@functools.cache
def _cache_keyword(model_class: type) -> str:
    """transformers 5 renamed `past_key_values` to `cache` (the old name warns, then goes)."""
    return (
        "cache"
        if "cache" in inspect.signature(model_class.forward).parameters
        else "past_key_values"
    )


class TargetRunner:
    """The target side: forwards over a KV cache that holds committed tokens only."""

    def __init__(self, model: torch.nn.Module, layer_ids: Sequence[int]):
        self.model = model
        self.layer_ids = list(layer_ids)
        self.device = next(model.parameters()).device

    def new_cache(self):
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        if hasattr(
            cache, "activate_past_recording"
        ):  # sliding/linear layers must be able to roll back
            cache.activate_past_recording()
        return cache

    @torch.inference_mode()
    def forward(self, tokens, start: int, cache, *, features: bool, last_only: bool = False):
        """tokens at positions start.. -> (float32 logits [n or 1, V], features [n, K*H] or
        None)."""
        ids = torch.as_tensor(tokens, dtype=torch.long, device=self.device)[None]  # [1, n]
        positions = torch.arange(start, start + ids.shape[1], device=self.device)[None]
        want_states = features and bool(self.layer_ids)
        out = self.model(
            input_ids=ids,
            position_ids=positions,
            use_cache=True,
            **{_cache_keyword(type(self.model)): cache},
            logits_to_keep=1 if last_only else 0,  # 0 keeps all
            output_hidden_states=want_states,
        )
        feats = None
        if features:
            states = [out.hidden_states[hf_hidden_states_index(i)][0] for i in self.layer_ids]
            feats = (
                torch.cat(states, dim=-1)
                if states
                else ids.new_zeros((ids.shape[1], 0), dtype=torch.float32)
            )
        return out.logits[0].float(), feats

    @staticmethod
    def crop(cache, length: int) -> None:
        """Keep the keys/values of positions 0..length-1."""
        remove = cache.get_seq_length() - length
        if remove > 0 or hasattr(cache, "activate_past_recording"):
            # Negative means "remove this many" on transformers 4 and 5 alike; on 5, crop(0) also
            # trims the past that sliding layers recorded for this rollback.
            cache.crop(-remove)

    def clock(self) -> float:
        return device_clock(self.device)


def device_clock(device: torch.device) -> float:
    """perf_counter once the device's queued work is done (a CUDA device's kernels run async)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(probs, 1, generator=generator))


def choose(logits: torch.Tensor, s: Sampling, generator: torch.Generator | None) -> int:
    """The target's own next token from one row of logits [V]."""
    if s.greedy:
        return int(logits.argmax())
    return _draw(sampling_probs(logits[None], s)[0], generator)


def accept_greedy(drafts: torch.Tensor, logits: torch.Tensor) -> tuple[int, int]:
    """drafts [n], target logits [n+1, V] -> (accepted drafts, the target's next token)."""
    choice = logits.argmax(-1)  # [n+1]
    accepted = int((drafts == choice[:-1]).int().cumprod(0).sum())
    return accepted, int(choice[accepted])


def accept_sampled(
    drafts: torch.Tensor,
    probs: torch.Tensor,
    generator: torch.Generator | None,
    draft_probs: torch.Tensor | None = None,
) -> tuple[int, int]:
    """drafts [n], target probabilities [n+1, V] -> (accepted, next); `draft_probs` [n, V], the
    distributions the drafts were drawn from (none: greedy drafts, q a point mass).

    Draft x is accepted with probability min(1, p(x)/q(x)) (= p(x) for a point mass); on the first
    rejection the token comes from max(p - q, 0) renormalised (p without x for a point mass).
    """
    n = drafts.shape[0]
    p_draft = probs[:n].gather(1, drafts[:, None])[:, 0]  # [n]
    u = torch.rand(n, generator=generator, device=probs.device)
    if draft_probs is None:
        keep = u < p_draft
    else:  # u < p/q without dividing: q(x) > 0 for a drawn x
        keep = u * draft_probs.gather(1, drafts[:, None])[:, 0] < p_draft
    accepted = int(keep.int().cumprod(0).sum())
    if accepted == n:
        return n, _draw(probs[n], generator)
    if draft_probs is None:
        residual = probs[accepted].clone()
        residual[drafts[accepted]] = 0.0
    else:
        residual = (probs[accepted] - draft_probs[accepted].to(probs.dtype)).clamp_min(0.0)
    total = residual.sum()
    # A rejection needs p(x) < q(x), so total > 0 up to rounding; fall back to p if rounding ate it.
    return accepted, _draw(residual / total if total > 0 else probs[accepted], generator)


def accept(drafts, logits, s: Sampling, generator, draft_probs=None) -> tuple[int, int]:
    if s.greedy:
        return accept_greedy(drafts, logits)
    return accept_sampled(drafts, sampling_probs(logits, s), generator, draft_probs)


def draw_from(s: Sampling, generator: torch.Generator | None):
    """Drafts sampled from the drafter (`draft_sampling = "probabilistic"`): logits [m, V] ->
    (one token per row [m], q [m, V]), q = softmax(logits / temperature) in float32, the temperature
    alone, as vLLM applies it to the draft logits."""

    def draw(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q = torch.softmax(logits.float() / s.temperature, dim=-1)
        return torch.multinomial(q, 1, generator=generator)[:, 0], q

    return draw


def emitted_lengths(starts: Sequence[int], lengths: Sequence[int], end: int) -> list[int]:
    """Per cycle (anchor at `starts[i]`, `lengths[i]` tokens committed after it) the tokens that
    land before `end`, the position after the cut output's last token; cycles with none are
    dropped."""
    out = [min(n, end - 1 - s) for s, n in zip(starts, lengths)]
    return [n for n in out if n > 0]


def _cut_at_stop(new: list[int], stop_ids: frozenset[int]) -> tuple[list[int], bool]:
    for i, token in enumerate(new):
        if token in stop_ids:
            return new[: i + 1], True
    return new, False


@torch.inference_mode()
def speculative_generate(
    target: TargetRunner,
    drafter: Drafter,
    prompt_ids: Sequence[int],
    *,
    block_size: int,
    max_new_tokens: int,
    stop_ids: frozenset[int] = frozenset(),
    sampling: Sampling = GREEDY,
    generator: torch.Generator | None = None,
    draft_sampling: str = "greedy",
) -> Decoded:
    """Decode `max_new_tokens` (or up to a stop token) with draft-verify cycles of `block_size`;
    `draft_sampling` "probabilistic" draws the drafts from the drafter when the target samples."""
    draw = None
    if draft_sampling == "probabilistic" and not sampling.greedy:
        draw = draw_from(sampling, generator)
    ids, cache = list(prompt_ids), target.new_cache()
    start, max_len = len(ids), len(ids) + max_new_tokens
    t0 = target.clock()
    logits, context = target.forward(
        ids, 0, cache, features=True, last_only=True
    )  # context [P, K*H]
    ids.append(choose(logits[-1], sampling, generator))
    drafter.begin(prompt_ids)
    t1 = target.clock()
    lengths: list[int] = []
    starts: list[int] = []
    stopped = False  # the authors' loop checks for stop tokens after a cycle only
    while start < max_len and not stopped:
        num_drafts = block_size - 1  # always a whole block, as the authors' loop
        q = None  # the drafts' distributions, when drawn from the drafter
        if draw is None:
            drafts = drafter.propose(context, ids[start], start, num_drafts)
        else:
            drafts, q = drafter.propose(context, ids[start], start, num_drafts, draw=draw)
        # a drafter may propose fewer (DSpark's confidence schedule): the cycle checks only those
        drafts = torch.as_tensor(drafts, dtype=torch.long).to(target.device)
        drafts = drafts.reshape(-1)[:num_drafts]
        q = None if q is None else q[: drafts.shape[0]]
        block = torch.cat([drafts.new_tensor([ids[start]]), drafts])  # [1 + num_drafts]
        logits, feats = target.forward(block, start, cache, features=True)  # [n+1, V], [n+1, K*H]
        accepted, next_token = accept(drafts, logits, sampling, generator, q)
        new = drafts[:accepted].tolist() + [next_token]
        stopped = any(t in stop_ids for t in [ids[start], *new])  # the prefill's token counts too
        ids.extend(new)
        target.crop(
            cache, start + len(new)
        )  # the anchor and accepted drafts stay; next is the anchor
        context = feats[: len(new)]  # features at start .. start+len(new)-1
        starts.append(start)
        start += len(new)
        lengths.append(len(new))  # uncut: drafts accepted past a stop token or the limit count
    t2 = target.clock()
    tokens, _ = _cut_at_stop(ids[len(prompt_ids) : max_len], stop_ids)
    emitted = emitted_lengths(starts, lengths, len(prompt_ids) + len(tokens))
    return Decoded(tokens, lengths, t1 - t0, t2 - t1, emitted)


@torch.inference_mode()
def target_generate(
    target: TargetRunner,
    prompt_ids: Sequence[int],
    *,
    max_new_tokens: int,
    stop_ids: frozenset[int] = frozenset(),
    sampling: Sampling = GREEDY,
    generator: torch.Generator | None = None,
) -> Decoded:
    """The target alone, one token per forward over its KV cache: the speed baseline and, greedy,
    the output speculative decoding must reproduce."""
    cache = target.new_cache()
    t0 = target.clock()
    logits, _ = target.forward(list(prompt_ids), 0, cache, features=False, last_only=True)
    new = [choose(logits[-1], sampling, generator)]
    t1 = target.clock()
    while len(new) < max_new_tokens and new[-1] not in stop_ids:
        logits, _ = target.forward([new[-1]], len(prompt_ids) + len(new) - 1, cache, features=False)
        new.append(choose(logits[-1], sampling, generator))
    t2 = target.clock()
    return Decoded(new, [], t1 - t0, t2 - t1)


class DFlashProposer:
    """A DFlash, DSpark or DFlash2 drafter behind the `Drafter` protocol: greedy drafts from its
    KV-cached draft forward.

    DFlash: the block is [anchor, MASK x n] at positions start..start+n; the output at block
    position k predicts the token at start+k (same position, no shift), so position 0 is dropped.
    DSpark: the block is [anchor, MASK x (n-1)] and row k predicts start+k+1, drafted left to right
    through the Markov head (dspark.py), as vLLM's DSpark speculator drafts: n = B drafts from a
    block of B. DFlash2: DFlash's block, the drafts the selector's greedy walk through each
    position's top-k candidates (as vLLM's DFlash2 speculator drafts; dflash2.py `walk`). Drafts are
    greedy even when the target samples (as all three are served by default), or, given `draw`,
    drawn from the drafter (DFlash and DSpark: `sampled_drafts`). `block_size` is
    the drafter's block B (the loop's is the verified block [anchor, drafts]: B, or B+1 for DSpark).
    `confidence_threshold` (DSpark with a confidence head; 0 = off, vLLM 0.32's default of verifying
    every draft): verify only the drafts before the first whose confidence is below it (DeepSpec's
    eval rule).
    """

    def __init__(self, drafter, block_size: int | None = None, confidence_threshold: float = 0.0):
        self.drafter = drafter  # a DFlashDrafter with the target's embedding and lm_head attached
        cfg = drafter.cfg
        self.anchor_predicts = cfg.verify_block_size - cfg.block_size  # 1 for DSpark
        # the verified block: the anchor and the drafts
        self.block_size = (block_size or cfg.block_size) + self.anchor_predicts
        self.layer_ids = list(cfg.target_layer_ids)
        self.confidence_threshold = confidence_threshold
        if confidence_threshold > 0 and getattr(drafter, "confidence_head", None) is None:
            raise ValueError("a confidence threshold needs a DSpark drafter with a confidence head")
        self.cache = None

    def begin(self, prompt_ids: Sequence[int]) -> None:
        self.cache = self.drafter.new_cache()

    @torch.inference_mode()
    def propose(
        self, context: torch.Tensor, anchor: int, start: int, num_drafts: int, draw=None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if self.cache.length + context.shape[0] != start:
            ends = self.cache.length + context.shape[0]
            raise RuntimeError(f"drafter context ends at {ends}, block starts at {start}")
        dtype = self.drafter.fc.weight.dtype
        rows = num_drafts + 1 - self.anchor_predicts
        block = torch.full(
            (rows,), self.drafter.cfg.mask_token_id, dtype=torch.long, device=context.device
        )
        block[0] = anchor
        # [1, rows, H]; the cache holds the context only, after as before
        hidden = self.drafter.draft(self.cache, context.to(dtype), block)[None]
        if draw is None:
            drafts, probs = self.draft(hidden, block[:1]), None  # [1, n]
        else:  # drawn from the drafter: [1, n], [1, n, V]
            drafts, probs = self.drafter.sampled_drafts(hidden, block[:1], draw)
        verified = drafts.shape[1]
        if self.confidence_threshold > 0:
            verified = int(self.verified(hidden, block[:1], drafts)[0])
        if probs is None:
            return drafts[0, :verified]  # [n]
        return drafts[0, :verified], probs[0, :verified]

    def verified(
        self, block_hidden: torch.Tensor, anchors: torch.Tensor, drafts: torch.Tensor
    ) -> torch.Tensor:
        """How many of each row's drafts [N, n] the confidence schedule verifies: [N] long, the
        drafts before the first whose confidence is below the threshold (all of them without a
        threshold). Both loops cut by it: this one sends only those drafts, the batched one counts
        none past them as accepted."""
        from dflash_common.drafter.dspark import confident_prefix

        if self.confidence_threshold <= 0:
            return torch.full(
                drafts.shape[:1], drafts.shape[1], dtype=torch.long, device=drafts.device
            )
        confidences = self.drafter.draft_confidences(block_hidden, anchors, drafts)  # [N, n]
        return confident_prefix(confidences, self.confidence_threshold)

    def draft(self, block_hidden: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        """The draft step: block hidden states [N, b, H] (after `norm`) and the tokens at the
        anchors [N] -> drafted tokens [N, B-1], B the verified block. DFlash (b = B) takes each
        position's argmax on its own (position 0 is the anchor, not a prediction); DSpark (b = B-1)
        drafts every row left to right through its Markov head; DFlash2 (b = B) walks its selector
        through each position's top-k candidates: the drafter's `greedy_drafts`. Both loops, one
        prompt at a time and batched (batched.py), draft through it."""
        return self.drafter.greedy_drafts(block_hidden, anchors)
