"""The attention of `dflash-generate`'s decode steps (transformers backend).

A one-token step of a sdpa target attends through `packed_gqa_sdpa`: the query heads of a key/value
group read the cache as it is stored, where transformers (before 5.24) copies every layer's cache to
the query heads' count at every step. `decode_attention` switches a model to it while a batch
decodes. `static_steps_allowed` says whether a 4D mask over the whole static cache is right for a
target (no sliding-window layers, an attention implementation that takes an additive 4D mask).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from transformers.integrations.sdpa_attention import sdpa_attention_forward


# The attention decode_batch runs a sdpa target with (transformers' attention-function registry).
DECODE_ATTENTION = "dflash_decode_sdpa"


def packed_gqa_sdpa(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' sdpa attention, except for a one-token query over grouped key/value heads: the
    query heads that share a key/value head become that head's query rows, [B, Hq, 1, D] -> [B, Hkv,
    Hq/Hkv, D], so the cache is read as it is stored. transformers (before 5.24) repeats the whole
    cache to Hq heads first (`repeat_kv`): a copy of every layer's cache at every decode step, 29%
    of the decoder's GPU time on a Qwen3-8B shape. Same values: each query row sees exactly the keys
    and values of its own head, and the mask ([B, 1, 1, L]) is shared by every head."""
    groups = getattr(module, "num_key_value_groups", 1)
    b, heads, q_len, dim = query.shape
    shared_mask = attention_mask is None or attention_mask.shape[1] == 1
    if q_len != 1 or groups == 1 or not shared_mask or kwargs.get("position_bias") is not None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    q = query.reshape(
        b, heads // groups, groups, dim
    )  # heads h = kv * groups + g, repeat_kv's order
    out = F.scaled_dot_product_attention(
        q,
        key,
        value,
        attn_mask=attention_mask,
        dropout_p=kwargs.get("dropout", 0.0),
        scale=kwargs.get("scaling"),
    )
    return out.reshape(b, heads, 1, dim).transpose(1, 2).contiguous(), None  # [B, 1, Hq, D]


@contextlib.contextmanager
def decode_attention(model: Any) -> Iterator[None]:
    """Inside the block, the model's sdpa attention is `packed_gqa_sdpa` (registered under
    DECODE_ATTENTION, its masks made as sdpa's); restored after, as the model is the caller's. Every
    config the model's modules read (a composite model's text config too) is switched."""
    configs = {
        id(c): c
        for m in model.modules()
        if (c := getattr(m, "config", None)) is not None
        and getattr(c, "_attn_implementation", None) == "sdpa"
    }
    if not configs:
        yield
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(DECODE_ATTENTION, packed_gqa_sdpa)
    AttentionMaskInterface.register(DECODE_ATTENTION, sdpa_mask)
    for c in configs.values():
        c._attn_implementation = DECODE_ATTENTION
    try:
        yield
    finally:
        for c in configs.values():
            c._attn_implementation = "sdpa"


def static_steps_allowed(config: Any) -> bool:
    """Whether a 4D mask over the whole cache is right for this target: every layer attends to its
    whole past (no sliding window) and the attention implementation takes an additive 4D mask."""
    layer_types = getattr(config, "layer_types", None) or []
    sliding = any(t != "full_attention" for t in layer_types) or (
        not layer_types
        and getattr(config, "sliding_window", None)
        and getattr(config, "use_sliding_window", False)
    )
    return not sliding and getattr(config, "_attn_implementation", "sdpa") in ("sdpa", "eager")
