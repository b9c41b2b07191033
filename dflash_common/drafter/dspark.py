"""The DSpark drafter (arXiv 2607.05147): the DFlash backbone (model.py) with a Markov head over the
block and an optional confidence head, in the layout vLLM 0.32 serves (`qwen3_dspark.py`).

What differs from DFlash:

    block [token at anchor, MASK x (B-1)] at positions a..a+B-1 (the same block, mask and context)
    row k predicts the token at a+k+1, k = 0..B-1: the anchor row predicts too (B drafts a cycle,
        vLLM's num_speculative_tokens = B; DFlash's row k predicts a+k, B-1 drafts)
    logits_k = lm_head(h_k) + markov_w2 @ markov_w1[x_{k-1}]      (the Markov bias, V x r x V)
        x_{-1} = the anchor; x_{k-1} = the token drafted at k-1 when drafting (greedy: left to
        right, as vLLM's DSparkSpeculator._sample_sequential), the true token when training
        (teacher forcing: the drafted token *is* the true one whenever position k is reached)
    confidence_k = sigmoid(proj([h_k ; markov_w1[x_{k-1}]]))          (optional; float32)
        the drafter's estimate that draft k is accepted once drafts 0..k-1 are: vLLM's adaptive
        verification schedules with it; verification of every draft needs none

Weights, by their released names: `markov_head.markov_w1.weight` [V, r] (an embedding of target
ids), `markov_head.markov_w2.weight` [V, r] (nn.Linear(r, V): vLLM refuses [r, V]),
`confidence_head.proj.weight` [1, H (+ r with the Markov embedding)] and its bias [1]. The
training objective is train/objective.py's `dspark_objective`, its fused loss loss/markov.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from dflash_common.config import check
from dflash_common.drafter.config import Arch, DrafterConfig
from dflash_common.drafter.model import DFlashDrafter

ARCHITECTURE = "Qwen3DSparkModel"  # vLLM 0.32's registry name for a Qwen3 DSpark drafter
MARKOV_HEAD_TYPE = "vanilla"  # the only Markov head vLLM 0.32's Qwen3 path loads


@dataclass(frozen=True)
class DSparkConfig(DrafterConfig):
    """A DSpark drafter: the DFlash fields plus its heads (config.json keys of the same names, but
    `confidence_head` is written `enable_confidence_head`)."""

    ARCHITECTURE: ClassVar[str] = ARCHITECTURE
    KIND: ClassVar[str] = "DSpark"
    VLLM_METHOD: ClassVar[str] = "dspark"
    V2_RUNNER: ClassVar[bool] = True

    arch: Arch = "dspark"
    markov_rank: int = 256  # DeepSpec's recipe for Qwen3 4B-14B
    confidence_head: bool = True
    # the confidence head also reads the previous token's Markov embedding
    confidence_head_with_markov: bool = True

    def __post_init__(self):
        super().__post_init__()
        check(self.markov_rank >= 1, f"markov_rank = {self.markov_rank} must be >= 1.")

    @property
    def verify_block_size(self) -> int:
        return self.block_size + 1  # the anchor row predicts: B drafts after the anchor

    def to_config_json(self, dtype: str = "bfloat16") -> dict[str, Any]:
        """DFlash's config.json (dflash_config, layer types, RoPE keys) with DSpark's keys. vLLM
        0.32 defaults both confidence flags to false: a head under a missing flag is dropped
        silently, or its [1, H+r] weight refused, so both are always written."""
        config = super().to_config_json(dtype)
        config.update(
            {
                # DeepSpec's places; vLLM reads dflash_config's first (the same values, the same
                # meaning)
                "target_layer_ids": list(self.target_layer_ids),
                "mask_token_id": self.mask_token_id,
                # the anchor row is a prediction (vLLM's default; false would switch it to DFlash's
                # 1+N layout, which this drafter was not trained for); top-level only:
                # DFlashSpeculator refuses sample_from_anchor inside dflash_config
                "sample_from_anchor": True,
                "markov_rank": self.markov_rank,
                "markov_head_type": MARKOV_HEAD_TYPE,
                "enable_confidence_head": self.confidence_head,
                "confidence_head_with_markov": self.confidence_head_with_markov,
            }
        )
        return config

    @classmethod
    def _own_fields_from_config_json(cls, data: Mapping[str, Any]) -> dict[str, Any]:
        check(
            data.get("markov_rank") is not None,
            "config.json has no markov_rank; a DSpark drafter needs it.",
        )
        kind = data.get("markov_head_type", MARKOV_HEAD_TYPE)
        check(
            kind == MARKOV_HEAD_TYPE,
            f"markov_head_type = {kind!r}: only {MARKOV_HEAD_TYPE!r} is supported.",
        )
        check(
            data.get("sample_from_anchor", True) is not False,
            "config.json sets sample_from_anchor = false (the 1+N fill-in layout); this DSpark "
            "reads the anchor row as a prediction.",
        )
        # vLLM's defaults when a flag is absent: no head
        return {
            "markov_rank": int(data["markov_rank"]),
            "confidence_head": bool(data.get("enable_confidence_head", False)),
            "confidence_head_with_markov": bool(data.get("confidence_head_with_markov", False)),
        }


class MarkovHead(nn.Module):
    """The previous token's rank-r embedding, and the bias over the vocabulary it adds."""

    def __init__(self, vocab_size: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)  # [V, r]
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)  # weight [V, r], as vLLM loads it

    def embed(self, prev_ids: torch.Tensor) -> torch.Tensor:
        """Token ids [...] -> [..., r]."""
        return self.markov_w1(prev_ids)

    def bias(self, markov_embed: torch.Tensor) -> torch.Tensor:
        """[..., r] -> [..., V] (inference; training fuses it into the loss, loss/markov.py)."""
        return markov_embed @ self.markov_w2.weight.T


class ConfidenceHead(nn.Module):
    """A logit per block row: proj([h ; markov embedding]) or proj(h), computed in float32 (vLLM
    keeps this head's weights in float32 whatever the model's dtype)."""

    def __init__(self, hidden_size: int, rank: int, with_markov: bool):
        super().__init__()
        self.with_markov = with_markov
        self.proj = nn.Linear(hidden_size + (rank if with_markov else 0), 1, bias=True)

    def forward(self, hidden: torch.Tensor, markov_embed: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] (after the final norm), markov_embed [..., r] -> float32 logits [...]."""
        x = (
            torch.cat([hidden.float(), markov_embed.float()], -1)
            if self.with_markov
            else hidden.float()
        )
        return F.linear(x, self.proj.weight.float(), self.proj.bias.float()).squeeze(-1)


class DSparkDrafter(DFlashDrafter):
    """The DFlash backbone (its forward and draft give the block's hidden states [.., B, H], row k
    for the token at anchor + k + 1) and DSpark's heads."""

    cfg: DSparkConfig

    def __init__(self, cfg: DSparkConfig):
        super().__init__(cfg)
        self.markov_head = MarkovHead(cfg.vocab_size, cfg.markov_rank)
        self.confidence_head = (
            ConfidenceHead(cfg.hidden_size, cfg.markov_rank, cfg.confidence_head_with_markov)
            if cfg.confidence_head
            else None
        )
        self._init_heads()

    @torch.no_grad()
    def _init_heads(self) -> None:
        """N(0, initializer_range) weights, a zero bias (DeepSpec's start): the Markov bias starts
        near 0."""
        std = self.cfg.initializer_range
        self.markov_head.markov_w1.weight.normal_(0.0, std)
        self.markov_head.markov_w2.weight.normal_(0.0, std)
        if self.confidence_head is not None:
            self.confidence_head.proj.weight.normal_(0.0, std)
            self.confidence_head.proj.bias.zero_()

    # -- training ------------------------------------------------------------------------------

    @staticmethod
    def previous_tokens(
        input_ids: torch.Tensor, anchors: torch.Tensor, block_size: int
    ) -> torch.Tensor:
        """The teacher-forced previous token of every block row [A, B]: row k follows the true token
        at anchor + k (row 0 the anchor itself); clamped at the batch's end (rows there weigh
        zero)."""
        k = torch.arange(block_size, device=anchors.device)
        return input_ids[(anchors.long()[:, None] + k).clamp(max=input_ids.shape[0] - 1)].long()

    def markov_embed(self, prev_ids: torch.Tensor) -> torch.Tensor:
        """Token ids [...] -> [..., r] in the parameters' dtype (float32 masters under autocast)."""
        return self.markov_head.embed(prev_ids)

    def confidence_logits(self, hidden: torch.Tensor, markov_embed: torch.Tensor) -> torch.Tensor:
        if self.confidence_head is None:
            raise RuntimeError(
                "this DSpark drafter has no confidence head (confidence_head = false)"
            )
        return self.confidence_head(hidden, markov_embed)

    # -- speculative decoding ------------------------------------------------------------------

    @torch.no_grad()
    def greedy_drafts(self, hidden: torch.Tensor, first_tokens: torch.Tensor) -> torch.Tensor:
        """Block hidden states [n, b, H] and each block's anchor token [n] -> greedy drafts [n, b],
        left to right: draft k = argmax(lm_head(h_k) + Markov bias of draft k-1 (of the anchor for k
        = 0)), as vLLM's DSparkSpeculator._sample_sequential drafts them (base logits, then the bias
        added in the logits' dtype)."""
        base = self.logits(hidden)  # [n, b, V]
        prev, drafts = first_tokens.long(), []
        for k in range(hidden.shape[1]):
            bias = self.markov_head.bias(self.markov_embed(prev))  # [n, V]
            prev = (base[:, k] + bias.to(base.dtype)).argmax(-1)
            drafts.append(prev)
        return torch.stack(drafts, 1) if drafts else first_tokens.new_zeros((hidden.shape[0], 0))

    @torch.no_grad()
    def sampled_drafts(
        self, hidden: torch.Tensor, first_tokens: torch.Tensor, draw
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Block hidden states [n, b, H] and each block's anchor [n] -> (drafts [n, b], the
        distributions they were drawn from [n, b, V]), left to right as `greedy_drafts` but each
        draft drawn by `draw` (logits [n, V] -> (tokens [n], their distribution [n, V])) from the
        logits corrected by the Markov bias of the draft before it, as vLLM's
        DSparkSpeculator._sample_sequential samples them."""
        base = self.logits(hidden)  # [n, b, V]
        if hidden.shape[1] == 0:
            return first_tokens.new_zeros((hidden.shape[0], 0)), base.float()
        prev, drafts, probs = first_tokens.long(), [], []
        for k in range(hidden.shape[1]):
            bias = self.markov_head.bias(self.markov_embed(prev))  # [n, V]
            prev, q = draw(base[:, k] + bias.to(base.dtype))
            drafts.append(prev)
            probs.append(q)
        return torch.stack(drafts, 1), torch.stack(probs, 1)

    @torch.no_grad()
    def draft_confidences(
        self, hidden: torch.Tensor, first_tokens: torch.Tensor, drafts: torch.Tensor
    ) -> torch.Tensor:
        """Per drafted row [n, b] the confidence head's probability that it is accepted once the
        drafts before it are (the previous token: the anchor, then the drafts), float32."""
        prev = torch.cat([first_tokens.long()[:, None], drafts[:, :-1]], 1)  # [n, b]
        return torch.sigmoid(self.confidence_logits(hidden, self.markov_embed(prev)))


def confident_prefix(confidences: torch.Tensor, threshold: float) -> torch.Tensor:
    """Drafts to verify under DeepSpec's threshold rule (its eval's `_confident_prefix_length`): up
    to the first one whose confidence is below `threshold`; all of them when the threshold is 0.
    confidences [..., b] -> counts [...] (long): one row's or a batch's."""
    if threshold <= 0:
        shape, b = confidences.shape[:-1], confidences.shape[-1]
        return torch.full(shape, b, dtype=torch.long, device=confidences.device)
    return (~(confidences < threshold)).long().cumprod(-1).sum(-1)
